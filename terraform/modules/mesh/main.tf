# mesh: inter-region VPC peering between every pair of the cluster's regions.
#
# For each pair: the connection is requested in the requester region (peer_region = accepter),
# accepted in the accepter region, and each VPC's route table gets a route to the other's CIDR
# through it. Every resource sets `region` (one AWS provider, provider 6).

locals {
  tags  = merge(var.tags, { "cloudtrain:cluster" = var.cluster_name })
  pairs = { for p in var.peer_pairs : p.key => p }
}

resource "aws_vpc_peering_connection" "this" {
  for_each = local.pairs

  region      = each.value.requester
  vpc_id      = var.vpcs[each.value.requester].vpc_id
  peer_vpc_id = var.vpcs[each.value.accepter].vpc_id
  peer_region = each.value.accepter
  # Inter-region peering cannot be auto-accepted from the requester's side.
  auto_accept = false

  tags = merge(local.tags, {
    Name = "${var.cluster_name}-${each.value.requester}-${each.value.accepter}"
    Side = "requester"
  })

  lifecycle {
    precondition {
      condition     = contains(keys(var.vpcs), each.value.requester) && contains(keys(var.vpcs), each.value.accepter)
      error_message = "Peer pair ${each.key} names a region with no entry in vpcs."
    }
  }
}

resource "aws_vpc_peering_connection_accepter" "this" {
  for_each = local.pairs

  region                    = each.value.accepter
  vpc_peering_connection_id = aws_vpc_peering_connection.this[each.key].id
  auto_accept               = true

  tags = merge(local.tags, {
    Name = "${var.cluster_name}-${each.value.requester}-${each.value.accepter}"
    Side = "accepter"
  })
}

# Both routes name the accepter resource's ID (the same connection), so neither is created
# before the peering is active.
resource "aws_route" "requester_to_accepter" {
  for_each = local.pairs

  region                    = each.value.requester
  route_table_id            = var.vpcs[each.value.requester].route_table_id
  destination_cidr_block    = var.vpcs[each.value.accepter].cidr_block
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this[each.key].id
}

resource "aws_route" "accepter_to_requester" {
  for_each = local.pairs

  region                    = each.value.accepter
  route_table_id            = var.vpcs[each.value.accepter].route_table_id
  destination_cidr_block    = var.vpcs[each.value.requester].cidr_block
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this[each.key].id
}
