"""Topology templates shipped with kvpush: `kvpush templates` lists them, `kvpush init` copies one."""
from __future__ import annotations

from importlib import resources

DEFAULT_TEMPLATE = "local-cpu"


def template_names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml"))


def template_text(name: str) -> str:
    path = resources.files(__name__) / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(name)
    return path.read_text()


def template_summary(name: str) -> str:
    """The first comment line of a template, shown by `kvpush templates`."""
    first = template_text(name).splitlines()[0]
    return first.lstrip("# ").strip()
