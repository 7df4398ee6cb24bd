"""`kvpush schema`: the topology's JSON Schema for editors, or its Markdown reference page."""
from __future__ import annotations

import sys

import typer

from .console import print_json
from .options import examples
from .topology_reference import DOC_PATH, topology_json_schema, topology_markdown


def register(app: typer.Typer) -> None:
    @app.command("schema", epilog=examples(
        ("kvpush schema > kvpush.schema.json", "for editors: see docs/topology.md"),
        ("kvpush schema --markdown", f"the reference page ({DOC_PATH})")))
    def schema_command(
        markdown: bool = typer.Option(
            False, "--markdown", help=f"Print the topology reference page ({DOC_PATH}) instead."
        ),
    ) -> None:
        """Print the topology file's JSON Schema, for editors: completion, checks and each field's description."""
        if markdown:
            sys.stdout.write(topology_markdown())
            sys.stdout.flush()
        else:
            print_json(topology_json_schema())
