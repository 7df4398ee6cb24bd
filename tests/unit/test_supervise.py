"""The supervisor's pure parts: how a command is wrapped, its status document, exit descriptions."""
from __future__ import annotations

import os
import signal

from kvpush.deploy.lifecycle.supervise import SupervisorStatus, describe_exit, supervisor_argv


def test_a_command_is_wrapped_after_a_double_dash_with_its_policy():
    assert supervisor_argv("/py", "prefill-0", "/w/run/prefill-0.json") == [
        "/py", "-m", "kvpush.deploy.lifecycle.supervise", "--name", "prefill-0", "--status-file", "/w/run/prefill-0.json", "--"]
    assert supervisor_argv("/py", "d", "/s", "on-failure", 5, 30.0)[-7:] == [
        "--restart", "on-failure", "--max-restarts", "5", "--window-s", "30", "--"]


def test_status_round_trips_and_foreign_text_is_no_status():
    status = SupervisorStatus("decode-0", 10, "restarting", "on-failure", child_pid=11, restarts=2, last_exit="exit code 1",
                              cleaned_up=["pid 12 (VLLM::EngineCor)"])
    assert SupervisorStatus.from_json(status.to_json()) == status
    assert SupervisorStatus.from_json(status.to_json()[:-1] + ', "added_later": 1}') == status  # newer writers add fields
    for text in ("", "not json", "[1, 2]", '{"name": "x"}'):
        assert SupervisorStatus.from_json(text) is None


def test_exits_are_described_as_users_read_them():
    assert describe_exit(signal.SIGKILL) == "killed by SIGKILL"  # a wait status: terminated by signal 9
    assert describe_exit(3 << 8) == "exit code 3"
    assert os.waitstatus_to_exitcode(0) == 0 and describe_exit(0) == "exit code 0"
