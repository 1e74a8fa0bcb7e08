variable "cluster_name" {
  description = "Name of the cluster: prefixes host names, S3 buckets, IAM roles; tags every resource as cloudtrain:cluster. 3-20 lowercase letters, digits and hyphens (validated in modules/plan)."
  type        = string
}

variable "regions" {
  description = "GPU hosts by AWS region name: { instance_count, instance_type, slots (GPUs per host), spot = true, availability_zone = null, cidr_index = null, root_volume_gb = 200 }. See modules/plan for each field and its validation."
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
  description = "IPv4 CIDRs allowed SSH from outside the cluster, e.g. [\"<your public IP>/32\"]. Never 0.0.0.0/0: modules/plan refuses anything wider than a /16."
  type        = list(string)
}

variable "base_cidr" {
  description = "Private IPv4 block the regions' VPC CIDRs are carved from, one /region_prefix_length each."
  type        = string
  default     = "10.0.0.0/8"
}

variable "region_prefix_length" {
  description = "Prefix length of each region's VPC CIDR (16-24)."
  type        = number
  default     = 16
}

variable "training_ports" {
  description = "Port ranges the hosts open to the cluster's VPC CIDRs only. null: modules/plan's defaults (ssh 22, rendezvous 29400-29500, ephemeral 32768-60999, all TCP)."
  type = list(object({
    name      = string
    from_port = number
    to_port   = number
    protocol  = optional(string, "tcp")
  }))
  default = null
}

variable "ssh_public_key" {
  description = "OpenSSH public key for the hosts' default user (ubuntu), installed in every region; null for none."
  type        = string
  default     = null
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter with the AMI ID, resolved in each region. null: modules/region's default, the latest Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04)."
  type        = string
  default     = null
}

variable "assign_public_ip" {
  description = "Give each host a public IPv4 address for SSH from operator_cidrs. false: reach the hosts another way (VPN, a bastion)."
  type        = bool
  default     = true
}

variable "placement_strategy" {
  description = "Placement group strategy in each region: cluster (lowest latency), spread or partition."
  type        = string
  default     = "cluster"
}

variable "checkpoint_bucket_suffix" {
  description = "Appended to every checkpoint bucket name (<cluster_name>-<region>-ckpt-<suffix>); bucket names are global, so make it yours (e.g. your account id). See modules/plan."
  type        = string
  default     = ""

  validation {
    condition     = can(regex("^([a-z0-9][a-z0-9-]{0,18}[a-z0-9]|[a-z0-9]?)$", var.checkpoint_bucket_suffix))
    error_message = "checkpoint_bucket_suffix must be at most 20 lowercase letters, digits and hyphens, not starting or ending with a hyphen."
  }
}

variable "force_destroy_checkpoints" {
  description = "Let `terraform destroy` delete the checkpoint buckets with their contents. false: copy or delete the checkpoints first."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
