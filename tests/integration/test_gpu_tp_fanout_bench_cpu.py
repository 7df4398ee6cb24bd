"""benchmarks/gpu_tp_fanout.py on CPU memory: a TP 2 prefill and a TP 2 decode instance, one real
process per rank, the connector's Producer/Consumer per rank over their side channels and real
NIXL (UCX on DRAM), pushing at once, rank 0 alone and TP 1 -> TP 1 with every head; every byte on
every decode rank is checked. The timings mean nothing here."""
from __future__ import annotations

import json
import sys

import pytest

from benchmark_scripts import BENCHMARKS, failure_excerpt, run_benchmark

ROUNDS = 2


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-fanout") / "results.json"
    rc, stdout = run_benchmark("gpu_tp_fanout", ["--device", "cpu", "--ranks", "2", "--kv-heads", "2", "--layers", "2",
                                                 "--head-dim", "16", "--tokens", "72", "--repeats", str(ROUNDS),
                                                 "--json", str(out)], timeout_s=300)
    return rc, stdout, json.loads(out.read_text()) if out.exists() else {}


def test_every_byte_on_every_decode_rank_is_verified(bench_run):
    rc, stdout, results = bench_run
    assert rc == 0, failure_excerpt(stdout)
    assert "all bytes verified: True" in stdout and "WRONG BYTES" not in stdout
    records = results["records"]
    assert records
    for r in records:
        assert r["verified"], r
        assert r["verified_bytes"] == r["bytes"] > 0
        for rank in r["per_rank"]:
            assert rank["ok"] and rank["wrong_elements"] == rank["stray_elements"] == 0
            assert rank["bytes"] == rank["expected_bytes"] == rank["verified_bytes"]
            assert rank["prepared_ahead"]  # the connector's GPU path: WRITE made before the barrier


def test_each_case_is_measured_every_round_with_the_right_ranks_and_bytes(bench_run):
    _, _, results = bench_run
    measured = [r for r in results["records"] if r["case"] != "warm-up"]
    seen = {(r["case"], r["round"]) for r in measured}
    assert seen == {(c, i) for c in ("fanout", "rank0-alone", "all-heads") for i in range(1, ROUNDS + 1)}
    by_case = {r["case"]: r for r in measured}
    fanout, alone, all_heads = by_case["fanout"], by_case["rank0-alone"], by_case["all-heads"]
    assert [p["rank"] for p in fanout["per_rank"]] == [0, 1]
    assert [p["rank"] for p in alone["per_rank"]] == [0]
    # 72 tokens = 5 blocks of 2 layers x K,V x 16 tokens x 1 head x 16 dims x 2 bytes, per rank
    assert alone["bytes"] == 5 * 2 * 2 * 16 * 16 * 2
    assert fanout["bytes"] == all_heads["bytes"] == results["total_bytes"] == 2 * alone["bytes"]
    assert all_heads["num_ranks"] == 1


def test_numbers_are_printed_with_same_run_ratios(bench_run):
    _, stdout, results = bench_run
    assert results["copy_gbps"] > 0
    for r in results["records"]:
        assert r["span_ms"] > 0 and r["gbps"] > 0 and r["gbps_at_decode"] > 0 and r["start_skew_ms"] >= 0
        assert len(r["rank_ms"]) == r["num_ranks"] and all(ms > 0 for ms in r["rank_ms"])
    rows = results["summary"]["blhnc"]
    assert set(rows) == {"fanout", "rank0-alone", "all-heads"}
    assert rows["fanout"]["fanout_x"] == 1.0 and rows["all-heads"]["fanout_x"] > 0 and rows["rank0-alone"]["pct_copy"] > 0
    assert "fanout/this" in stdout and "device copy" in stdout
    assert stdout.count("  fanout       round") == ROUNDS


def test_a_shard_on_the_wrong_rank_would_fail_the_check():
    """The fill is salted by the rank's first KV head: rank 1's bytes in rank 0's blocks don't verify."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_kv_layouts as kvl
    import torch

    cache = kvl.allocate("blhnc", kvl.Shape(2, 4, 16, 1, 16), "cpu")
    kvl.fill(cache, salt=1)
    blocks = torch.arange(4)
    assert kvl.verify(cache, blocks, blocks, salt=1).ok
    wrong = kvl.verify(cache, blocks, blocks, salt=0)
    assert wrong.wrong_elements == 2 * 4 * 16 * 2 * 16  # every element of every block of both layers
