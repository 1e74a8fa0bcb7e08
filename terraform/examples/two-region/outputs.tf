output "hosts" {
  description = "Every host: { name, region, private_ip, public_ip, slots, instance_id }, ordered by region then index."
  value       = module.cluster.hosts
}

output "horovod_hosts" {
  description = "The horovodrun -H value."
  value       = module.cluster.horovod_hosts
}

output "checkpoint_buckets" {
  description = "Checkpoint bucket by region."
  value       = module.cluster.checkpoint_buckets
}

output "checkpoint_uri" {
  description = "Checkpoint URI template: Checkpointer(\"<this>/run1\") on every rank writes to the rank's own region's bucket."
  value       = module.cluster.checkpoint_uri
}
