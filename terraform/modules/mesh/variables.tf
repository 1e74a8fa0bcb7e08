variable "cluster_name" {
  description = "Name of the cluster, for tags and names."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name must be 3-20 characters of lowercase letters, digits and hyphens, start with a letter and not end with a hyphen."
  }
}

variable "vpcs" {
  description = "The VPC of each region, by region name (from modules/region): vpc_id, cidr_block, and route_table_id, the table that gets the routes to the peers."
  type = map(object({
    vpc_id         = string
    cidr_block     = string
    route_table_id = string
  }))

  validation {
    condition     = length(var.vpcs) > 0
    error_message = "vpcs must hold at least one region."
  }
}

variable "peer_pairs" {
  description = "The peerings to make (from modules/plan): key, requester and accepter region names, each unordered pair once. The connection is requested in the requester region and accepted in the accepter region."
  type = list(object({
    key       = string
    requester = string
    accepter  = string
  }))

  validation {
    condition     = alltrue([for p in var.peer_pairs : p.requester != p.accepter])
    error_message = "A region cannot peer with itself."
  }
  validation {
    condition     = length(distinct([for p in var.peer_pairs : join(":", sort([p.requester, p.accepter]))])) == length(var.peer_pairs)
    error_message = "Each region pair must appear once (a second peering between the same VPCs would fail, and its routes would clash)."
  }
}

variable "tags" {
  description = "Tags added to every peering connection (cloudtrain:cluster is always set)."
  type        = map(string)
  default     = {}
}
