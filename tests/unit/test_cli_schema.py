"""`kvpush schema`: a JSON Schema that accepts what kvpush accepts and refuses a misspelt field, a
description for every field, and docs/topology.md as `kvpush schema --markdown` makes it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvpush.cli.main import app
from kvpush.cli.topology_reference import DOC_PATH, topology_json_schema, topology_markdown
from kvpush.deploy.topology.topology import TopologyError, parse_topology
from kvpush.templates import template_names, template_text

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).parents[2]
SCHEMA = topology_json_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def schema_errors(text: str) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(yaml.safe_load(text))]


def test_the_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _properties(schema: dict):
    for where, node in [("(top level)", schema), *schema["$defs"].items()]:
        for name, prop in node.get("properties", {}).items():
            yield f"{where}.{name}", prop


def test_every_field_has_a_description():
    missing = [name for name, prop in _properties(SCHEMA) if not prop.get("description", "").strip()]
    assert missing == []


@pytest.mark.parametrize("name", template_names())
def test_every_template_is_valid_for_the_schema_as_for_kvpush(name):
    parse_topology(template_text(name), name)
    assert schema_errors(template_text(name)) == []


def _readme_topologies() -> list[str]:
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b for b in blocks if re.search(r"^model:", b, re.M)]


def test_the_readme_s_topology_is_valid_for_the_schema():
    (topology,) = _readme_topologies()
    parse_topology(topology, "README.md")
    assert schema_errors(topology) == []


BASE = "model: {path: /m}\nprefill: [{cpu_cores: '0'}]\ndecode: [{cpu_cores: '1'}]\n"


@pytest.mark.parametrize("text", [
    "model: {path: /m}\nprefill: [{cpu_cores: 0}]\ndecode: [{cpu_cores: 1, restart: on-failure}]\nrouter: {cpu_cores: 1}\n",
    BASE + "router: {restart: no}\n",
    BASE + "env: {OMP_NUM_THREADS: 2, DEBUG: true, EMPTY: null}\n",
    "launcher: slurm\nmodel: {path: /m}\nhosts: {n1: {node: n1}}\nprefill: [{}]\ndecode: [{}]\n",
], ids=["unquoted core numbers, restart policy", "restart: no", "env scalars", "slurm host without address"])
def test_shorthands_kvpush_accepts_are_valid_for_the_schema_too(text):
    parse_topology(text, "t.yaml")
    assert schema_errors(text) == []


@pytest.mark.parametrize("text, error", [
    (BASE.replace("prefill:", "prefil:"), "Additional properties are not allowed ('prefil' was unexpected)"),
    (BASE + "router: {port: 70000}\n", "router.port: 70000 is greater than the maximum of 65535"),
    (BASE + "hosts: {a: {user: ops}}\n", "hosts.a: 'address' is a required property"),
    (BASE + "connector: {type: push}\n", "connector.type: 'push' is not one of"),
], ids=["misspelt field", "port", "address without slurm", "connector type"])
def test_the_schema_refuses_what_kvpush_refuses(text, error):
    with pytest.raises(TopologyError):
        parse_topology(text, "t.yaml")
    assert any(error in e for e in schema_errors(text)), schema_errors(text)


def test_kvpush_schema_prints_the_json_schema():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0 and json.loads(result.stdout) == SCHEMA


def test_the_checked_in_reference_page_is_up_to_date():
    assert (ROOT / DOC_PATH).read_text() == topology_markdown(), \
        f"{DOC_PATH} is out of date with the topology's schema; regenerate it: kvpush schema --markdown > {DOC_PATH}"
    assert CliRunner().invoke(app, ["schema", "--markdown"]).stdout == topology_markdown()


def test_the_reference_page_lists_every_field_with_its_description():
    page = topology_markdown()
    for name, prop in _properties(SCHEMA):
        field = name.rsplit(".", 1)[1]
        row = f"| `{field}` |"
        assert row in page, name
        assert prop["description"].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;") in page, name
    for section in ("## `router`", "## `prefill[]`, `decode[]`", "## `prefill[].restart`, `decode[].restart`, `router.restart`"):
        assert section in page
