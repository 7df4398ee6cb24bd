"""router/instances.py and the config's instances_file: the instance list file, its digest, and
what a router's /metrics says about taking a new list."""
from __future__ import annotations

import json

import pytest

from kvpush.common.errors import UsageError
from kvpush.router.config import RouterConfig, Upstream
from kvpush.router.instances import InstanceList, load_instance_list, reload_progress

pytestmark = pytest.mark.unit


def up(name: str, port: int) -> dict:
    return Upstream(name=name, url=f"http://127.0.0.1:{port}", engine_id=f"t.{name}", side_channel_host="127.0.0.1",
                    side_channel_port=port + 100).model_dump()


LISTED = {"prefill": [up("prefill-0", 8100)], "decode": [up("decode-0", 8200), up("decode-1", 8201)]}


def test_the_digest_is_of_the_list_not_of_how_the_file_is_written(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(LISTED))
    b.write_text(json.dumps(LISTED, indent=4, sort_keys=True))
    assert load_instance_list(a).digest() == load_instance_list(b).digest()
    fewer = {**LISTED, "decode": LISTED["decode"][:1]}
    assert InstanceList.model_validate(fewer).digest() != load_instance_list(a).digest()


@pytest.mark.parametrize("content, said", [
    (None, "No such file or directory; `kvpush up` writes it"),
    ("[1, 2", "(file): Invalid JSON"),
    (json.dumps({"decode": [{**up("d", 1), "url": "https://d:1"}]}), "decode.0.url: 'https://d:1' is not an instance base URL"),
    (json.dumps({**LISTED, "extra": 1}), "extra: Extra inputs are not permitted"),
    (json.dumps({"decode": [up("d", 1), up("d", 2)]}), "(file): decode: instance name 'd' is listed twice"),
])
def test_a_bad_list_is_one_line_naming_the_file_and_what_is_wrong(tmp_path, content, said):
    path = tmp_path / "instances.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError) as info:
        load_instance_list(path)
    assert str(info.value).startswith(f"router instances file {path}: ") and said in str(info.value)


def test_a_config_reads_its_instances_file_relative_to_itself_and_writes_itself_back_without_them(tmp_path):
    (tmp_path / "instances.json").write_text(json.dumps(LISTED))
    (tmp_path / "router.json").write_text(json.dumps({"protocol": "kvpush", "served_model_name": "tiny",
                                                      "instances_file": "instances.json"}))
    config = RouterConfig.from_file(tmp_path / "router.json")
    assert [u.name for u in config.decode] == ["decode-0", "decode-1"] and config.prefill[0].name == "prefill-0"
    assert config.instances_file == str(tmp_path / "instances.json")
    again = tmp_path / "copy" / "router.json"
    again.parent.mkdir()
    again.write_text(config.to_file_json())
    assert "decode-0" not in again.read_text() and RouterConfig.from_file(again) == config


def test_a_config_with_no_decode_instances_or_with_both_sources_is_refused(tmp_path):
    with pytest.raises(ValueError, match="give the decode instances"):
        RouterConfig(protocol="kvpush", served_model_name="tiny")
    (tmp_path / "instances.json").write_text(json.dumps(LISTED))
    (tmp_path / "router.json").write_text(json.dumps({"protocol": "kvpush", "served_model_name": "tiny",
                                                      "instances_file": "instances.json", "decode": [up("d", 1)]}))
    with pytest.raises(UsageError, match="instances_file and inline prefill/decode lists are both given"):
        RouterConfig.from_file(tmp_path / "router.json")


def test_reload_progress_reads_every_workers_list_and_sums_what_removed_instances_carry():
    page = "\n".join([
        "# HELP kvpush_router_instance_list 1 for the instance list",
        'kvpush_router_instance_list{digest="old",pid="11"} 0.0',
        'kvpush_router_instance_list{digest="new",pid="11"} 1.0',
        'kvpush_router_instance_list{digest="old",pid="12"} 1.0',
        'kvpush_router_draining{instance="decode-1",role="decode"} 2.0',
        'kvpush_router_draining{instance="decode-1",role="decode"} 1.0',
        'kvpush_router_draining{instance="decode-2",role="decode"} 0.0',
    ])
    progress = reload_progress(page)
    assert not progress.took("new")  # worker 12 still serves the old list
    assert progress.left_on(["decode-1", "decode-2", "decode-3"]) == {"decode-1": 3.0}
    assert reload_progress(page.replace('digest="old",pid="12"} 1.0', 'digest="new",pid="12"} 1.0')).took("new")
    assert not reload_progress("").took("new")


def test_a_name_listed_twice_is_found_in_one_pass_over_a_long_list():
    many = [{**up(f"decode-{i}", 8000), "name": f"decode-{i}"} for i in range(20_000)]
    assert len(InstanceList.model_validate({"decode": many}).decode) == 20_000
    with pytest.raises(ValueError, match="'decode-3' is listed twice"):
        InstanceList.model_validate({"decode": [*many, many[7], many[3]]})  # the first of them by name is said


@pytest.mark.parametrize("kind, said", [("fifo", "is a FIFO"), ("dir", "is a directory"), ("dev", "is a character device")])
def test_only_a_regular_file_is_read_and_a_fifo_does_not_wait_for_a_writer(tmp_path, kind, said):
    import os

    path = tmp_path / "instances.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path = "/dev/zero"
    with pytest.raises(UsageError) as info:
        load_instance_list(path)  # a FIFO opened to read would block here until a writer came
    assert str(info.value) == (f"router instances file {path}: {said}, not a regular file; point instances_file at "
                               "the file `kvpush up` writes")


def test_a_list_over_the_size_bound_is_refused_without_parsing(tmp_path, monkeypatch):
    from kvpush.router import instances

    monkeypatch.setattr(instances, "MAX_FILE_BYTES", 1000)
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"decode": [up(f"d{i}", 8000 + i) for i in range(10)]}))
    with pytest.raises(UsageError, match="over 0 MiB"):
        load_instance_list(path)
