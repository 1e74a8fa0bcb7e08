output "vpc_id" {
  description = "ID of the region's VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "CIDR of the region's VPC."
  value       = aws_vpc.this.cidr_block
}

output "route_table_id" {
  description = "Route table of the hosts' subnet: modules/mesh adds the routes to the peer VPCs here."
  value       = aws_route_table.this.id
}

output "security_group_id" {
  description = "Security group of the hosts."
  value       = aws_security_group.hosts.id
}

output "availability_zone" {
  description = "Zone the hosts run in."
  value       = aws_subnet.hosts.availability_zone
}

output "checkpoint_bucket" {
  description = "Name of the region's checkpoint bucket."
  value       = aws_s3_bucket.checkpoints.bucket
}

output "instances" {
  description = "The hosts, by host name: private_ip, public_ip (\"\" when none), instance_id."
  value = {
    for name, host in aws_instance.host : name => {
      private_ip  = host.private_ip
      public_ip   = host.public_ip == null ? "" : host.public_ip
      instance_id = host.id
    }
  }
}
