output "peering_connection_ids" {
  description = "ID of each peering connection, by pair key (\"requester:accepter\")."
  value       = { for key, accepted in aws_vpc_peering_connection_accepter.this : key => accepted.id }
}
