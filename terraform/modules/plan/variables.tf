variable "cluster_name" {
  description = "Name of the cluster: prefixes host names and every resource name. Lowercase letters, digits and hyphens, 3-20 characters, starting with a letter."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name must be 3-20 characters of lowercase letters, digits and hyphens, start with a letter and not end with a hyphen (it becomes part of S3 bucket and IAM names)."
  }
}

variable "regions" {
  description = <<-EOT
    The GPU hosts of the cluster, by AWS region name. Per region:
    instance_count (hosts), instance_type (e.g. g5.xlarge), slots (GPUs per host, the N of horovodrun's host:N),
    spot (true: one-time spot instances), availability_zone (null: the first zone offering instance_type),
    cidr_index (which block of base_cidr the region's VPC gets; null: the region's position in sorted order —
    set it explicitly before adding a region that sorts earlier, so existing VPCs keep their CIDRs),
    root_volume_gb (root EBS volume).
  EOT
  type = map(object({
    instance_count    = number
    instance_type     = string
    slots             = number
    spot              = optional(bool, true)
    availability_zone = optional(string)
    cidr_index        = optional(number)
    root_volume_gb    = optional(number, 200)
  }))

  validation {
    condition     = length(var.regions) > 0
    error_message = "regions must name at least one region, e.g. { \"us-east-1\" = { instance_count = 2, instance_type = \"g5.xlarge\", slots = 1 } }."
  }
  validation {
    condition     = alltrue([for name in keys(var.regions) : can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+$", name))])
    error_message = "Every key of regions must be an AWS region name such as us-east-1 or eu-west-1."
  }
  validation {
    condition     = alltrue([for r in values(var.regions) : r.instance_count >= 1 && r.instance_count <= 64 && floor(r.instance_count) == r.instance_count])
    error_message = "instance_count must be a whole number from 1 to 64 in every region (drop a region from the map instead of giving it 0 hosts)."
  }
  validation {
    condition     = alltrue([for r in values(var.regions) : r.slots >= 1 && r.slots <= 16 && floor(r.slots) == r.slots])
    error_message = "slots (GPUs per host) must be a whole number from 1 to 16 in every region."
  }
  validation {
    condition     = alltrue([for r in values(var.regions) : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", r.instance_type))])
    error_message = "instance_type must be an EC2 instance type such as g5.xlarge or p4d.24xlarge."
  }
  validation {
    condition     = alltrue([for r in values(var.regions) : r.root_volume_gb >= 100 && r.root_volume_gb <= 16384 && floor(r.root_volume_gb) == r.root_volume_gb])
    error_message = "root_volume_gb must be a whole number from 100 (the Deep Learning AMI needs room) to 16384."
  }
  validation {
    condition = alltrue([
      for name, r in var.regions : r.availability_zone == null || startswith(coalesce(r.availability_zone, "-"), name)
    ])
    error_message = "availability_zone, where set, must be a zone of its own region (e.g. us-east-1a for us-east-1)."
  }
  validation {
    condition     = alltrue([for r in values(var.regions) : r.cidr_index == null || (try(r.cidr_index >= 0 && floor(r.cidr_index) == r.cidr_index, false))])
    error_message = "cidr_index, where set, must be a whole number >= 0."
  }
}

variable "base_cidr" {
  description = "Private IPv4 block that every region's VPC CIDR is carved from (one block of region_prefix_length per region). Must not overlap networks you peer with."
  type        = string
  default     = "10.0.0.0/8"

  validation {
    condition     = can(cidrhost(var.base_cidr, 0)) && !strcontains(var.base_cidr, ":")
    error_message = "base_cidr must be an IPv4 CIDR block such as 10.0.0.0/8."
  }
  validation {
    condition     = can(cidrhost(var.base_cidr, 0)) && try(cidrhost(var.base_cidr, 0) == split("/", var.base_cidr)[0], false)
    error_message = "base_cidr must be written with its network address (e.g. 10.0.0.0/8, not 10.1.2.3/8)."
  }
  validation {
    # Inside a private range P: at least as long a prefix, and the same network once cut to P's length.
    condition = anytrue([
      for private in ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"] : try(
        tonumber(split("/", var.base_cidr)[1]) >= tonumber(split("/", private)[1]) &&
        cidrhost("${split("/", var.base_cidr)[0]}/${split("/", private)[1]}", 0) == cidrhost(private, 0),
        false
      )
    ])
    error_message = "base_cidr must lie inside a private range: 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16."
  }
}

variable "region_prefix_length" {
  description = "Prefix length of each region's VPC CIDR (AWS allows /16 to /28; at most /24 here so the host subnet, 4 bits longer, stays usable)."
  type        = number
  default     = 16

  validation {
    condition     = var.region_prefix_length >= 16 && var.region_prefix_length <= 24 && floor(var.region_prefix_length) == var.region_prefix_length
    error_message = "region_prefix_length must be a whole number from 16 to 24."
  }
}

variable "training_ports" {
  description = <<-EOT
    TCP/UDP port ranges the hosts of the cluster open to each other, and only to each other (the VPC CIDRs of
    all regions). The defaults cover what horovodrun --gloo and torch.distributed use: ssh (horovodrun starts
    remote workers over ssh), the torch.distributed rendezvous ports (torchrun's 29400, MASTER_PORT 29500), and
    the Linux ephemeral range, where gloo's pair connections, horovod's driver/task services, NCCL's sockets
    and the TCPStore on a free port all listen.
  EOT
  type = list(object({
    name      = string
    from_port = number
    to_port   = number
    protocol  = optional(string, "tcp")
  }))
  nullable = false
  default = [
    { name = "ssh", from_port = 22, to_port = 22 },
    { name = "rendezvous", from_port = 29400, to_port = 29500 },
    { name = "ephemeral", from_port = 32768, to_port = 60999 },
  ]

  validation {
    condition     = length(var.training_ports) > 0
    error_message = "training_ports must list at least one port range (the hosts could not talk to each other)."
  }
  validation {
    condition = alltrue([
      for p in var.training_ports :
      p.from_port >= 1 && p.to_port <= 65535 && p.from_port <= p.to_port && floor(p.from_port) == p.from_port && floor(p.to_port) == p.to_port
    ])
    error_message = "Every training port range needs whole numbers 1 <= from_port <= to_port <= 65535."
  }
  validation {
    condition     = alltrue([for p in var.training_ports : contains(["tcp", "udp"], p.protocol)])
    error_message = "protocol must be \"tcp\" or \"udp\"."
  }
  validation {
    condition     = length(distinct([for p in var.training_ports : p.name])) == length(var.training_ports) && alltrue([for p in var.training_ports : can(regex("^[a-z][a-z0-9-]*$", p.name))])
    error_message = "Training port names must be unique, lowercase letters, digits and hyphens (they name security group rules)."
  }
}

variable "operator_cidrs" {
  description = "IPv4 CIDRs allowed to reach the hosts by SSH from outside the cluster (your workstation as a /32, your office network). Never 0.0.0.0/0: nothing wider than a /16."
  type        = list(string)

  validation {
    condition     = alltrue([for c in var.operator_cidrs : can(cidrhost(c, 0)) && !strcontains(c, ":")])
    error_message = "Every operator_cidrs entry must be an IPv4 CIDR block such as 203.0.113.7/32."
  }
  validation {
    condition     = alltrue([for c in var.operator_cidrs : try(tonumber(split("/", c)[1]) >= 16, false)])
    error_message = "operator_cidrs must not open SSH to the internet: 0.0.0.0/0 and any block wider than a /16 are refused. Use your own address as a /32."
  }
}

variable "instances" {
  description = "The launched hosts, by host name (as in the hosts output): private_ip, public_ip (null or \"\" when none), instance_id. Empty while planning the layout; given, it fills the hosts and horovod_hosts outputs."
  type = map(object({
    private_ip  = string
    public_ip   = optional(string)
    instance_id = string
  }))
  default = {}
}

variable "checkpoint_bucket_suffix" {
  description = "Appended to every checkpoint bucket name (<cluster_name>-<region>-ckpt[-suffix]): S3 bucket names are global, so use something of your own, e.g. your account id. Lowercase letters, digits and hyphens, at most 20."
  type        = string
  default     = ""
  nullable    = false

  validation {
    condition     = can(regex("^([a-z0-9][a-z0-9-]{0,18}[a-z0-9]|[a-z0-9]?)$", var.checkpoint_bucket_suffix))
    error_message = "checkpoint_bucket_suffix must be at most 20 lowercase letters, digits and hyphens, not starting or ending with a hyphen."
  }
}
