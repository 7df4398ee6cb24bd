"""`kvpush doctor`'s command line: the same SSH options as up/down/status, and output printed as written."""
from __future__ import annotations

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
