variable "home_region" {
  description = "Region the AWS provider is configured with (IAM calls go there); the cluster's regions are in `regions`."
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+$", var.home_region))
    error_message = "home_region must be an AWS region name such as us-east-1."
  }
}

variable "cluster_name" {
  description = "Name of the cluster (3-20 lowercase letters, digits, hyphens)."
  type        = string
}

variable "regions" {
  description = "GPU hosts by region; see the root module's `regions`."
  type = map(object({
    instance_count    = number
    instance_type     = string
    slots             = number
    spot              = optional(bool, true)
    availability_zone = optional(string)
    cidr_index        = optional(number)
    root_volume_gb    = optional(number, 200)
  }))
}

variable "operator_cidrs" {
  description = "Your public address as a /32 (SSH is admitted from these only)."
  type        = list(string)
}

variable "ssh_public_key_file" {
  description = "Path of the OpenSSH public key installed on every host."
  type        = string
  default     = "~/.ssh/id_ed25519.pub"

  validation {
    condition     = endswith(var.ssh_public_key_file, ".pub")
    error_message = "ssh_public_key_file must name a public key (*.pub), never the private key."
  }
}

variable "force_destroy_checkpoints" {
  description = "Let `terraform destroy` delete the checkpoint buckets with their contents."
  type        = bool
  default     = false
}

variable "checkpoint_bucket_suffix" {
  description = "Appended to every checkpoint bucket name (<cluster_name>-<region>-ckpt-<suffix>): bucket names are global, so make it yours (e.g. your account id); empty: none."
  type        = string
  default     = ""
}
