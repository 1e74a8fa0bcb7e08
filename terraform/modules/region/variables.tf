variable "region" {
  description = "AWS region this module builds in; set as `region` on every regional resource (AWS provider 6)."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "cluster_name" {
  description = "Name of the cluster (tags, resource names, the S3 bucket prefix). 3-20 lowercase letters, digits and hyphens."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name must be 3-20 characters of lowercase letters, digits and hyphens, start with a letter and not end with a hyphen."
  }
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of this region's VPC (from modules/plan); must not overlap any other region's."
  type        = string

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && try(tonumber(split("/", var.vpc_cidr)[1]) >= 16 && tonumber(split("/", var.vpc_cidr)[1]) <= 28, false)
    error_message = "vpc_cidr must be an IPv4 CIDR from /16 to /28 (the sizes AWS allows for a VPC)."
  }
}

variable "subnet_cidr" {
  description = "IPv4 CIDR of the hosts' subnet, inside vpc_cidr (from modules/plan)."
  type        = string

  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0)) && try(tonumber(split("/", var.subnet_cidr)[1]) <= 28, false)
    error_message = "subnet_cidr must be an IPv4 CIDR no smaller than /28."
  }
}

variable "availability_zone" {
  description = "Zone for the subnet, and so for every host and the cluster placement group. null: the first zone (sorted) that offers instance_type."
  type        = string
  default     = null

  validation {
    condition     = var.availability_zone == null || can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+[a-z]$", coalesce(var.availability_zone, "-")))
    error_message = "availability_zone must be a zone name such as us-east-1a, or null."
  }
}

variable "host_names" {
  description = "Names of this region's hosts, in order (from modules/plan): one instance each, tagged Name."
  type        = list(string)

  validation {
    condition     = length(var.host_names) > 0 && length(distinct(var.host_names)) == length(var.host_names)
    error_message = "host_names must name at least one host, each once."
  }
}

variable "instance_type" {
  description = "EC2 instance type of every host in the region, e.g. g5.xlarge."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.instance_type))
    error_message = "instance_type must be an EC2 instance type such as g5.xlarge."
  }
}

variable "slots" {
  description = "GPUs per host: the N of horovodrun's host:N, and the cloudtrain:slots tag `cloudtrain hosts --ec2` reads."
  type        = number

  validation {
    condition     = var.slots >= 1 && var.slots <= 16 && floor(var.slots) == var.slots
    error_message = "slots must be a whole number from 1 to 16."
  }
}

variable "spot" {
  description = "true: one-time spot instances, terminated on interruption (cloudtrain's spot watcher reads the 2-minute notice from instance metadata); false: on-demand."
  type        = bool
  default     = true
}

variable "root_volume_gb" {
  description = "Size of each host's encrypted gp3 root volume in GiB (the Deep Learning AMI needs 100 or more)."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_gb >= 100 && var.root_volume_gb <= 16384 && floor(var.root_volume_gb) == var.root_volume_gb
    error_message = "root_volume_gb must be a whole number from 100 to 16384."
  }
}

variable "peer_cidrs" {
  description = "VPC CIDRs of every region of the cluster, this one included: the only sources admitted on training_ports, and the only destinations of unrestricted egress."
  type        = list(string)

  validation {
    condition     = length(var.peer_cidrs) > 0 && alltrue([for c in var.peer_cidrs : can(cidrhost(c, 0)) && try(tonumber(split("/", c)[1]) >= 16, false)])
    error_message = "peer_cidrs must be VPC CIDRs (IPv4, /16 or longer), never 0.0.0.0/0."
  }
}

variable "training_ports" {
  description = "Port ranges opened to peer_cidrs only (from modules/plan): name, from_port, to_port, protocol (tcp or udp)."
  type = list(object({
    name      = string
    from_port = number
    to_port   = number
    protocol  = optional(string, "tcp")
  }))

  validation {
    condition = alltrue([
      for p in var.training_ports : p.from_port >= 1 && p.from_port <= p.to_port && p.to_port <= 65535 && contains(["tcp", "udp"], p.protocol)
    ])
    error_message = "Every training port range needs 1 <= from_port <= to_port <= 65535 and protocol tcp or udp."
  }
  validation {
    condition     = length(distinct([for p in var.training_ports : p.name])) == length(var.training_ports)
    error_message = "Training port names must be unique."
  }
}

