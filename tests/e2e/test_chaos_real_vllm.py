"""The short chaos run (the long one is benchmarks/chaos.py): real vLLM on CPU through `kvpush up`,
two prefill instances (TP 1) and two decode instances, one TP 2 and one TP 1, so that the router's
pairs are of both the 1P1D and the P TP 1 -> D TP 2 shape, with a peer of each role.

CLIENTS clients send random-token prompts of 1 to 1,500 tokens (greedy, float32, streamed or not,
at random) through the router for CHAOS_S seconds, and on until the last fault is recovered from,
while processes of the instances (API servers, engine cores, TP workers) are SIGSTOPped for
0.2-3 s, one at a time, and the fourth fault is a SIGKILL whose instance `up` brings back. Every
answer is compared with the session's plain reference server's.

Asserted: no answer differs from the reference (nor what came of a cut stream); no request failed
while each role had an instance no fault touched, except a stream cut by the kill of the decode it
streamed from (no peer can take over a stream that has begun); none took over 30 s; the killed
instance was revived by `up` alone; after `down` nothing of the deployment is left. Prints the
tables of tests/chaos_report.py and the faults. Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import sys

import pytest

from chaos_deployment import OPTIONS, bring_up, make_deployment, take_down
from chaos_faults import ChaosSettings
from chaos_logs import evidence
from chaos_prompts import reference_prompt_set
from chaos_report import causes_table, cut_by_killed_decode, failure_causes, summarize, summary_table
from chaos_run import run_chaos

SHAPE = "mixed"
PORT_BASE = 18600  # ports 18600-18619: no other test uses them
CLIENTS = 8
PROMPTS = 32
CHAOS_S = 60.0  # three SIGSTOPs take ~25 s: the SIGKILL comes well within it
SETTINGS = ChaosSettings(gap_s=(1.0, 3.0), kill_every=4, max_kills=1)  # the fourth fault is a SIGKILL, the rest SIGSTOPs
SEED = 5


@pytest.mark.timeout(600)
def test_stopped_and_killed_processes_never_change_an_answer_nor_fail_a_request_with_a_healthy_peer(
        model_dir, reference_server, tmp_path, state_dir):
    reference_server.start()  # loads beside the deployment
    deployment = make_deployment(SHAPE, model_dir, tmp_path / "deployment", PORT_BASE)
    outcome = None
    try:
        bring_up(deployment)
        reference = reference_server.url_for(deployment.plan.process("decode-1"))
        prompts = reference_prompt_set(reference, PROMPTS, seed=SEED)
        outcome = run_chaos(SHAPE, deployment.topo, prompts, clients=CLIENTS, seed=SEED, settings=SETTINGS,
                            options=OPTIONS, enough=lambda done, seconds: seconds >= CHAOS_S,
                            log_dir=tmp_path / "kept-logs", log=lambda line: print(line, file=sys.stderr))
        logs = outcome.kept_logs + list(deployment.log_paths().values())
    finally:
        problems = take_down(deployment)
    requests, faults = outcome.request_rows(), outcome.fault_rows()
    causes = failure_causes(requests, faults)
    print("\n" + summary_table([summarize(SHAPE, requests, faults)]) + "\n\n" + causes_table(causes) + "\n\n"
          + "\n".join(json.dumps(f) for f in faults), file=sys.stderr)
    bad = {r["request_id"] for r in requests if not r["answered"] or r["matches_reference"] is False}
    said = json.dumps(evidence(bad, logs), indent=1)[:6000]

    assert outcome.error is None, outcome.error
    kills = [f for f in faults if f["kind"] == "kill"]
    assert len(kills) == 1 and kills[0]["up_revived"] == [kills[0]["instance"]], kills
    assert sum(f["kind"] == "stop" for f in faults) >= 3, faults
    assert all(f["end"] is not None for f in faults), [f for f in faults if f["end"] is None]
    answered = [r for r in requests if r["answered"]]
    assert {r["streamed"] for r in answered} == {True, False} and len(answered) >= 100, summarize(SHAPE, requests, faults)
    wrong = [r for r in requests if r["matches_reference"] is False]
    assert not wrong, (wrong[:3], said)
    by_id = {f["id"]: f for f in faults}
    failed_with_peer = [r for r in requests if not r["answered"] and r["healthy_peer"] and not cut_by_killed_decode(r, by_id)]
    assert not failed_with_peer, (causes, failed_with_peer[:3], said)
    slow = [r for r in requests if r["latency_s"] > 30]
    assert not slow, slow[:3]
    assert not problems, problems
