# Bad input is refused at plan time with a message that says how to fix it.

variables {
  cluster_name   = "ctr"
  operator_cidrs = ["203.0.113.7/32"]
  regions = {
    "us-east-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 }
    "eu-west-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 }
  }
}

run "empty_regions" {
  command = plan
  variables {
    regions = {}
  }
  expect_failures = [var.regions]
}

run "not_a_region_name" {
  command = plan
  variables {
    regions = { "useast1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 } }
  }
  expect_failures = [var.regions]
}

run "zero_hosts" {
  command = plan
  variables {
    regions = { "us-east-1" = { instance_count = 0, instance_type = "g5.xlarge", slots = 1 } }
  }
  expect_failures = [var.regions]
}

run "zero_slots" {
  command = plan
  variables {
    regions = { "us-east-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 0 } }
  }
  expect_failures = [var.regions]
}

run "bad_instance_type" {
  command = plan
  variables {
    regions = { "us-east-1" = { instance_count = 1, instance_type = "a big gpu", slots = 1 } }
  }
  expect_failures = [var.regions]
}

run "zone_of_another_region" {
  command = plan
  variables {
    regions = { "us-east-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1, availability_zone = "eu-west-1a" } }
  }
  expect_failures = [var.regions]
}

run "operator_cidr_open_to_the_world" {
  command = plan
  variables {
    operator_cidrs = ["203.0.113.7/32", "0.0.0.0/0"]
  }
  expect_failures = [var.operator_cidrs]
}

run "operator_cidr_too_wide" {
  command = plan
  variables {
    operator_cidrs = ["0.0.0.0/1", "128.0.0.0/1"]
  }
  expect_failures = [var.operator_cidrs]
}

run "operator_cidr_not_a_cidr" {
  command = plan
  variables {
    operator_cidrs = ["my laptop"]
  }
  expect_failures = [var.operator_cidrs]
}

run "public_base_cidr" {
  command = plan
  variables {
    base_cidr = "8.0.0.0/8"
  }
  expect_failures = [var.base_cidr]
}

run "unaligned_base_cidr" {
  command = plan
  variables {
    base_cidr = "10.1.2.3/8"
  }
  expect_failures = [var.base_cidr]
}

run "region_block_larger_than_base" {
  command = plan
  variables {
    base_cidr = "192.168.0.0/20"
  }
  expect_failures = [output.regions]
}

run "more_regions_than_base_holds" {
  command = plan
  variables {
    base_cidr = "10.0.0.0/16"
    # A /16 base with /16 regions holds one region; two are asked for.
  }
  expect_failures = [output.regions]
}

run "duplicate_cidr_index" {
  command = plan
  variables {
    regions = {
      "us-east-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1, cidr_index = 0 }
      "eu-west-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 }
    }
  }
  # eu-west-1 sorts first and takes position 0 by default: the same block as us-east-1's explicit 0.
  expect_failures = [output.regions]
}

run "bad_port_range" {
  command = plan
  variables {
    training_ports = [{ name = "backwards", from_port = 30000, to_port = 29000 }]
  }
  expect_failures = [var.training_ports]
}

run "bad_cluster_name" {
  command = plan
  variables {
    cluster_name = "My_Cluster"
  }
  expect_failures = [var.cluster_name]
}

run "bucket_suffix_must_be_a_bucket_name_part" {
  command = plan

  variables {
    checkpoint_bucket_suffix = "Not_Valid"
  }

  expect_failures = [var.checkpoint_bucket_suffix]
}
