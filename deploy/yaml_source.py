"""Load YAML while remembering where every value came from (line and column).

Validation errors must point at file:line:col of the offending field, so the loader keeps a
map from each value's path (tuple of keys / list indexes) to its 1-based position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple  # a value's path inside the document: ("prefill", 0, "http_port")


@dataclass(frozen=True)
class Position:
    line: int
    column: int


@dataclass
class SourceDocument:
    """A parsed YAML document plus the position of every value and key."""

    source: str  # file name shown in messages
    data: Any
    value_positions: dict[Path_, Position] = field(default_factory=dict)
    key_positions: dict[Path_, Position] = field(default_factory=dict)

    def position_of(self, path: Path_) -> Position | None:
        """Closest known position for a path: the value itself, its key, or its nearest parent."""
        path = tuple(path)
        while True:
            if path in self.value_positions:
                return self.value_positions[path]
            if path in self.key_positions:
                return self.key_positions[path]
            if not path:
                return None
            path = path[:-1]

    def where(self, path: Path_) -> str:
        pos = self.position_of(path)
        return f"{self.source}:{pos.line}:{pos.column}" if pos else self.source


class YamlSyntaxError(ValueError):
    """The text is not YAML; the message is one line with file:line:col."""


def _mark(node: yaml.Node) -> Position:
    return Position(node.start_mark.line + 1, node.start_mark.column + 1)


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _build(node: yaml.Node, path: Path_, doc: SourceDocument, loader: yaml.SafeLoader) -> Any:
    doc.value_positions[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                pos = _mark(key_node)
                raise YamlSyntaxError(
                    f"{doc.source}:{pos.line}:{pos.column}: a list or mapping used as a key; keys must be plain names"
                )
            key = loader.construct_object(key_node, deep=True)
            if key in out:
                pos = _mark(key_node)
                raise YamlSyntaxError(
                    f"{doc.source}:{pos.line}:{pos.column}: duplicate key '{key}'; "
                    "each key may appear once per mapping, remove one of them"
                )
            doc.key_positions[path + (key,)] = _mark(key_node)
            out[key] = _build(value_node, path + (key,), doc, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, path + (i,), doc, loader) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse_yaml(text: str, source: str = "<string>") -> SourceDocument:
    doc = SourceDocument(source=source, data=None)
    loader = _UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            doc.data = _build(root, (), doc, loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise YamlSyntaxError(f"{where}: invalid YAML: {exc.problem or exc.context}; fix the syntax") from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{source}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return doc


def load_yaml_file(path: Path) -> SourceDocument:
    return parse_yaml(path.read_text(), source=str(path))
