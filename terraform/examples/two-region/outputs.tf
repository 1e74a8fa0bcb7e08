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
