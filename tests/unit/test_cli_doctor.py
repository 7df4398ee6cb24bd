"""`kvpush doctor`'s command line: the same SSH options as up/down/status, and output printed as written."""
from __future__ import annotations

import json
import re
from contextlib import contextmanager

from typer.testing import CliRunner

from kvpush.cli import doctor_cmd
from kvpush.cli.main import app
from kvpush.deploy.doctor import DoctorReport, Status
from kvpush.deploy.doctor.result import CheckResult, Evidence

SSH_TOPOLOGY = "model: {path: /m}\nhosts: {gpu: {address: 10.0.0.9, user: ubuntu}}\nprefill: [{}]\ndecode: [{}]\n"


def _doctor_with_recorded_options(monkeypatch, tmp_path, *args: str, env: dict[str, str] | None = None):
    seen = []

    @contextmanager
    def connected(hosts, options):
        seen.append(options)
        yield {name: object() for name in hosts}, {}

    monkeypatch.setattr(doctor_cmd, "connected", connected)
    monkeypatch.setattr(doctor_cmd, "run_doctor", lambda topo, runners, options, unreachable: DoctorReport([], 0.0, list(runners)))
    (tmp_path / "t.yaml").write_text(SSH_TOPOLOGY)
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / "t.yaml"), *args], env=env)
    assert result.exit_code == 0, result.output
    return seen


def test_doctor_reads_known_hosts_from_the_environment_like_up(monkeypatch, tmp_path):
    (options,) = _doctor_with_recorded_options(monkeypatch, tmp_path, env={"KVPUSH_KNOWN_HOSTS": str(tmp_path / "kh")})
    assert options.known_hosts == str(tmp_path / "kh") and not options.accept_new_host_keys


def test_doctor_takes_known_hosts_and_connect_timeout_options(monkeypatch, tmp_path):
    (options,) = _doctor_with_recorded_options(monkeypatch, tmp_path, "--known-hosts", "/tmp/kh", "--connect-timeout", "3",
                                               "--accept-new-host-keys")
    assert (options.known_hosts, options.connect_timeout_s, options.accept_new_host_keys) == ("/tmp/kh", 3.0, True)


def test_report_prints_remote_text_as_written(capsys):
    failed = CheckResult("probe", "gpu", Status.FAIL, "host gpu (ops[/x]@10.0.0.9:22): connection refused",
                         evidence=(Evidence("cat [/etc]", ("[bold]line",), 1),), remedy="fix [red]SSH")
    doctor_cmd.render_report(DoctorReport([failed], 0.1, ["gpu"]))
    text = capsys.readouterr().out
    for written in ("(ops[/x]@10.0.0.9:22):", "$ cat [/etc]", "[bold]line", "fix [red]SSH"):
        assert written in text, text


def _unreachable_report() -> DoctorReport:
    cause = "host p5en-a (ubuntu@10.0.0.1:22): connection timed out after 10 s; check the address and that sshd listens"
    results = [CheckResult("probe", "p5en-a", Status.FAIL, cause, remedy="fix SSH access to this host"),
               *(CheckResult(check, "p5en-a", Status.SKIP, "no facts from this host (see the probe row)")
                 for check in ("python", "packages", "memlock")),
               CheckResult("python", "p5en-b", Status.OK, "3.11.7"),
               CheckResult("reachability", "p5en-a -> p5en-b", Status.SKIP, "no facts from p5en-a (see its probe row)"),
               CheckResult("clock-skew", "(topology)", Status.SKIP, "2 hosts, clocks read on p5en-b: nothing to compare",
                           scope="topology")]
    return DoctorReport(results, 6.5, ["p5en-a", "p5en-b"])


def test_report_is_grouped_per_host_with_the_cause_whole_on_one_line(capsys):
    doctor_cmd.render_report(_unreachable_report())
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "host p5en-a  fail",
        "  fail  probe  host p5en-a (ubuntu@10.0.0.1:22): connection timed out after 10 s; check the address and that sshd listens",
        "        fix: fix SSH access to this host",
        "  skip  python, packages, memlock: no facts from this host (see the probe row)",
        "  skip  reachability -> p5en-b: no facts from p5en-a (see its probe row)",
        "host p5en-b  ok",
        "  ok    python  3.11.7",
        "topology  skip",
        "  skip  clock-skew: 2 hosts, clocks read on p5en-b: nothing to compare",
        "doctor FAILED: 1 ok, 0 warn, 1 fail, 5 skip on 2 host(s) in 6.5 s",
    ]


def test_verbose_report_lists_every_skipped_check_on_its_own_line(capsys):
    doctor_cmd.render_report(_unreachable_report(), verbose=True)
    text = capsys.readouterr().out
    assert re.search(r"^  skip  memlock +no facts from this host \(see the probe row\)$", text, re.M), text
    assert "python, packages" not in text


def test_doctor_duration_counts_connecting_to_the_hosts(monkeypatch, tmp_path):
    """The hosts' connects happen before the checks start: the time printed covers them too."""
    _doctor_with_recorded_options(monkeypatch, tmp_path)
    clock = iter([100.0, 107.25])
    monkeypatch.setattr(doctor_cmd.time, "monotonic", lambda: next(clock, 107.25))
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / "t.yaml"), "--json"])
    assert json.loads(result.stdout)["seconds"] == 7.25
