# The layout of a four-region cluster: CIDRs, peer pairs, ports and host order.
# Run offline: `terraform init && terraform test` in modules/plan (no provider is involved).

variables {
  cluster_name   = "ctr"
  operator_cidrs = ["203.0.113.7/32"]
  regions = {
    "us-west-2"      = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 }
    "eu-west-1"      = { instance_count = 2, instance_type = "g5.xlarge", slots = 1, spot = false }
    "us-east-1"      = { instance_count = 2, instance_type = "g5.12xlarge", slots = 4 }
    "ap-northeast-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1, availability_zone = "ap-northeast-1c" }
  }
}

run "regions_are_sorted" {
  command = plan

  assert {
    condition     = output.region_names == tolist(["ap-northeast-1", "eu-west-1", "us-east-1", "us-west-2"])
    error_message = "region_names must be the sorted keys of regions, got ${jsonencode(output.region_names)}"
  }
}

run "cidrs_come_from_base_by_index" {
  command = plan

  assert {
    condition = [for r in output.region_names : output.regions[r].vpc_cidr] == [
      "10.0.0.0/16", "10.1.0.0/16", "10.2.0.0/16", "10.3.0.0/16",
    ]
    error_message = "VPC CIDRs must be base_cidr's /16 blocks taken in region order, got ${jsonencode(output.cluster_cidrs)}"
  }
  assert {
    condition     = output.regions["us-east-1"].subnet_cidr == "10.2.0.0/20"
    error_message = "The host subnet must be the first /20 of the region's VPC."
  }
  assert {
    condition     = output.cluster_cidrs == [for r in output.region_names : output.regions[r].vpc_cidr]
    error_message = "cluster_cidrs must list the VPC CIDRs in region order."
  }
}

run "cidrs_do_not_overlap" {
  command = plan

  # Same prefix length everywhere, so two blocks overlap exactly when their network addresses match.
  assert {
    condition     = alltrue([for c in output.cluster_cidrs : endswith(c, "/16")])
    error_message = "Every VPC CIDR must have region_prefix_length."
  }
  assert {
    condition     = length(distinct([for c in output.cluster_cidrs : cidrhost(c, 0)])) == length(output.cluster_cidrs)
    error_message = "Two regions got overlapping VPC CIDRs: ${jsonencode(output.cluster_cidrs)}"
  }
  assert {
    condition     = alltrue([for c in output.cluster_cidrs : cidrhost("${cidrhost(c, 0)}/8", 0) == "10.0.0.0"])
    error_message = "Every VPC CIDR must lie inside base_cidr."
  }
  assert {
    condition = alltrue([
      for r in values(output.regions) : cidrhost("${cidrhost(r.subnet_cidr, 0)}/16", 0) == cidrhost(r.vpc_cidr, 0)
    ])
    error_message = "Every host subnet must lie inside its own VPC."
  }
}

run "explicit_cidr_index_keeps_a_region_in_place" {
  command = plan

  variables {
    base_cidr            = "172.16.0.0/12"
    region_prefix_length = 20
    regions = {
      "us-east-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1, cidr_index = 0 }
      "eu-west-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1, cidr_index = 5 }
    }
  }

  assert {
    condition     = output.regions["us-east-1"].vpc_cidr == "172.16.0.0/20" && output.regions["eu-west-1"].vpc_cidr == "172.16.80.0/20"
    error_message = "cidr_index must choose the block: got ${jsonencode(output.cluster_cidrs)}"
  }
  assert {
    condition     = output.regions["eu-west-1"].subnet_cidr == "172.16.80.0/24"
    error_message = "The host subnet must be 4 bits longer than the VPC CIDR."
  }
}

