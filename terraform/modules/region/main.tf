# region: one region of a cloudtrain cluster.
#
# A VPC with one subnet in one zone (a cluster placement group lives in a single zone), a security
# group that admits the training ports only from the cluster's own VPC CIDRs and SSH from outside
# only from operator_cidrs, the hosts (one aws_instance each, from a launch template: Deep
# Learning AMI found by SSM parameter, spot by instance_market_options, IMDSv2 required), and an
# encrypted, versioned, private S3 bucket for checkpoints that only this region's hosts may use.
# The hosts boot with TCP settings for the links between regions (local.host_tcp).
# Peering to the other regions is modules/mesh's job; it adds routes to route_table_id.
#
# One AWS provider serves every region (provider 6): each regional resource sets `region`.

locals {
  tags = merge(var.tags, {
    "cloudtrain:cluster" = var.cluster_name
    "cloudtrain:region"  = var.region
  })
  name = "${var.cluster_name}-${var.region}"

  availability_zone = coalesce(var.availability_zone, try(sort(data.aws_ec2_instance_type_offerings.this.locations)[0], "none"))

  training_rules = {
    for pair in setproduct(var.training_ports, var.peer_cidrs) : "${pair[0].name}/${pair[1]}" => {
      port = pair[0]
      cidr = pair[1]
    }
  }
  # Outbound to the internet only for what hosts fetch there (packages, AWS APIs); everything
  # else only to the cluster.
  web_egress_ports = { http = 80, https = 443 }

  # TCP for the links between regions: buffer ceilings that fit their bandwidth-delay product
  # (1 Gbit/s at 180 ms is 22.5 MB; with Linux's usual 4 MiB one connection carries ~250 Mbit/s
  # at 80 ms whatever the link), BBR, which cloudtrain's measurements ran with, and no slow
  # start after idle (the outer loop's connections idle H steps between syncs; it costs round
  # trips where BBR does not load and the host stays on CUBIC). The same
  # values as cloudtrain.tcp.WAN_TCP (tests/test_terraform.py compares them); the hosts set
  # them at boot (user_data), in a file named to sort after the image's own sysctl.d files.
  host_tcp = {
    "net.ipv4.tcp_rmem"                  = "4096 131072 67108864"
    "net.ipv4.tcp_wmem"                  = "4096 16384 67108864"
    "net.ipv4.tcp_congestion_control"    = "bbr"
    "net.ipv4.tcp_slow_start_after_idle" = "0"
  }
  user_data = join("\n", concat(
    ["#!/bin/sh", "cat > /etc/sysctl.d/99-cloudtrain-tcp.conf <<'EOF'"],
    [for key, value in local.host_tcp : "${key} = ${value}"],
    ["EOF", "sysctl --system", ""],
  ))
}

################################################################################
# AMI and zone
################################################################################

data "aws_ssm_parameter" "ami" {
  region = var.region
  name   = var.ami_ssm_parameter
}

data "aws_ami" "this" {
  region      = var.region
  owners      = var.ami_owners
  most_recent = true

  filter {
    name   = "image-id"
    values = [data.aws_ssm_parameter.ami.insecure_value]
  }
}

data "aws_ec2_instance_type_offerings" "this" {
  region        = var.region
  location_type = "availability-zone"

  filter {
    name   = "instance-type"
    values = [var.instance_type]
  }
}

################################################################################
# Network
################################################################################

resource "aws_vpc" "this" {
  #checkov:skip=CKV2_AWS_11:Flow logs would record every packet of the all-to-all gradient traffic of a short-lived cluster, billed per GB; the security group already admits only the cluster's CIDRs and the operators' SSH.
  region               = var.region
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = merge(local.tags, { Name = local.name })
}

# Strip the default security group of its rules so nothing can fall back on it.
resource "aws_default_security_group" "this" {
  region = var.region
  vpc_id = aws_vpc.this.id

  tags = merge(local.tags, { Name = "${local.name}-default-unused" })
}

resource "aws_internet_gateway" "this" {
  region = var.region
  vpc_id = aws_vpc.this.id

  tags = merge(local.tags, { Name = local.name })
}

resource "aws_subnet" "hosts" {
  region            = var.region
  vpc_id            = aws_vpc.this.id
  cidr_block        = var.subnet_cidr
  availability_zone = local.availability_zone
  # Public addresses, where wanted, come from the launch template (assign_public_ip).
  map_public_ip_on_launch = false

  tags = merge(local.tags, { Name = "${local.name}-hosts" })

  lifecycle {
    precondition {
      condition     = local.availability_zone != "none"
      error_message = "No availability zone of ${var.region} offers ${var.instance_type}. Pick another instance_type or region."
    }
  }
}

resource "aws_route_table" "this" {
  region = var.region
  vpc_id = aws_vpc.this.id

  tags = merge(local.tags, { Name = local.name })
}

