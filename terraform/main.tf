# cloudtrain: a data-parallel GPU cluster spread over AWS regions.
#
#   plan       lays the cluster out (CIDRs, peer pairs, ports, host order); no provider, tested offline
#   region     per region: VPC, security group, hosts, checkpoint bucket
#   mesh       VPC peering between every pair of regions, with routes both ways
#   inventory  modules/plan again, given the launched instances: the hosts list and horovodrun -H
#
# One AWS provider (configured by the caller, see examples/two-region) serves all regions: every
# regional resource sets `region` (AWS provider 6).

module "plan" {
  source = "./modules/plan"

  cluster_name         = var.cluster_name
  regions              = var.regions
  operator_cidrs       = var.operator_cidrs
  base_cidr            = var.base_cidr
  region_prefix_length = var.region_prefix_length
  training_ports       = var.training_ports

  checkpoint_bucket_suffix = var.checkpoint_bucket_suffix
}

module "region" {
  source   = "./modules/region"
  for_each = module.plan.regions

  region            = each.key
  cluster_name      = var.cluster_name
  vpc_cidr          = each.value.vpc_cidr
  subnet_cidr       = each.value.subnet_cidr
  availability_zone = each.value.availability_zone
  host_names        = each.value.host_names
  instance_type     = each.value.instance_type
  slots             = each.value.slots
  spot              = each.value.spot
  root_volume_gb    = each.value.root_volume_gb
  checkpoint_bucket = module.plan.checkpoint_buckets[each.key]

  peer_cidrs     = module.plan.cluster_cidrs
  training_ports = module.plan.training_ports
  operator_cidrs = module.plan.operator_cidrs

  ssh_public_key       = var.ssh_public_key
  ami_ssm_parameter    = var.ami_ssm_parameter
  assign_public_ip     = var.assign_public_ip
  placement_strategy   = var.placement_strategy
  force_destroy_bucket = var.force_destroy_checkpoints
  tags                 = var.tags
}

module "mesh" {
  source = "./modules/mesh"

  cluster_name = var.cluster_name
  vpcs = {
    for name, region in module.region : name => {
      vpc_id         = region.vpc_id
      cidr_block     = region.vpc_cidr
      route_table_id = region.route_table_id
    }
  }
  peer_pairs = module.plan.peer_pairs
  tags       = var.tags
}

module "inventory" {
  source = "./modules/plan"

  cluster_name         = var.cluster_name
  regions              = var.regions
  operator_cidrs       = var.operator_cidrs
  base_cidr            = var.base_cidr
  region_prefix_length = var.region_prefix_length
  training_ports       = var.training_ports
  instances            = merge([for region in module.region : region.instances]...)
}