run "every_pair_once" {
  command = plan

  assert {
    condition     = length(output.peer_pairs) == 4 * 3 / 2
    error_message = "4 regions need n(n-1)/2 = 6 peerings, got ${length(output.peer_pairs)}"
  }
  assert {
    condition     = length(distinct([for p in output.peer_pairs : join(":", sort([p.requester, p.accepter]))])) == length(output.peer_pairs)
    error_message = "A region pair is peered twice: ${jsonencode(output.peer_pairs)}"
  }
  assert {
    condition     = alltrue([for p in output.peer_pairs : p.requester != p.accepter && sort([p.requester, p.accepter])[0] == p.requester])
    error_message = "The requester must be the region that sorts first, and never the accepter itself."
  }
  assert {
    condition = [for p in output.peer_pairs : p.key] == [
      "ap-northeast-1:eu-west-1", "ap-northeast-1:us-east-1", "ap-northeast-1:us-west-2",
      "eu-west-1:us-east-1", "eu-west-1:us-west-2", "us-east-1:us-west-2",
    ]
    error_message = "Peer pairs must come in a fixed order, got ${jsonencode([for p in output.peer_pairs : p.key])}"
  }
}

run "one_region_needs_no_peering" {
  command = plan

  variables {
    regions = { "us-east-1" = { instance_count = 3, instance_type = "g5.xlarge", slots = 1 } }
  }

  assert {
    condition     = length(output.peer_pairs) == 0
    error_message = "A single region has nothing to peer with."
  }
  assert {
    condition     = [for h in output.hosts : h.name] == ["ctr-us-east-1-0", "ctr-us-east-1-1", "ctr-us-east-1-2"]
    error_message = "Hosts of one region must be ordered by index."
  }
}

run "hosts_ordered_by_region_then_index" {
  command = plan

  assert {
    condition = [for h in output.hosts : h.name] == [
      "ctr-ap-northeast-1-0", "ctr-eu-west-1-0", "ctr-eu-west-1-1", "ctr-us-east-1-0", "ctr-us-east-1-1", "ctr-us-west-2-0",
    ]
    error_message = "Hosts must be ordered by region name, then index: ${jsonencode([for h in output.hosts : h.name])}"
  }
  assert {
    condition     = [for h in output.hosts : h.slots] == [1, 1, 1, 4, 4, 1]
    error_message = "Each host must carry its region's slots."
  }
  assert {
    condition     = output.regions["us-east-1"].host_names == ["ctr-us-east-1-0", "ctr-us-east-1-1"]
    error_message = "A region's host_names must match its entries in hosts."
  }
  assert {
    condition     = output.horovod_hosts == "" && alltrue([for h in output.hosts : h.private_ip == "" && h.instance_id == ""])
    error_message = "Without instances the hosts have no addresses yet and there is no -H string."
  }
}

run "region_settings_pass_through" {
  command = plan

  assert {
    condition     = output.regions["eu-west-1"].spot == false && output.regions["us-east-1"].spot == true
    error_message = "spot must default to true and keep an explicit false."
  }
  assert {
    condition     = output.regions["ap-northeast-1"].availability_zone == "ap-northeast-1c" && output.regions["us-east-1"].availability_zone == null
    error_message = "availability_zone must pass through, null where unset."
  }
  assert {
    condition     = output.regions["us-east-1"].root_volume_gb == 200
    error_message = "root_volume_gb must default to 200."
  }
}

run "default_ports_cover_ssh_rendezvous_and_ephemeral" {
  command = plan

  assert {
    condition     = [for p in output.training_ports : "${p.name}:${p.protocol}:${p.from_port}-${p.to_port}"] == ["ssh:tcp:22-22", "rendezvous:tcp:29400-29500", "ephemeral:tcp:32768-60999"]
    error_message = "Default training ports changed: ${jsonencode(output.training_ports)}"
  }
  assert {
    condition     = output.operator_cidrs == tolist(["203.0.113.7/32"])
    error_message = "operator_cidrs must pass through."
  }
}

run "one_checkpoint_bucket_per_region_behind_one_template" {
  command = plan

  variables {
    checkpoint_bucket_suffix = "123456789012"
  }

  assert {
    condition     = output.checkpoint_buckets["eu-west-1"] == "ctr-eu-west-1-ckpt-123456789012" && length(output.checkpoint_buckets) == 4
    error_message = "Every region gets <cluster>-<region>-ckpt-<suffix>, got ${jsonencode(output.checkpoint_buckets)}"
  }
  assert {
    condition     = alltrue([for r, b in output.checkpoint_buckets : replace(output.checkpoint_uri, "{region}", r) == "s3://${b}"])
    error_message = "checkpoint_uri with {region} filled must name each region's bucket, got ${output.checkpoint_uri}"
  }
}
