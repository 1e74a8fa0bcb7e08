output "region_names" {
  description = "Region names, sorted: the order of every list this module returns."
  value       = local.region_names
}

output "regions" {
  description = "Per region: position (in region_names), cidr_index, vpc_cidr, subnet_cidr (the hosts' subnet), instance_type, slots, spot, availability_zone (null: choose), root_volume_gb and host_names (in order)."
  value       = local.regions

  precondition {
    condition     = local.newbits >= 0
    error_message = "region_prefix_length (/${var.region_prefix_length}) is shorter than base_cidr's prefix (${var.base_cidr}): each region's block must fit inside base_cidr."
  }
  precondition {
    condition     = alltrue([for name, index in local.cidr_index : index < local.region_capacity])
    error_message = "base_cidr ${var.base_cidr} holds ${local.region_capacity} blocks of /${var.region_prefix_length}; every region's cidr_index must be below that. Use a larger base_cidr or a longer region_prefix_length."
  }
  precondition {
    condition     = length(distinct(values(local.cidr_index))) == length(local.cidr_index)
    error_message = "Two regions got the same cidr_index (${jsonencode(local.cidr_index)}); their VPCs would overlap. Give every region a distinct cidr_index."
  }
}

output "cluster_cidrs" {
  description = "The VPC CIDR of every region, in region order: the only sources the training ports admit."
  value       = [for name in local.region_names : local.regions[name].vpc_cidr]
}

output "peer_pairs" {
  description = "The VPC peerings of the full mesh, each unordered region pair once, in a fixed order: objects with key (\"requester:accepter\"), requester and accepter."
  value       = local.peer_pairs
}

output "training_ports" {
  description = "The validated port ranges the hosts open to the cluster's CIDRs (name, from_port, to_port, protocol)."
  value       = var.training_ports
}

output "operator_cidrs" {
  description = "The validated operator CIDRs allowed SSH from outside, deduplicated and sorted."
  value       = sort(distinct(var.operator_cidrs))
}

output "hosts" {
  description = "Every host in order (region name, then index): name, region, private_ip, public_ip (\"\" when none), slots, instance_id. IPs and IDs are \"\" until instances is given."
  value       = local.hosts

  precondition {
    condition     = length(var.instances) == 0 || toset(keys(var.instances)) == toset([for h in local.host_layout : h.name])
    error_message = "instances must have exactly one entry per host named in the layout (${join(", ", [for h in local.host_layout : h.name])})."
  }
}

output "horovod_hosts" {
  description = "The horovodrun -H value, \"ip1:slots,ip2:slots\" over private IPs in host order; \"\" until instances is given."
  value       = length(var.instances) == 0 ? "" : join(",", [for h in local.hosts : "${h.private_ip}:${h.slots}"])
}

output "checkpoint_buckets" {
  description = "The checkpoint bucket name of every region: <cluster_name>-<region>-ckpt[-checkpoint_bucket_suffix]."
  value       = local.checkpoint_buckets

  precondition {
    condition     = alltrue([for b in values(local.checkpoint_buckets) : length(b) <= 63])
    error_message = "A checkpoint bucket name would be longer than S3's 63 characters (${jsonencode(local.checkpoint_buckets)}): shorten cluster_name or checkpoint_bucket_suffix."
  }
}

output "checkpoint_uri" {
  description = "The checkpoint URI template for cloudtrain: s3://<cluster_name>-{region}-ckpt[-suffix]; append /RUN and pass it to Checkpointer, which fills {region} with each rank's region."
  value       = local.checkpoint_uri_base
}