resource "aws_route" "internet" {
  region                 = var.region
  route_table_id         = aws_route_table.this.id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this.id
}

resource "aws_route_table_association" "hosts" {
  region         = var.region
  subnet_id      = aws_subnet.hosts.id
  route_table_id = aws_route_table.this.id
}

# Checkpoint traffic to S3 stays on AWS's network (and works without public addresses).
resource "aws_vpc_endpoint" "s3" {
  region            = var.region
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${var.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.this.id]

  tags = merge(local.tags, { Name = "${local.name}-s3" })
}

################################################################################
# Security group
################################################################################

resource "aws_security_group" "hosts" {
  region      = var.region
  name_prefix = "${local.name}-hosts-"
  # EC2 allows no apostrophes in a group description.
  description = "cloudtrain ${var.cluster_name} hosts in ${var.region}: training ports from cluster VPCs, SSH from operators"
  vpc_id      = aws_vpc.this.id

  tags = merge(local.tags, { Name = "${local.name}-hosts" })

  lifecycle {
    create_before_destroy = true
  }
}

# Training and rendezvous ports: from the cluster's VPC CIDRs (this region's and its peers') only.
resource "aws_vpc_security_group_ingress_rule" "training" {
  for_each = local.training_rules

  region            = var.region
  security_group_id = aws_security_group.hosts.id
  description       = "cloudtrain ${each.value.port.name} from cluster VPC ${each.value.cidr}"
  cidr_ipv4         = each.value.cidr
  ip_protocol       = each.value.port.protocol
  from_port         = each.value.port.from_port
  to_port           = each.value.port.to_port

  tags = local.tags
}

# SSH from outside the cluster: from operator_cidrs only (validated: never 0.0.0.0/0).
resource "aws_vpc_security_group_ingress_rule" "operator_ssh" {
  for_each = toset(var.operator_cidrs)

  region            = var.region
  security_group_id = aws_security_group.hosts.id
  description       = "SSH from operator network ${each.value}"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = 22
  to_port           = 22

  tags = local.tags
}

resource "aws_vpc_security_group_egress_rule" "cluster" {
  for_each = toset(var.peer_cidrs)

  region            = var.region
  security_group_id = aws_security_group.hosts.id
  description       = "Everything to cluster VPC ${each.value}"
  cidr_ipv4         = each.value
  ip_protocol       = "-1"

  tags = local.tags
}

resource "aws_vpc_security_group_egress_rule" "web" {
  for_each = local.web_egress_ports

  region            = var.region
  security_group_id = aws_security_group.hosts.id
  description       = "${upper(each.key)} out, for packages and AWS APIs"
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "tcp"
  from_port         = each.value
  to_port           = each.value

  tags = local.tags
}

################################################################################
# Checkpoint bucket
################################################################################

resource "aws_s3_bucket" "checkpoints" {
  #checkov:skip=CKV_AWS_144:One bucket per region by design: hosts checkpoint where they run, and replicating would add the inter-region transfer this project exists to avoid.
  #checkov:skip=CKV_AWS_18:Only this region's host role can reach the bucket (IAM policy, TLS-only bucket policy, public access blocked); access logs would need a second bucket per region that outlives the cluster.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: readers find a complete checkpoint by its manifest, written last.
  region = var.region
  # The name modules/plan gives it, so that cloudtrain finds it from a {region} template.
  bucket        = var.checkpoint_bucket
  force_destroy = var.force_destroy_bucket

  tags = merge(local.tags, { Name = "${local.name}-checkpoints" })
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  region                  = var.region
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  region = var.region
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  region = var.region
  bucket = aws_s3_bucket.checkpoints.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  region = var.region
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    # SSE-KMS with the AWS managed aws/s3 key; the bucket key keeps KMS requests (and their cost)
    # down for the many parts of a multipart checkpoint upload.
    apply_server_side_encryption_by_default {
      sse_algorithm = "aws:kms"
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  region = var.region
  bucket = aws_s3_bucket.checkpoints.id

  rule {
    id     = "checkpoint-hygiene"
    status = "Enabled"

    filter {}

    # A host killed mid-upload (spot) leaves parts behind that are billed until aborted.
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }
  }

  depends_on = [aws_s3_bucket_versioning.checkpoints]
}

data "aws_iam_policy_document" "checkpoints_bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.checkpoints.arn,
      "${aws_s3_bucket.checkpoints.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  region = var.region
  bucket = aws_s3_bucket.checkpoints.id
  policy = data.aws_iam_policy_document.checkpoints_bucket.json

  depends_on = [aws_s3_bucket_public_access_block.checkpoints]
}

################################################################################
# Host role: its own checkpoint bucket and nothing else
################################################################################

