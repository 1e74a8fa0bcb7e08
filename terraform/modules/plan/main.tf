# plan: the layout of a multi-region training cluster, computed without any provider.
#
# Everything that can be decided before talking to AWS is decided here, so that `terraform test`
# checks it offline (see tests/): each region's checkpoint bucket name, each region's VPC CIDR, carved from base_cidr by the region's
# index; the peer pairs of the full mesh, each unordered pair once; the ports the hosts open to each
# other; and the hosts themselves, ordered by region name and then index. The root module calls
# this module twice: once as `plan` to lay the cluster out, once as `inventory` with the launched
# instances, which fills the hosts list and the horovodrun -H string.

locals {
  # Sorted so that everything derived from it (default CIDR indices, pairs, host order) is the
  # same on every run, whatever order the map was written in.
  region_names = sort(keys(var.regions))

  base_prefix = tonumber(split("/", var.base_cidr)[1])
  newbits     = var.region_prefix_length - local.base_prefix
  # How many region blocks base_cidr holds; 0 where the region prefix is shorter than the base's.
  region_capacity = local.newbits >= 0 ? pow(2, local.newbits) : 0

  cidr_index = {
    for position, name in local.region_names : name => coalesce(var.regions[name].cidr_index, position)
  }
  # null where the index does not fit; the preconditions on output.regions say why.
  vpc_cidr = {
    for name in local.region_names : name => try(cidrsubnet(var.base_cidr, local.newbits, local.cidr_index[name]), null)
  }

  regions = {
    for position, name in local.region_names : name => {
      position          = position
      cidr_index        = local.cidr_index[name]
      vpc_cidr          = local.vpc_cidr[name]
      subnet_cidr       = try(cidrsubnet(local.vpc_cidr[name], 4, 0), null)
      instance_type     = var.regions[name].instance_type
      slots             = var.regions[name].slots
      spot              = var.regions[name].spot
      availability_zone = var.regions[name].availability_zone
      root_volume_gb    = var.regions[name].root_volume_gb
      host_names        = [for i in range(var.regions[name].instance_count) : "${var.cluster_name}-${name}-${i}"]
    }
  }

  # Every unordered pair once; the requester is the region that sorts first.
  peer_pairs = flatten([
    for i, requester in local.region_names : [
      for accepter in slice(local.region_names, i + 1, length(local.region_names)) : {
        key       = "${requester}:${accepter}"
        requester = requester
        accepter  = accepter
      }
    ]
  ])

  # One checkpoint bucket per region, named so that one URI template finds each rank's:
  # cloudtrain's Checkpointer("s3://<cluster>-{region}-ckpt[-suffix]/RUN") fills in the rank's region.
  bucket_suffix       = var.checkpoint_bucket_suffix == "" ? "" : "-${var.checkpoint_bucket_suffix}"
  checkpoint_buckets  = { for name in local.region_names : name => "${var.cluster_name}-${name}-ckpt${local.bucket_suffix}" }
  checkpoint_uri_base = "s3://${var.cluster_name}-{region}-ckpt${local.bucket_suffix}"

  host_layout = flatten([
    for name in local.region_names : [
      for host in local.regions[name].host_names : {
        name   = host
        region = name
        slots  = local.regions[name].slots
      }
    ]
  ])

  # The shape `cloudtrain hosts` parses from `terraform output -json`: keep it exactly so.
  hosts = [
    for h in local.host_layout : {
      name        = h.name
      region      = h.region
      private_ip  = try(var.instances[h.name].private_ip, "")
      public_ip   = try(coalesce(var.instances[h.name].public_ip, ""), "")
      slots       = h.slots
      instance_id = try(var.instances[h.name].instance_id, "")
    }
  ]
}
