"""benchmarks/gpu_transfer.py on CPU memory: two real processes, real NIXL (UCX on DRAM), the
connector's push services (Producer/Consumer over the side channel, WRITE made ahead or at prefill
end), its NixlEngine per-block and coalesced WRITEs and a raw NIXL WRITE, every byte checked; with
--verify-kv, verify_kv's digest timed on both sides and found equal after every size and pattern."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import failure_excerpt, run_benchmark

MODES = ("producer", "producer-late", "per-block", "coalesced", "raw")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench") / "records.json"
    rc, stdout = run_benchmark("gpu_transfer", ["--device", "cpu", "--layouts", "nhd,blnhc", "--layers", "2", "--kv-heads", "2",
                                                "--tokens", "48,256", "--repeats", "1", "--json", str(out),
                                                "--verify-kv"], timeout_s=240)
    return rc, stdout, json.loads(out.read_text()) if out.exists() else []


def test_every_write_moved_the_right_bytes(bench_run):
    rc, stdout, records = bench_run
    assert rc == 0, failure_excerpt(stdout)
    assert "all bytes verified: True" in stdout
    assert "WRONG BYTES" not in stdout
    assert records and all(r["verified"] and r["verified_bytes"] > 0 for r in records)


def test_numbers_are_printed_for_every_layout_size_pattern_and_mode(bench_run):
    _, stdout, records = bench_run
    seen = {(r["layout"], r["tokens"], r["pattern"], r["mode"]) for r in records}
    assert seen == {(layout, tokens, pattern, mode) for layout in ("nhd", "blnhc") for tokens in (48, 256)
                    for pattern in ("contiguous", "fragmented") for mode in MODES}
    for r in records:
        assert r["total_ms"] > 0 and r["gbps"] > 0 and r["copy_gbps"] > 0 and r["setup_ms"] >= 0
    assert stdout.count("-- targets") == 2
    assert "fragmented descriptors" in stdout and "of device copy" in stdout


def test_coalescing_cuts_descriptors_to_runs_times_segments(bench_run):
    _, _, records = bench_run
    for r in records:
        if r["mode"] == "per-block":
            assert r["descriptors"] == r["descriptors_per_block"]
        else:
            assert r["descriptors"] == r["expected_descriptors"]
    contiguous = {r["layout"]: r for r in records
                  if r["mode"] == "coalesced" and r["pattern"] == "contiguous" and r["tokens"] == 256}
    assert contiguous["nhd"]["descriptors"] == 4  # K and V of 2 layers, one run each
    assert contiguous["blnhc"]["descriptors"] == 1  # block-major: every layer of the run in one range
    through_producer = {(r["layout"], r["tokens"], r["pattern"]): r["descriptors"] for r in records if r["mode"] == "producer"}
    through_engine = {(r["layout"], r["tokens"], r["pattern"]): r["descriptors"] for r in records if r["mode"] == "coalesced"}
    assert through_producer == through_engine  # the connector's push uses the coalesced WRITE


def test_verify_kv_digests_are_timed_on_both_sides_equal_and_set_against_the_write(bench_run):
    _, stdout, records = bench_run
    assert records and all(r["digest_equal"] and r["digest_ms"] > 0 and r["decode_digest_ms"] > 0 for r in records)
    assert all(r["digest_ratio"] > 0 for r in records)
    assert stdout.count("verify_kv: digest") == 2 * 2 * 2  # layouts x sizes x patterns
    assert "digests equal: True" in stdout and "digests equal: False" not in stdout
