"""The YAML loader's caps: size, nesting, alias expansion, tags, unreadable scalars, NUL."""
from __future__ import annotations

import pytest

from kvpush.deploy.topology.yaml_source import MAX_DEPTH, MAX_VALUES, MAX_YAML_BYTES, YamlSyntaxError, load_yaml_file, parse_yaml


def test_positions_still_point_at_each_value():
    doc = parse_yaml("a:\n  b: [1, 2]\n", "f.yaml")
    assert doc.data == {"a": {"b": [1, 2]}} and doc.where(("a", "b", 1)) == "f.yaml:2:10"


def test_nesting_up_to_the_cap_loads_and_one_more_level_is_refused():
    assert parse_yaml("a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)).data is not None
    with pytest.raises(YamlSyntaxError, match=f"f.yaml:1:{MAX_DEPTH + 3}: nested more than {MAX_DEPTH} levels"):
        parse_yaml("a: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "f.yaml")


@pytest.mark.parametrize("text", ["a: &x [*x]", "a: &x {b: *x}", "a: &x [[[*x]]]"])
def test_an_alias_inside_itself_is_refused(text):
    with pytest.raises(YamlSyntaxError, match="alias that contains itself"):
        parse_yaml(text)


def test_an_alias_bomb_is_refused_by_the_expanded_size():
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    with pytest.raises(YamlSyntaxError, match=f"more than {MAX_VALUES} values once aliases are expanded"):
        parse_yaml("\n".join(lines))


def test_a_few_aliases_still_work():
    assert parse_yaml("base: &b {x: 1}\none: *b\ntwo: {<<: *b, y: 2}").data["two"] == {"x": 1, "y": 2}


def test_text_over_the_size_cap_is_refused_and_a_huge_file_is_not_read_whole(tmp_path):
    with pytest.raises(YamlSyntaxError, match="larger than 1024 KiB"):
        parse_yaml("#" * (MAX_YAML_BYTES + 1), "f.yaml")
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: reading it whole would never end
    with pytest.raises(YamlSyntaxError, match="big.yaml: larger than"):
        load_yaml_file(path)


@pytest.mark.parametrize("text", ["a: !!set {x, y}", "a: !!python/object/apply:os.system [true]", "a: !!omap [{x: 1}]"])
def test_collections_with_other_tags_are_refused(text):
    with pytest.raises(YamlSyntaxError, match="is not allowed here"):
        parse_yaml(text)


@pytest.mark.parametrize("text,what", [("a: " + "9" * 5000, "4300 digits"), ("a: 2001-13-45", "month")])
def test_scalars_that_cannot_be_built_are_one_line(text, what):
    with pytest.raises(YamlSyntaxError, match=f"f.yaml:1:4: value .* cannot be read .*{what}"):
        parse_yaml(text, "f.yaml")


@pytest.mark.parametrize("text", ['a: "x\\0y"', '"k\\0": 1'])
def test_nul_in_a_value_or_key_is_refused(text):
    with pytest.raises(YamlSyntaxError, match="NUL character"):
        parse_yaml(text)
