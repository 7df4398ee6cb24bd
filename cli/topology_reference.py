"""The topology's JSON Schema for editors and its Markdown reference page (docs/topology.md), both
made from the typed schema in kvpush.deploy.topology.topology_schema, so neither can drift from what `plan`
and `up` accept."""
from __future__ import annotations

import json
from typing import Any

from kvpush.deploy.topology.topology import Topology

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
# pydantic writes a constraint it cannot place on a JSON type (an Optional custom int) under its own
# name; JSON Schema's validators ignore those, so they are renamed to the keywords they mean.
CONSTRAINT_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
DOC_PATH = "docs/topology.md"
MAX_DEPTH = 8


def _standard_keywords(node: Any) -> Any:
    if isinstance(node, dict):
        return {CONSTRAINT_KEYWORDS.get(k, k): _standard_keywords(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_standard_keywords(v) for v in node]
    return node


def _field_schema() -> dict:
    return _standard_keywords(Topology.model_json_schema(mode="validation"))


def topology_json_schema() -> dict:
    """The JSON Schema (draft 2020-12) a topology file's YAML is checked against in an editor.
    Rules between fields (port clashes, unknown hosts, ...) are `plan`'s; the schema has each field."""
    schema = _field_schema()
    host = schema["$defs"]["HostSpec"]
    # launcher slurm: a host's address may be left out (it is its Slurm node's), see topology.py
    host["required"] = [r for r in host.get("required", []) if r != "address"]
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "kvpush topology",
        "description": "One kvpush deployment: model, hosts, prefill and decode instances, router "
                       "(`kvpush schema --markdown` prints the reference page).",
        **{k: v for k, v in schema.items() if k not in ("title", "description")},
        "if": {"properties": {"launcher": {"const": "slurm"}}, "required": ["launcher"]},
        "else": {"properties": {"hosts": {"additionalProperties": {"required": ["address"]}}}},
    }


# -- the Markdown reference page -----------------------------------------------------------------

def _ref_name(node: dict) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def _referenced(node: dict) -> list[tuple[str, str]]:
    """(suffix, definition) for the definitions a property's value is or holds: '' for the value
    itself, '[]' for a list's items, '.<name>' for a mapping's values."""
    found = []
    for option in node.get("anyOf", [node]):
        items, values = option.get("items"), option.get("additionalProperties")
        if name := _ref_name(option):
            found.append(("", name))
        elif option.get("type") == "array" and isinstance(items, dict) and (name := _ref_name(items)):
            found.append(("[]", name))
        elif isinstance(values, dict) and (name := _ref_name(values)):
            found.append((".<name>", name))
    return found


def _sections(schema: dict) -> dict[str, list[str]]:
    """Each definition's paths in a file (`router.restart`, `prefill[].restart`, ...), from the top down."""
    paths: dict[str, list[str]] = {"": [""]}
    pending = [("", schema)]
    while pending:
        prefix, node = pending.pop(0)
        for name, prop in node.get("properties", {}).items():
            for suffix, definition in _referenced(prop):
                path = f"{prefix}{'.' if prefix else ''}{name}{suffix}"
                paths.setdefault(definition, []).append(path)
                if path.count(".") + path.count("[") < MAX_DEPTH:  # a schema nesting itself would never end
                    pending.append((path, schema["$defs"][definition]))
    return paths


def _anchor(path: str) -> str:
    return "".join(c for c in path.lower().replace(".", "").replace(" ", "-") if c.isalnum() or c in "-_")


def _limits(node: dict) -> str:
    parts = [f"{sign} {_number(node[key])}" for key, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"),
                                                         ("maximum", "≤"), ("exclusiveMaximum", "<")) if key in node]
    return f" ({', '.join(parts)})" if parts else ""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _type(node: dict, titles: dict[str, str]) -> str:
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        return " or ".join(dict.fromkeys(_type(o, titles) for o in options)) or "null"
    if name := _ref_name(node):
        title = titles[name]
        return f"[{title}](#{_anchor(title)})"
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type(node.get('items', {}), titles)}{_limits(node)}"
    if kind == "object":
        values = node.get("additionalProperties")
        return f"map of {_type(values, titles)}" if isinstance(values, dict) else "mapping"
    return f"{kind or 'any'}{_limits(node)}"


def _cell(text: str) -> str:
    """Text for a table cell: a `|` would end the cell, and `<name>` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _default(name: str, node: dict, required: set[str]) -> str:
    if name in required:
        return "required"
    if "default" not in node:
        return "see description" if node.get("description", "").count("default") else "-"
    return "-" if node["default"] is None else f"`{json.dumps(node['default'])}`"


def topology_markdown() -> str:
    """docs/topology.md: a table of fields per part of the file, every field with its description."""
    schema = _field_schema()  # with what each field requires: the editor's schema adds rules across them
    sections = _sections(schema)
    titles = {d: ("top level" if d == "" else ", ".join(f"`{p}`" for p in paths)) for d, paths in sections.items()}
    lines = [
        "# Topology reference",
        "",
        "<!-- Generated by `kvpush schema --markdown > docs/topology.md` from deploy/topology/topology_schema.py;",
        "     tests/unit/test_cli_schema.py fails when it is out of date. Edit the field descriptions there. -->",
        "",
        "A topology is one YAML file describing a whole deployment (`kvpush init FILE` writes one from a template).",
        "Each field is checked on its own as listed here; `kvpush plan FILE` also checks the rules between",
        "fields (port clashes on a host, unknown hosts, cores or GPUs given twice, TP sizes) and names the",
        "file, line and field of the first problem.",
        "",
        "For completion and checking in an editor, write the JSON Schema next to your topology and name it",
        "on the file's first line (the YAML language server, e.g. VS Code's YAML extension, reads it):",
        "",
        "```bash",
        "kvpush schema > kvpush.schema.json",
        "```",
        "",
        "```yaml",
        "# yaml-language-server: $schema=./kvpush.schema.json",
        "name: my-deployment",
        "```",
    ]
    for definition in sections:
        node = schema if definition == "" else schema["$defs"][definition]
        title = titles[definition]
        lines += ["", f"## {title}", ""]
        if definition and node.get("description"):
            lines += [_cell(node["description"]), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        required = set(node.get("required", []))
        for name, prop in node.get("properties", {}).items():
            lines.append(f"| `{name}` | {_type(prop, titles)} | {_default(name, prop, required)} | "
                         f"{_cell(prop.get('description', ''))} |")
    return "\n".join(lines) + "\n"
