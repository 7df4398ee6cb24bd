"""kvpush.bench.raw, .recompute, .tails_table and .handoff_table: a bench's raw per-request files are
kept (gzip when large) and `kvpush bench --recompute DIR` rebuilds the goodput and tail tables, and the engine
handoff from the kept spans, from them alone, also once they are packed into one raw.tar.xz."""
from __future__ import annotations

import gzip
import lzma
import json
import subprocess
import sys
import tarfile

import pytest

from kvpush.common.errors import UsageError
from kvpush.bench import raw
from kvpush.bench.handoff import spans_document
from kvpush.bench.handoff_table import markdown as handoff_markdown
from kvpush.bench.recompute import recompute
from kvpush.bench.results import parse_request_samples, pooled_samples
from kvpush.bench.tails import Slo
from kvpush.bench.tails_table import COLUMNS, markdown, rows


def _detailed(ttfts_s, output_len=4, tpot_s=0.01, duration=4.0) -> str:
    return json.dumps({"completed": len(ttfts_s), "duration": duration, "ttfts": ttfts_s,
                       "latencies": [t + tpot_s * (output_len - 1) for t in ttfts_s],
                       "output_lens": [output_len] * len(ttfts_s), "itls": [[tpot_s] * (output_len - 1)] * len(ttfts_s),
                       "errors": [""] * len(ttfts_s)})


def test_small_raw_files_stay_plain_and_large_ones_are_gzipped(tmp_path):
    small = tmp_path / "a.json"
    small.write_text("{}")
    assert raw.keep(small) == small and small.read_text() == "{}"
    large = tmp_path / "b.json"
    text = json.dumps({"x": "y" * (raw.GZIP_ABOVE_BYTES + 1)})
    large.write_text(text)
    kept = raw.keep(large)
    assert kept.name == "b.json.gz" and not large.exists()
    assert gzip.decompress(kept.read_bytes()).decode() == text and raw.read_text(kept) == text


@pytest.fixture
def bench_dir(tmp_path):
    """A finished two-round bench of two modes at one rate: bench.json naming its raw files, one gzipped."""
    (tmp_path / "raw").mkdir()
    ttfts = {("kvpush", 0): [0.1, 0.2, 0.3], ("kvpush", 1): [0.1, 0.9],
             ("nixl-pull", 0): [0.2, 0.4, 0.6], ("nixl-pull", 1): [0.2, 0.8]}
    runs = {}
    for (mode, k), values in ttfts.items():
        path = tmp_path / "raw" / f"{mode}-rate1-round{k + 1}.json"
        path.write_text(_detailed(values, duration=2.0))
        if (mode, k) == ("nixl-pull", 1):
            path = path.with_name(path.name + ".gz")
            path.write_bytes(gzip.compress(_detailed(values, duration=2.0).encode()))
        runs.setdefault(mode, []).append({"rate": 1.0, "round": k, "raw_file": f"raw/{path.name}"})
    doc = {"options": {"baseline": "nixl-pull", "slo": {"ttft_ms": 500.0, "tpot_ms": 100.0}},
           "configuration": {"topology": {"platform": "cpu"}},
           "runs": [{"mode": m, "round_points": points, "points": []} for m, points in runs.items()]}
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    return tmp_path


def test_recompute_pools_every_rounds_raw_requests_at_the_kept_slo(bench_dir):
    done = recompute(bench_dir)
    assert done.baseline == "nixl-pull" and done.slo == Slo(500.0, 100.0)
    kvpush = done.tails["kvpush"][1.0]
    assert (kvpush.sent, kvpush.good) == (5, 4)  # 900 ms misses the TTFT SLO
    assert kvpush.goodput.value == pytest.approx(1.0)  # 4 good in 2 + 2 s
    assert kvpush.latency["ttft"]["p50"].value == pytest.approx(200.0)
    pull = done.tails["nixl-pull"][1.0]
    assert pull.good == 3  # from the gzipped round too
    expected = pooled_samples([parse_request_samples(_detailed(v, duration=2.0)) for v in ([0.2, 0.4, 0.6], [0.2, 0.8])])
    assert pull == expected.tails(Slo(500.0, 100.0))  # the same code as the bench's own pooling


