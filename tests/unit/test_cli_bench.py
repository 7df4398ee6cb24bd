"""`kvpush bench` as a user runs it: bad input is one line and exit 2, before anything starts;
tables render from a report."""
from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvpush.cli import bench_cmd
from kvpush.cli.bench_view import paired_lines, rate_table, spinning_lines
from kvpush.cli.main import app
from kvpush.bench.results import ModeRun
from kvpush.common.errors import KvpushError

from cli_in_process import run_cli as kvpush
from test_bench_results import recorded_point  # noqa: F401  (fixture from recorded output)




@pytest.mark.parametrize("args, message", [
    (["--modes", "push"], "--modes: unknown mode 'push'"),
    (["--rates", "0"], "--rates: 0 must be a positive"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--modes", "colocated"], "--baseline nixl-pull is not among --modes colocated"),
    (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be a positive number of milliseconds (got 0)"),
    (["--slo-tpot-ms", "-5"], "--slo-tpot-ms must be a positive number of milliseconds (got -5)"),
    (["--prefix-len", "-1"], "--prefix-len must be 0 or more (got -1)"),
    (["--input-len-spread", "1"], "--input-len-spread must be in [0, 1) (got 1)"),
    (["--rounds", "3"], "--rounds keeps every mode's deployment up at once, so each needs ports of its own: give --port-base"),
])
def test_bad_options_are_one_line_usage_errors(tmp_path, args, message):
    result = kvpush("bench", *args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2  # the topology note + the error
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_bench_takes_the_same_ssh_options_as_up(monkeypatch, tmp_path):
    seen = []

    def recording_bench(topo, options, events):
        seen.append(options.lifecycle.ssh)
        raise KvpushError("stop here")

    monkeypatch.setattr(bench_cmd, "run_bench", recording_bench)
    result = CliRunner().invoke(app, ["bench", "--known-hosts", "/tmp/kh", "--connect-timeout", "3", "--accept-new-host-keys",
                                      "--out", str(tmp_path / "out")])
    assert str(result.exception) == "stop here"
    (ssh,) = seen
    assert (ssh.known_hosts, ssh.connect_timeout_s, ssh.auth_timeout_s, ssh.accept_new_host_keys) == ("/tmp/kh", 3.0, 3.0, True)


def test_prompt_shape_options_reach_the_bench(monkeypatch, tmp_path):
    seen = []

    def recording_bench(topo, options, events):
        seen.append((options.input_len, options.prefix_len, options.input_len_spread))
        raise KvpushError("stop here")

    monkeypatch.setattr(bench_cmd, "run_bench", recording_bench)
    result = CliRunner().invoke(app, ["bench", "--input-len", "512", "--prefix-len", "2048", "--input-len-spread", "0.5",
                                      "--out", str(tmp_path / "out")])
    assert str(result.exception) == "stop here"
    assert seen == [(512, 2048, 0.5)]


def test_help_documents_the_command():
    result = kvpush("bench", "--help")
    assert result.returncode == 0
    for option in ("--modes", "--rates", "--input-len", "--output-len", "--num-prompts", "--out", "--kv-heavy", "--json",
                   "--prefix-len", "--input-len-spread"):
        assert option in result.stdout


def test_rate_table_shows_figures_and_ratios(recorded_point):  # noqa: F811
    import dataclasses

    faster = dataclasses.replace(recorded_point, mode="kvpush")
    runs = [ModeRun("nixl-pull", "a", [recorded_point]), ModeRun("kvpush", "b", [faster]), ModeRun("colocated", "c", [])]
    console = Console(record=True, width=250)
    console.print(rate_table(runs, 1.0, "nixl-pull"))
    text = console.export_text()
    assert "86159" in text  # TTFT p50 in ms
    assert "1.00x" in text
    colocated_row = next(line for line in text.splitlines() if "colocated" in line)
    assert colocated_row.count("-") >= 13  # no point at this rate: dashes, not zeros


def test_sigterm_becomes_an_interrupt_only_inside_the_bench():
    import os
    import signal
    import time

    from kvpush.cli.bench_cmd import interrupt_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with interrupt_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGTERM) == before


def test_phases_say_where_a_modes_time_went():
    from kvpush.cli.bench_view import phases_text

    text = phases_text({"up": 92.4, "prove": 1.23, "rate 0.5": 17.0, "down": 4.06})
    assert text == "up 92 s, prove 1.2 s, rate 0.5 17 s, down 4.1 s (115 s)"


def test_paired_lines_summarise_per_round_ratios(recorded_point):  # noqa: F811
    import dataclasses

    def at(mode, round_index, factor):
        latency = {m: dataclasses.replace(st, p50=st.p50 * factor, p90=st.p90 * factor)
                   for m, st in recorded_point.client.latency.items()}
        return dataclasses.replace(recorded_point, mode=mode, round=round_index,
                                   client=dataclasses.replace(recorded_point.client, latency=latency))

    runs = [ModeRun("kvpush", "a", round_points=[at("kvpush", 0, 0.9), at("kvpush", 1, 1.2), at("kvpush", 2, 0.8)]),
            ModeRun("nixl-pull", "b", round_points=[at("nixl-pull", k, 1.0) for k in range(3)])]
    [line] = paired_lines(runs, "nixl-pull")
    assert line.startswith("kvpush vs nixl-pull at 1 req/s, per round: TTFT p50 0.90x (0.80-1.20, lower in 2 of 3)")


def test_a_mode_spinning_while_idle_is_called_out_with_rounds():
    runs = [ModeRun("kvpush", "a", idle_cores={"prefill-0": 0.02, "decode-0": 0.03}),
            ModeRun("nixl-pull-stock", "b", idle_cores={"prefill-0": 0.81, "decode-0": 0.86})]
    [line] = spinning_lines(runs, rounds=4)
    assert line.startswith("nixl-pull-stock used CPU with no request in flight (prefill-0 0.81, decode-0 0.86 cores)")
    assert "stayed up while every other mode was measured" in line
    assert "stayed up" not in spinning_lines(runs, rounds=1)[0]
