terraform {
  required_version = ">= 1.7"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.x: one provider for every region, with `region` set on each resource.
      version = "~> 6.0"
    }
  }
}
