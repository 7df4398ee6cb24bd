"""What `status` and `up` conclude from a host's process table and supervisor status files."""
from __future__ import annotations

from kvpush.deploy.lifecycle.process_view import ProcessView, view_processes
from kvpush.deploy.runners import CommandResult, ProcessInfo
from kvpush.deploy.runners.base import parse_listening_ports
from kvpush.deploy.lifecycle.state import ProcessRecord
from kvpush.deploy.lifecycle.supervise import SupervisorStatus

SUPERVISOR, SERVER, ENGINE, WATCHER = 100, 102, 103, 101


def _record(name="prefill-0", status_path="/w/run/prefill-0.json") -> ProcessRecord:
    return ProcessRecord(name, "prefill", "h", SUPERVISOR, SUPERVISOR, 1000.0, 8100, "http://h:8100/health", "/w/l.log", "d",
                         0.0, status_path=status_path)


def _status(state="running", **kw) -> SupervisorStatus:
    return SupervisorStatus("prefill-0", SUPERVISOR, state, child_pid=SERVER, watcher_pid=WATCHER, **kw)


class _Host:
    """A host's process table and files, as the runner interface reports them."""

    def __init__(self, alive: dict[int, str], stopped=(), status: SupervisorStatus | None = None, ports=None,
                 leader_start=1000.0):
        self.alive, self.stopped, self.status, self.ports = alive, set(stopped), status, ports or {}
        self.leader_start = leader_start

    def expand(self, path):
        return path

    def inspect(self, pids):
        return {p: ProcessInfo(p, "alive", self.leader_start, SUPERVISOR, p in self.stopped, self.alive[p]) if p in self.alive
                else ProcessInfo(p, "dead") for p in pids}

    def group_members(self, pgids):
        return {g: [ProcessInfo(p, "alive", None, g, p in self.stopped, c) for p, c in self.alive.items()] for g in pgids}

    def run(self, command, timeout=None, stdin=None):
        text = "@@ 0\n" + (self.status.to_json() if self.status else "") + "\n"
        return CommandResult("h", command, 0, text, "", 0.0)

    def listening_ports(self, pids):
        return {p: self.ports.get(p, []) for p in pids}


def _view(host: _Host, record=None) -> ProcessView:
    record = record or _record()
    return view_processes(host, [record])[record.name]


def test_a_supervised_server_that_runs_is_up_and_shows_its_own_pid():
    view = _view(_Host({SUPERVISOR: "python", WATCHER: "python", SERVER: "python", ENGINE: "VLLM::EngineCor"}, status=_status()))
    assert (view.state, view.up, view.main_pid, view.why(), view.leftovers) == ("running", True, SERVER, None, [])


def test_a_stopped_process_in_the_tree_makes_it_hung_but_still_up():
    view = _view(_Host({SUPERVISOR: "python", SERVER: "python"}, stopped=[SERVER], status=_status()))
    assert view.state == "hung" and view.up
    assert view.why().startswith(f"hung: pid {SERVER} (python) stopped") and f"kill -CONT {SERVER}" in view.why()


def test_a_dead_supervisor_with_its_server_still_alive_shows_leftovers_and_their_ports():
    host = _Host({SERVER: "python", ENGINE: "VLLM::EngineCor"}, status=_status(), ports={SERVER: [8100], ENGINE: [5600]})
    view = _view(host)
    assert view.state == "dead" and not view.up
    assert [(x.pid, x.ports) for x in view.leftovers] == [(SERVER, [8100]), (ENGINE, [5600])]
    assert "left behind: pid 102 (python) holding port 8100; pid 103 (VLLM::EngineCor) holding port 5600" in view.why()


def test_a_supervisor_cleaning_up_after_its_server_counts_as_dead_and_is_no_leftover_itself():
    status = _status("cleaning-up", last_exit="killed by SIGKILL", last_exit_at=0.0)
    view = _view(_Host({SUPERVISOR: "python", WATCHER: "python", ENGINE: "VLLM::EngineCor"}, status=status, ports={ENGINE: [5600]}))
    assert view.state == "dead" and not view.up
    assert [x.pid for x in view.leftovers] == [ENGINE]  # not the supervisor, not its watcher
    assert view.why().endswith("its supervisor is stopping what it left behind: pid 103 (VLLM::EngineCor) holding port 5600")


def test_a_server_that_died_cleanly_says_how_and_that_nothing_is_left():
    status = _status("exited", last_exit="killed by SIGKILL", last_exit_at=0.0, cleaned_up=["pid 103 (VLLM::EngineCor)"])
    view = _view(_Host({}, status=status))
    assert view.state == "dead" and view.main_pid == SERVER
    assert f"(pid {SERVER}: killed by SIGKILL)" in view.why()
    assert view.why().endswith("its supervisor stopped pid 103 (VLLM::EngineCor); nothing of it is left; `kvpush up` starts it again")


def test_restarting_counts_as_up_and_gave_up_as_dead():
    restarting = _view(_Host({SUPERVISOR: "python"}, status=_status("restarting", restarts=1, last_exit="exit code 1")))
    assert restarting.state == "restarting" and restarting.up and restarting.supervisor_restarts == 1
    gave_up = _view(_Host({}, status=_status("gave-up", restarts=3, last_exit="exit code 1")))
    assert gave_up.state == "dead" and "gave up after 3 restart(s)" in gave_up.why()


def test_a_status_file_of_an_earlier_start_is_ignored():
    earlier = SupervisorStatus("prefill-0", 55, "exited", child_pid=56, restarts=4)
    view = _view(_Host({SUPERVISOR: "python"}, status=earlier))
    assert view.supervisor is None and view.state == "running" and view.supervisor_restarts == 0


def test_a_reused_pid_is_dead_and_its_group_is_nobody_s_leftover():
    view = _view(_Host({SUPERVISOR: "bash", SERVER: "bash"}, leader_start=5000.0))
    assert view.state == "dead" and view.leftovers == [] and view.why() == f"died (pid {SUPERVISOR} is gone); nothing of it is left; `kvpush up` starts it again"


def test_listening_ports_come_from_socket_inodes_in_listen_state():
    text = ("7 111\n7 222\n8 333\n==\n"
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0\n"
            "   1: 0100007F:15E0 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0\n"
            "   0: 00000000000000000000000000000000:15E0 00000000000000000000000000000000:0000 0A 0 0 0 0 0 333 1 0\n")
    assert parse_listening_ports([7, 8, 9], text) == {7: [8080], 8: [5600], 9: []}  # 222 is a connection, not a listener
