"""tests/chaos_faults.py: which faults each request met, and whether each role kept an untouched instance."""
from __future__ import annotations

import pytest

from chaos_faults import Fault, attribute
from chaos_requests import RequestRecord

pytestmark = pytest.mark.unit

INSTANCES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}


def record(start: float, end: float) -> RequestRecord:
    return RequestRecord("2p2d", "r", 0, 10, 1, False, start, end, 200, True, None, "x", "", None)


def test_a_request_meets_the_faults_that_overlap_it_and_loses_its_peer_only_when_every_instance_of_a_role_is_hit():
    faults = [Fault("f1", "stop", "prefill-0", "prefill", "api_server", 1, start=10.0, end=12.0),
              Fault("f2", "kill", "decode-0", "decode", "api_server", 2, start=20.0, end=None),  # not back by the end
              Fault("f3", "stop", "prefill-1", "prefill", "api_server", 3, start=11.5, end=13.0)]
    before, during_one, during_both, after, while_down = (record(0, 9.9), record(9, 10.5), record(11, 14),
                                                           record(14, 19), record(30, 31))
    attribute([before, during_one, during_both, after, while_down], faults, INSTANCES, run_end=40.0)
    assert (before.faults, before.healthy_peer) == ([], True)
    assert (during_one.faults, during_one.healthy_peer) == (["f1"], True)
    assert (during_both.faults, during_both.healthy_peer) == (["f1", "f3"], False)  # both prefills were hit
    assert (after.faults, after.healthy_peer) == ([], True)
    assert (while_down.faults, while_down.healthy_peer) == (["f2"], False)  # the only decode, down until the end
