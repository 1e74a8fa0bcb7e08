# With the launched instances given, the module renders the hosts list and the horovodrun -H
# string that `cloudtrain hosts` reads from `terraform output -json`.

variables {
  cluster_name   = "ctr"
  operator_cidrs = ["198.51.100.0/24"]
  regions = {
    "us-east-1" = { instance_count = 2, instance_type = "g5.12xlarge", slots = 4 }
    "eu-west-1" = { instance_count = 1, instance_type = "g5.xlarge", slots = 1 }
  }
  instances = {
    "ctr-us-east-1-1" = { private_ip = "10.1.0.11", public_ip = "", instance_id = "i-0000000000000000b" }
    "ctr-eu-west-1-0" = { private_ip = "10.0.0.10", public_ip = "198.51.100.20", instance_id = "i-0000000000000000c" }
    "ctr-us-east-1-0" = { private_ip = "10.1.0.10", public_ip = null, instance_id = "i-0000000000000000a" }
  }
}

run "hosts_have_the_exact_shape" {
  command = plan

  assert {
    condition = output.hosts == [
      { name = "ctr-eu-west-1-0", region = "eu-west-1", private_ip = "10.0.0.10", public_ip = "198.51.100.20", slots = 1, instance_id = "i-0000000000000000c" },
      { name = "ctr-us-east-1-0", region = "us-east-1", private_ip = "10.1.0.10", public_ip = "", slots = 4, instance_id = "i-0000000000000000a" },
      { name = "ctr-us-east-1-1", region = "us-east-1", private_ip = "10.1.0.11", public_ip = "", slots = 4, instance_id = "i-0000000000000000b" },
    ]
    error_message = "hosts: ${jsonencode(output.hosts)}"
  }
  assert {
    condition     = alltrue([for h in output.hosts : toset(keys(h)) == toset(["name", "region", "private_ip", "public_ip", "slots", "instance_id"])])
    error_message = "Every host must have exactly name, region, private_ip, public_ip, slots, instance_id."
  }
}

run "horovod_hosts_in_host_order" {
  command = plan

  assert {
    condition     = output.horovod_hosts == "10.0.0.10:1,10.1.0.10:4,10.1.0.11:4"
    error_message = "horovod_hosts: ${output.horovod_hosts}"
  }
}

run "instances_must_match_the_layout" {
  command = plan

  variables {
    instances = {
      "ctr-us-east-1-0" = { private_ip = "10.1.0.10", instance_id = "i-0000000000000000a" }
    }
  }

  expect_failures = [output.hosts]
}