variable "operator_cidrs" {
  description = "IPv4 CIDRs allowed SSH (port 22) from outside the cluster. Never 0.0.0.0/0: nothing wider than a /16."
  type        = list(string)

  validation {
    condition     = alltrue([for c in var.operator_cidrs : can(cidrhost(c, 0)) && !strcontains(c, ":") && try(tonumber(split("/", c)[1]) >= 16, false)])
    error_message = "operator_cidrs must be IPv4 CIDRs of /16 or longer: 0.0.0.0/0 would open SSH to the internet. Use your own address as a /32."
  }
}

variable "ssh_public_key" {
  description = "OpenSSH public key installed for the default user (ubuntu) on every host; null for none (then reach hosts another way)."
  type        = string
  default     = null

  validation {
    condition     = var.ssh_public_key == null || can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp[0-9]+) [A-Za-z0-9+/=]+", coalesce(var.ssh_public_key, "-")))
    error_message = "ssh_public_key must be an OpenSSH public key line (ssh-ed25519 AAAA..., ssh-rsa AAAA... or ecdsa-sha2-...), or null."
  }
}

variable "ami_ssm_parameter" {
  description = "Public SSM parameter holding the AMI ID. Default: the latest Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04). Any /aws/service/deeplearning/ami/... path works, e.g. a PyTorch DLAMI."
  type        = string
  nullable    = false
  default     = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"

  validation {
    condition     = can(regex("^/[A-Za-z0-9_./-]+$", var.ami_ssm_parameter))
    error_message = "ami_ssm_parameter must be an SSM parameter path such as /aws/service/deeplearning/ami/x86_64/<ami-type>/latest/ami-id."
  }
}

variable "ami_owners" {
  description = "Accounts allowed to own the AMI the SSM parameter names (a guard against a parameter that points elsewhere). \"amazon\" covers the Deep Learning AMIs."
  type        = list(string)
  default     = ["amazon"]

  validation {
    condition     = length(var.ami_owners) > 0 && alltrue([for o in var.ami_owners : can(regex("^(amazon|self|[0-9]{12})$", o))])
    error_message = "ami_owners must list \"amazon\", \"self\" or 12-digit account IDs."
  }
}

variable "assign_public_ip" {
  description = "Give each host a public IPv4 address, so operator_cidrs can SSH in directly (ingress is still limited to them)."
  type        = bool
  default     = true
}

variable "placement_strategy" {
  description = "Placement group strategy for the region's hosts: cluster (one rack, lowest latency, the usual for training), spread or partition."
  type        = string
  default     = "cluster"

  validation {
    condition     = contains(["cluster", "spread", "partition"], var.placement_strategy)
    error_message = "placement_strategy must be cluster, spread or partition."
  }
}

variable "checkpoint_bucket" {
  description = "Name of this region's checkpoint bucket (modules/plan's checkpoint_buckets): only this region's hosts may use it."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.checkpoint_bucket))
    error_message = "checkpoint_bucket must be a valid S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens."
  }
}

variable "force_destroy_bucket" {
  description = "Let `terraform destroy` delete the checkpoint bucket with every checkpoint in it. false: destroy stops at a non-empty bucket."
  type        = bool
  default     = false
}

variable "noncurrent_version_days" {
  description = "Days an overwritten or deleted checkpoint object version is kept (versioning is on) before it expires."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_days >= 1 && floor(var.noncurrent_version_days) == var.noncurrent_version_days
    error_message = "noncurrent_version_days must be a whole number of days, at least 1."
  }
}

variable "tags" {
  description = "Tags added to every resource (cloudtrain:cluster and cloudtrain:region are always set)."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.tags) : !startswith(k, "cloudtrain:")])
    error_message = "Tag keys starting with cloudtrain: are reserved; the module sets them."
  }
  validation {
    # Instance tags are readable from instance metadata (instance_metadata_tags), which allows only these.
    condition     = alltrue([for k in keys(var.tags) : can(regex("^[A-Za-z0-9+=.,_:@-]+$", k))])
    error_message = "Tag keys may use only letters, digits and + - = . , _ : @ (instance metadata tags allow no spaces or slashes)."
  }
}
