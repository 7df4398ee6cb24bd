"""Load YAML while remembering where every value came from (line and column).

Validation errors must point at file:line:col of the offending field, so the loader keeps a
map from each value's path (tuple of keys / list indexes) to its 1-based position.

The text may be hostile: its size, its nesting and the values its aliases expand to are capped,
so a bomb or a recursive alias is refused in one line instead of hanging or exhausting memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple  # a value's path inside the document: ("prefill", 0, "http_port")

# A topology of a hundred hosts and instances is ~50 KB; these caps sit far above any real one.
MAX_YAML_BYTES = 1 << 20
MAX_DEPTH = 32  # mappings and lists inside each other
MAX_VALUES = 50_000  # values in the document once every alias is expanded


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


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML composes nested collections recursively: refuse the text past MAX_DEPTH levels,
    long before Python's recursion limit. `values` counts what _build made, aliases expanded."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0
        self.values = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


# Mappings and lists are built here, not by PyYAML: a tag asking for another type (a set, a Python
# object) must be refused, not silently read as a plain collection.
_PLAIN_COLLECTION_TAGS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark):
        self.mark = mark


def _too_deep(source: str, mark: yaml.Mark) -> YamlSyntaxError:
    return YamlSyntaxError(f"{source}:{mark.line + 1}:{mark.column + 1}: nested more than {MAX_DEPTH} levels deep "
                           "(or an alias that contains itself); a topology needs a few levels, flatten it")


def _scalar(node: yaml.Node, doc: SourceDocument, loader: _LimitedLoader) -> Any:
    try:
        value = loader.construct_object(node, deep=True)
    except (ValueError, OverflowError) as exc:  # e.g. an integer of 5,000 digits, a 13th month
        pos = _mark(node)
        why = str(exc).split(":")[0]
        raise YamlSyntaxError(
            f"{doc.source}:{pos.line}:{pos.column}: value {node.value[:40]!r} cannot be read ({why}); "
            "give a plain number or quote it as text"
        ) from None
    if isinstance(value, str) and "\0" in value:
        pos = _mark(node)
        raise YamlSyntaxError(f"{doc.source}:{pos.line}:{pos.column}: a NUL character (\\0) in a value; "
                              "no path, argument or name can hold one, remove it")
    return value


def _build(node: yaml.Node, path: Path_, doc: SourceDocument, loader: _LimitedLoader) -> Any:
    loader.values += 1
    if loader.values > MAX_VALUES:
        pos = _mark(node)
        raise YamlSyntaxError(f"{doc.source}:{pos.line}:{pos.column}: more than {MAX_VALUES} values once aliases are "
                              "expanded (an alias bomb?); write the topology without nested aliases")
    if len(path) > MAX_DEPTH:  # only aliases get here: the composer refused deeper text
        raise _too_deep(doc.source, node.start_mark)
    doc.value_positions[path] = _mark(node)
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _PLAIN_COLLECTION_TAGS:
        pos = _mark(node)
        raise YamlSyntaxError(f"{doc.source}:{pos.line}:{pos.column}: the tag {node.tag!r} is not allowed here; "
                              "write a plain mapping or list")
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                pos = _mark(key_node)
                raise YamlSyntaxError(
                    f"{doc.source}:{pos.line}:{pos.column}: a list or mapping used as a key; keys must be plain names"
                )
            key = _scalar(key_node, doc, loader)
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
    return _scalar(node, doc, loader)


def parse_yaml(text: str, source: str = "<string>") -> SourceDocument:
    if len(text) > MAX_YAML_BYTES:
        raise _too_big(source)
    doc = SourceDocument(source=source, data=None)
    loader = _LimitedLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None:
            doc.data = _build(root, (), doc, loader)
    except _TooDeep as exc:
        raise _too_deep(source, exc.mark) from None
    except RecursionError:  # merge keys (<<) that merge themselves
        raise YamlSyntaxError(f"{source}: a merge key (<<) or alias refers to itself; remove the cycle") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise YamlSyntaxError(f"{where}: invalid YAML: {exc.problem or exc.context}; fix the syntax") from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{source}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    return doc


def _too_big(source: str) -> YamlSyntaxError:
    return YamlSyntaxError(f"{source}: larger than {MAX_YAML_BYTES // 1024} KiB; a topology is a few KiB, "
                           "give the topology file itself")


def load_yaml_file(path: Path) -> SourceDocument:
    with open(path, "rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)  # never more: the file may be huge or still growing
    if len(data) > MAX_YAML_BYTES:
        raise _too_big(str(path))
    return parse_yaml(data.decode(), source=str(path))
