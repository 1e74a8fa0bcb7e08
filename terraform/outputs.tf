output "hosts" {
  description = "Every host, ordered by region name then index: { name, region, private_ip, public_ip (\"\" when none), slots, instance_id }. `cloudtrain hosts` reads this from `terraform output -json`."
  value       = module.inventory.hosts
}

output "horovod_hosts" {
  description = "The horovodrun -H value: \"ip1:slots,ip2:slots\" over the hosts' private IPs, in host order."
  value       = module.inventory.horovod_hosts
}

output "checkpoint_buckets" {
  description = "Checkpoint bucket name by region: hosts in a region write s3://<bucket>/ there."
  value       = { for name, region in module.region : name => region.checkpoint_bucket }
}

output "checkpoint_uri" {
  description = "Checkpoint URI template for cloudtrain: append /RUN and pass it to Checkpointer on every rank; {region} becomes the rank's region, so each rank writes to its own region's bucket."
  value       = module.plan.checkpoint_uri
}

output "cluster_cidrs" {
  description = "VPC CIDR by region."
  value       = { for name, layout in module.plan.regions : name => layout.vpc_cidr }
}

output "peering_connection_ids" {
  description = "VPC peering connection ID by region pair (\"requester:accepter\")."
  value       = module.mesh.peering_connection_ids
}
