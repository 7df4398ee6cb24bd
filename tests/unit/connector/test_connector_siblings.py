"""Finding the other rank processes of a vLLM instance in a /proc tree (a stand-in one here)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.connector.siblings import exit_handles, sibling_ranks, worker_title_prefix

pytestmark = pytest.mark.unit


def add_process(proc: Path, pid: int, parent: int, title: str, comm: str = "python3") -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1 4194560 0 0\n")
    (entry / "cmdline").write_bytes(title.encode() + b"\0" * 12)


def test_siblings_are_the_other_worker_titled_children_of_this_process_parent(tmp_path):
    add_process(tmp_path, 100, 1, "VLLM::EngineCore")
    add_process(tmp_path, 101, 100, "VLLM::Worker_TP0")  # this rank
    add_process(tmp_path, 102, 100, "VLLM::Worker_TP1", comm="VLLM::Worker) S 1")  # a comm that looks like fields
    add_process(tmp_path, 103, 100, "VLLM::Worker_TP2_PP1")
    add_process(tmp_path, 104, 100, "/usr/bin/python3 -c from multiprocessing.resource_tracker import main")
    add_process(tmp_path, 201, 200, "VLLM::Worker_TP1")  # another instance's rank
    (tmp_path / "self").mkdir()  # not a pid
    assert sibling_ranks(tmp_path, pid=101, parent=100, title_prefix="VLLM::Worker") == {
        102: "VLLM::Worker_TP1", 103: "VLLM::Worker_TP2_PP1"}


def test_a_process_that_ends_while_read_is_skipped(tmp_path):
    add_process(tmp_path, 102, 100, "VLLM::Worker_TP1")
    (tmp_path / "103").mkdir()  # its files are gone
    assert sibling_ranks(tmp_path, pid=101, parent=100, title_prefix="VLLM::Worker") == {102: "VLLM::Worker_TP1"}


def test_the_title_prefix_follows_vllms_setting(monkeypatch):
    monkeypatch.setenv("VLLM_PROCESS_NAME_PREFIX", "MINE")
    assert worker_title_prefix() == "MINE::Worker"
    monkeypatch.delenv("VLLM_PROCESS_NAME_PREFIX")
    assert worker_title_prefix() == "VLLM::Worker"


def test_a_kernel_without_pidfds_leaves_a_sibling_unwatched_and_one_already_gone_is_named(monkeypatch):
    def pidfd_open(pid):
        raise ProcessLookupError() if pid == 7 else OSError(38, "Function not implemented")

    monkeypatch.setattr("os.pidfd_open", pidfd_open)
    assert exit_handles({7: "VLLM::Worker_TP1", 8: "VLLM::Worker_TP2"}) == ({}, ["VLLM::Worker_TP1 (pid 7)"])
