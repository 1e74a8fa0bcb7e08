cluster_name = "ct-demo"

# Two g5.xlarge (one NVIDIA A10G each) per region, as spot instances.
regions = {
  "us-east-1" = { instance_count = 2, instance_type = "g5.xlarge", slots = 1, spot = true }
  "eu-west-1" = { instance_count = 2, instance_type = "g5.xlarge", slots = 1, spot = true }
}

# A documentation address: replace it with your own public IP as a /32, or pass
#   -var "operator_cidrs=[\"$(curl -s https://checkip.amazonaws.com)/32\"]"
operator_cidrs = ["203.0.113.10/32"]

# A demo cluster: `terraform destroy` also deletes the checkpoints. Copy out what you want to keep.
force_destroy_checkpoints = true
