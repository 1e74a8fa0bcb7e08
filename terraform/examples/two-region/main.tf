# Two regions, two spot GPU hosts each, peered, with a checkpoint bucket per region.
#
#   terraform init && terraform apply        (see ../../README.md; this costs money until destroyed)

provider "aws" {
  # The home region: IAM (global) is called here. Every regional resource names its own region.
  region = var.home_region
}

module "cluster" {
  source = "../.."

  cluster_name              = var.cluster_name
  regions                   = var.regions
  operator_cidrs            = var.operator_cidrs
  ssh_public_key            = file(pathexpand(var.ssh_public_key_file))
  force_destroy_checkpoints = var.force_destroy_checkpoints
  checkpoint_bucket_suffix  = var.checkpoint_bucket_suffix
}
