"""Per-interval transfer stats, shipped from the worker to vLLM's stats logger.

vLLM-free; connector.py derives the KVConnectorStats subclass vLLM handles."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .pushes import SendRecord
from .state import Outcome

# write_s: a push's WRITE from its post to its completion (its bytes over it: the transfer's bytes/s)
_SERIES = ("send_bytes", "prefill_end_to_done_s", "write_s", "registration_wait_s", "recv_bytes", "layer_wait_s")
# marks_on_compute_thread: P on a GPU, steps whose forward-pass mark the compute thread recorded
# itself before the next forward pass, the recorder thread not having run yet (step_marks.py).
# late_write_backstops: D, transfer parts whose blocks came back on late_write_hold_s without
# prefill's word that its WRITEs ended or proof that it is gone (fences.py)
# kv_digest_mismatches: D, transfer parts whose landed KV differed from prefill's digest (verify_kv)
# kv_digests_verified: D, pushes whose every landed byte matched prefill's digests (verify_kv)
_COUNTS = ("sends_ok", "sends_failed", "recvs_ok", "recvs_failed", "marks_on_compute_thread", "late_write_backstops",
           "kv_digest_mismatches", "kv_digests_verified")


def _empty() -> dict[str, Any]:
    # "dropped": reason -> messages or requests the side channel dropped or refused (malformed,
    # unknown, duplicate, expired, foreign engine, ...), see Producer/Consumer.take_counts
    # "refused_params": reason -> requests whose kv_transfer_params the scheduler refused (kv_params)
    return {**{k: [] for k in _SERIES}, **{k: 0 for k in _COUNTS}, "dropped": {}, "refused_params": {}}


@dataclass
class PushStats:
    data: dict[str, Any] = field(default_factory=_empty)

    def record_send(self, rec: SendRecord) -> None:
        if rec.ok:
            self.data["sends_ok"] += 1
            self.data["send_bytes"].append(rec.num_bytes)
            self.data["prefill_end_to_done_s"].append(rec.finished - rec.offered)
            self.data["write_s"].append(max(0.0, rec.finished - rec.posted))
            self.data["registration_wait_s"].append(abs(rec.offered - rec.registered))
        else:
            self.data["sends_failed"] += 1

    def record_recv(self, outcome: Outcome) -> None:
        if outcome.ok:
            self.data["recvs_ok"] += 1
            self.data["recv_bytes"].append(outcome.num_bytes)
        else:
            self.data["recvs_failed"] += 1

    def record_dropped(self, counts: dict[str, int]) -> None:
        dropped = self.data["dropped"]
        for reason, n in counts.items():
            dropped[reason] = dropped.get(reason, 0) + int(n)

    def record_refused_params(self, counts: dict[str, int]) -> None:
        refused = self.data.setdefault("refused_params", {})
        for reason, n in counts.items():
            refused[reason] = refused.get(reason, 0) + int(n)

    def record_late_write_backstops(self, n: int) -> None:
        self.data["late_write_backstops"] += n

    def record_kv_digest_mismatches(self, n: int) -> None:
        self.data["kv_digest_mismatches"] += n

    def record_kv_digests_verified(self, n: int) -> None:
        self.data["kv_digests_verified"] += n

    def record_marks_on_compute_thread(self, n: int) -> None:
        self.data["marks_on_compute_thread"] += n

    def record_layer_wait(self, seconds: float) -> None:
        """D: one forward pass waited this long in all for streamed KV layers to land."""
        self.data["layer_wait_s"].append(seconds)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: PushStats) -> PushStats:
        for k in _SERIES:
            self.data[k] = self.data.get(k, []) + list(other.data.get(k, []))
        for k in _COUNTS:
            self.data[k] += int(other.data.get(k, 0))
        self.record_dropped(other.data.get("dropped", {}))
        self.record_refused_params(other.data.get("refused_params", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data[k] for k in _COUNTS}
        out["dropped"] = sum(self.data["dropped"].values())
        out["refused_params"] = sum(self.data.get("refused_params", {}).values())
        for k in _SERIES:
            values = sorted(self.data[k])
            if k.endswith("_s"):
                out[f"{k[:-2]}_p50_ms"] = round(values[len(values) // 2] * 1000, 3) if values else 0.0
                out[f"{k[:-2]}_max_ms"] = round(values[-1] * 1000, 3) if values else 0.0
            else:
                out[f"{k}_total"] = sum(values)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _COUNTS + _SERIES + ("dropped", "refused_params"))