data "aws_iam_policy_document" "assume_ec2" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# IAM is global: the role name carries the region.
resource "aws_iam_role" "host" {
  name               = "${local.name}-host"
  description        = "cloudtrain ${var.cluster_name} hosts in ${var.region}: read and write their checkpoint bucket"
  assume_role_policy = data.aws_iam_policy_document.assume_ec2.json

  tags = local.tags
}

data "aws_iam_policy_document" "checkpoints_access" {
  statement {
    sid       = "ListCheckpointBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.checkpoints.arn]
  }

  statement {
    sid = "ReadWriteCheckpoints"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${aws_s3_bucket.checkpoints.arn}/*"]
  }
}

resource "aws_iam_role_policy" "checkpoints" {
  name   = "checkpoints"
  role   = aws_iam_role.host.id
  policy = data.aws_iam_policy_document.checkpoints_access.json
}

resource "aws_iam_instance_profile" "host" {
  name = "${local.name}-host"
  role = aws_iam_role.host.name

  tags = local.tags
}

################################################################################
# Hosts
################################################################################

resource "aws_key_pair" "operator" {
  count = var.ssh_public_key == null ? 0 : 1

  region          = var.region
  key_name_prefix = "${local.name}-"
  public_key      = var.ssh_public_key

  tags = local.tags
}

resource "aws_placement_group" "this" {
  region   = var.region
  name     = local.name
  strategy = var.placement_strategy

  tags = local.tags
}

resource "aws_launch_template" "host" {
  #checkov:skip=CKV_AWS_88:Public addresses are how operators reach the hosts (assign_public_ip, default true; false turns them off); ingress is still only SSH from operator_cidrs and training ports from the cluster's VPCs.
  region                 = var.region
  name_prefix            = "${local.name}-"
  description            = "cloudtrain ${var.cluster_name} GPU host in ${var.region}"
  image_id               = data.aws_ami.this.id
  instance_type          = var.instance_type
  key_name               = one(aws_key_pair.operator[*].key_name)
  ebs_optimized          = "true"
  update_default_version = true
  user_data              = base64encode(local.user_data)

  iam_instance_profile {
    arn = aws_iam_instance_profile.host.arn
  }

  network_interfaces {
    device_index                = 0
    subnet_id                   = aws_subnet.hosts.id
    security_groups             = [aws_security_group.hosts.id]
    associate_public_ip_address = tostring(var.assign_public_ip)
    delete_on_termination       = "true"
  }

  placement {
    group_name = aws_placement_group.this.name
  }

  # IMDSv2 only: the spot watcher reads spot/instance-action with a session token. One hop:
  # processes on the host may ask, containers behind a bridge may not.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  dynamic "instance_market_options" {
    for_each = var.spot ? [1] : []

    content {
      market_type = "spot"

      spot_options {
        # One-time requests: an interrupted host is terminated, and `terraform apply` replaces it.
        spot_instance_type             = "one-time"
        instance_interruption_behavior = "terminate"
      }
    }
  }

  block_device_mappings {
    device_name = data.aws_ami.this.root_device_name

    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = "true"
      delete_on_termination = "true"
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }

  tag_specifications {
    resource_type = "network-interface"
    tags          = local.tags
  }

  tags = local.tags
}

resource "aws_instance" "host" {
  # These five are set once, in aws_launch_template.host, which checkov does not follow from an
  # instance (tests/test_terraform.py asserts them on the template):
  #checkov:skip=CKV_AWS_79:IMDSv2 is required by the launch template (metadata_options http_tokens = "required").
  #checkov:skip=CKV_AWS_8:The root volume is encrypted by the launch template (block_device_mappings ebs encrypted).
  #checkov:skip=CKV_AWS_126:Detailed monitoring is enabled by the launch template (monitoring enabled = true).
  #checkov:skip=CKV_AWS_135:EBS optimization is set by the launch template (ebs_optimized = true).
  #checkov:skip=CKV2_AWS_41:The IAM instance profile is attached by the launch template (iam_instance_profile).
  for_each = toset(var.host_names)

  region = var.region

  launch_template {
    id      = aws_launch_template.host.id
    version = aws_launch_template.host.latest_version
  }

  # Each host reads these from instance metadata (instance_metadata_tags): its own region and
  # bucket, not the launcher's, which horovodrun would hand every rank through the environment.
  # `cloudtrain hosts --ec2` finds the hosts by these tags.
  tags = merge(local.tags, {
    Name                           = each.key
    "cloudtrain:slots"             = tostring(var.slots)
    "cloudtrain:checkpoint-bucket" = aws_s3_bucket.checkpoints.bucket
  })

  lifecycle {
    # A new AMI release makes a new template version; a running cluster keeps its hosts until
    # you replace them (terraform apply -replace=...).
    ignore_changes = [launch_template]
  }
}