def test_recompute_at_other_slos_and_baseline(bench_dir):
    done = recompute(bench_dir, Slo(1000.0, 100.0), "kvpush")
    assert done.tails["kvpush"][1.0].good == 5 and done.baseline == "kvpush"
    [kv_row, pull_row] = rows(done.tails, 1.0, "kvpush")
    assert kv_row[0] == "kvpush" and pull_row[0] == "nixl-pull (kvpush-tuned)"
    assert kv_row[COLUMNS.index("goodput ratio")] == "1.00x"
    assert pull_row[COLUMNS.index("TTFT p50 ratio")] == "2.00x"  # 400 ms vs 200 ms
    assert pull_row[COLUMNS.index("TTFT p99 [CI]")] == "792 [600, ?]"  # 5 requests cannot bound p99 from above


def test_markdown_has_one_table_per_rate_naming_the_slo(bench_dir):
    text = markdown(recompute(bench_dir).tails, "nixl-pull")
    assert "**1 req/s: goodput at TTFT <= 500 ms and TPOT <= 100 ms; ratios vs nixl-pull" in text
    assert text.count("| kvpush |") == 1 and "| nixl-pull (kvpush-tuned) |" in text


def test_a_bench_without_raw_files_or_with_one_missing_is_a_one_line_error(bench_dir, tmp_path):
    doc = json.loads((bench_dir / "bench.json").read_text())
    (bench_dir / doc["runs"][0]["round_points"][0]["raw_file"]).unlink()
    with pytest.raises(UsageError, match=r"kvpush-rate1-round1.json: missing; bench.json names it for kvpush at 1 req/s"):
        recompute(bench_dir)
    del doc["runs"][0]["round_points"][0]["raw_file"]
    (bench_dir / "bench.json").write_text(json.dumps(doc))
    with pytest.raises(UsageError, match="mode kvpush names no raw files"):
        recompute(bench_dir)
    with pytest.raises(UsageError, match="bench.json: not found"):
        recompute(tmp_path / "nowhere")


def test_recompute_refuses_an_slo_that_is_not_positive(bench_dir):
    with pytest.raises(UsageError, match=r"--slo-tpot-ms must be a positive number of milliseconds \(got 0\)"):
        recompute(bench_dir, Slo(300.0, 0.0))


def test_the_cli_recomputes_without_a_topology_or_deployment(bench_dir):
    result = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "bench", "--recompute", str(bench_dir), "--markdown",
                             "--slo-ttft-ms", "250"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "goodput at TTFT <= 250 ms and TPOT <= 100 ms" in result.stdout
    missing = subprocess.run([sys.executable, "-m", "kvpush.cli.main", "bench", "--recompute", str(bench_dir / "x")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "bench.json: not found" in missing.stderr


def _keep_spans(bench_dir, name: str, decode_ttfts_s: list[float]) -> str:
    """A kept spans file: request i joined, its decode's first token decode_ttfts_s[i] after both legs arrived,
    prefill's 10 ms after (5 of them computing)."""
    records = []
    for i, decode_ttft in enumerate(decode_ttfts_s):
        vllm_id = f"cmpl-r-{i}-{'c' * 32}-0"
        for role, ttft, prefill in (("prefill", 0.010, 0.005), ("decode", decode_ttft, 0.0)):
            records.append({"deployment": "d", "instance": f"{role}-0", "role": role, "start_unix_nano": 10**18,
                            "attributes": {"gen_ai.request.id": vllm_id, "gen_ai.latency.time_to_first_token": ttft,
                                           "gen_ai.latency.time_in_queue": 0.0,
                                           "gen_ai.latency.time_in_model_prefill": prefill}})
    document = spans_document("r-", [f"r-{i}" for i in range(len(decode_ttfts_s) + 1)], records)  # one never joined
    (bench_dir / "raw" / name).write_bytes(gzip.compress(json.dumps(document).encode()))
    return f"raw/{name}"


def test_recompute_pools_the_engine_handoff_from_the_kept_spans(bench_dir):
    doc = json.loads((bench_dir / "bench.json").read_text())
    for k, point in enumerate(doc["runs"][0]["round_points"]):  # kvpush kept spans in both rounds
        point["spans_file"] = _keep_spans(bench_dir, f"kvpush-rate1-round{k + 1}-spans.json.gz", [0.02, 0.03][: k + 1])
    (bench_dir / "bench.json").write_text(json.dumps(doc))
    done = recompute(bench_dir)
    assert list(done.handoff) == ["kvpush"]  # nixl-pull's points name no spans
    pooled = done.handoff["kvpush"][1.0]
    assert (pooled.requests, pooled.joined) == (2 + 3, 3)
    assert pooled.answer_to_first["p50"] == pytest.approx(10.0, abs=1e-3)  # 10, 10 and 20 ms
    assert pooled.compute_to_first["p50"] == pytest.approx(15.0, abs=1e-3)
    text = handoff_markdown(done.handoff)
    assert "**1 req/s: engine handoff, ms**" in text and "| kvpush | 3/5 | 10.0 |" in text
    (bench_dir / doc["runs"][0]["round_points"][1]["spans_file"]).unlink()
    with pytest.raises(UsageError, match="kvpush-rate1-round2-spans.json.gz: missing"):
        recompute(bench_dir)


def test_raw_text_is_read_plain_gzipped_or_xz_compressed(tmp_path):
    for name, data in (("a.json", b"{}"), ("b.json.gz", gzip.compress(b"{}")), ("c.json.xz", lzma.compress(b"{}"))):
        (tmp_path / name).write_bytes(data)
        assert raw.read_text(tmp_path / name) == "{}"


def _with_spans(bench_dir):
    doc = json.loads((bench_dir / "bench.json").read_text())
    for k, point in enumerate(doc["runs"][0]["round_points"]):
        point["spans_file"] = _keep_spans(bench_dir, f"kvpush-rate1-round{k + 1}-spans.json.gz", [0.02, 0.03][: k + 1])
    (bench_dir / "bench.json").write_text(json.dumps(doc))
    (bench_dir / "logs").mkdir()
    (bench_dir / "logs" / "client.log").write_text("client said\n")
    (bench_dir / "README.md").write_text("# a run\n")
    (bench_dir / "goodput.png").write_bytes(b"\x89PNG")
    return doc


def test_a_packed_bench_recomputes_the_same_tables_from_its_archive_alone(bench_dir):
    doc = _with_spans(bench_dir)
    before = recompute(bench_dir)
    packed = raw.pack(bench_dir)
    assert {p.name for p in packed} >= {"bench.json", "client.log", "kvpush-rate1-round2-spans.json.gz",
                                         "nixl-pull-rate1-round2.json.gz"}
    assert sorted(p.name for p in bench_dir.iterdir()) == ["README.md", "goodput.png", raw.ARCHIVE]
    with tarfile.open(bench_dir / raw.ARCHIVE) as tar:
        names = tar.getnames()
    assert "raw/kvpush-rate1-round1-spans.json" in names and "raw/nixl-pull-rate1-round2.json" in names  # gzip undone
    assert "logs/client.log" in names and "bench.json" in names
    after = recompute(bench_dir)
    assert after == before and after.handoff is not None
    files = raw.KeptFiles(bench_dir)
    spans = doc["runs"][0]["round_points"][0]["spans_file"]
    assert files.where(spans) == f"{bench_dir / raw.ARCHIVE}:raw/kvpush-rate1-round1-spans.json"
    assert files.read_text("logs/client.log") == "client said\n"


def test_packing_again_keeps_the_archived_files_and_adds_new_ones(bench_dir):
    raw.pack(bench_dir)
    (bench_dir / "note.txt").write_text("later")
    assert [p.name for p in raw.pack(bench_dir)] == ["note.txt"]
    files = raw.KeptFiles(bench_dir)
    assert files.read_text("note.txt") == "later" and files.exists("raw/kvpush-rate1-round1.json")
    assert raw.pack(bench_dir) == []


def test_a_file_missing_from_the_archive_or_a_broken_archive_is_a_one_line_error(bench_dir):
    doc = json.loads((bench_dir / "bench.json").read_text())
    doc["runs"][1]["round_points"][0]["raw_file"] = "raw/gone.json"
    (bench_dir / "bench.json").write_text(json.dumps(doc))
    raw.pack(bench_dir)
    with pytest.raises(UsageError, match=r"raw/gone.json: missing; bench.json names it for nixl-pull at 1 req/s"):
        recompute(bench_dir)
    (bench_dir / raw.ARCHIVE).write_bytes(b"not xz")
    with pytest.raises(UsageError, match=r"raw.tar.xz: not a readable tar.xz .*pack_results.py"):
        recompute(bench_dir)
