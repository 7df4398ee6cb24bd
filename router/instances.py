"""The router's instance list as a file of its own, and how a running router says it took a new one.

`kvpush up` writes the list (`instances_file` in the router config) and sends the router SIGHUP;
the router reads the file again, takes removed instances out of rotation at once, lets what they
still carry finish (draining), and admits new ones on their first healthy /health answer. Its
/metrics says how far it got, in two gauges that `up` reads before it stops a removed instance:

- `kvpush_router_instance_list{digest}`: 1 for the list each router process serves (one sample per
  worker process), 0 for lists it served before;
- `kvpush_router_draining{instance, role}`: what a removed instance still carries (legs, and
  transfers from it that decode has not finished reading), summed over the workers; 0 once drained.

The digest is of the list as parsed, so the writer and the router compute the same one.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpush.common.errors import UsageError
from kvpush.common.vllm_metrics import samples

from .metrics import DRAINING_METRIC, INSTANCE_LIST_METRIC
from .upstream_spec import Upstream

MAX_FILE_BYTES = 16 << 20  # about 70,000 instances written with indents


class InstanceList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill: list[Upstream] = Field(default_factory=list)
    # Empty while `up` restarts the only decode instance: new requests get a 503 at once, those
    # in flight finish.
    decode: list[Upstream] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> InstanceList:
        for role in ("prefill", "decode"):
            counts = Counter(u.name for u in getattr(self, role))
            twice = sorted(name for name, count in counts.items() if count > 1)
            if twice:
                raise ValueError(f"{role}: instance name {twice[0]!r} is listed twice; give each instance its own name")
        return self

    def digest(self) -> str:
        return list_digest(self.prefill, self.decode)


def list_digest(prefill: list[Upstream], decode: list[Upstream]) -> str:
    canonical = json.dumps({"prefill": [u.model_dump(mode="json") for u in prefill],
                            "decode": [u.model_dump(mode="json") for u in decode]}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_instance_list(path: str | Path) -> InstanceList:
    """The file's list; UsageError naming the file and what is wrong with it. Only a regular file is
    read: opening a FIFO or a device does not wait for a writer, and the file is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise UsageError(f"router instances file {path}: is {_file_kind(mode)}, not a regular file; point "
                                 "instances_file at the file `kvpush up` writes")
            data = _read_at_most(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise UsageError(f"router instances file {path}: {exc.strerror or exc}; `kvpush up` writes it, "
                         "or fix instances_file in the router config") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"router instances file {path}: over {MAX_FILE_BYTES >> 20} MiB")
    try:
        listed = InstanceList.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        message = first["msg"].removeprefix("Value error, ")
        raise UsageError(f"router instances file {path}: {where}: {message}") from None
    return listed


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


@dataclass
class ReloadProgress:
    """What a router's /metrics says about taking a new instance list."""

    serving: set[str] = field(default_factory=set)  # digests some router process serves now
    draining: dict[str, float] = field(default_factory=dict)  # removed instance -> what it still carries

    def took(self, digest: str) -> bool:
        """Every router process serves the list with this digest."""
        return self.serving == {digest}

    def left_on(self, names: list[str]) -> dict[str, float]:
        """Of these instances, those still carrying work (a name the router never had carries none)."""
        return {n: self.draining[n] for n in names if self.draining.get(n, 0.0) > 0}


def reload_progress(metrics_text: str) -> ReloadProgress:
    progress = ReloadProgress()
    for metric, labels, value in samples(metrics_text):
        if metric == INSTANCE_LIST_METRIC and value == 1 and "digest" in labels:
            progress.serving.add(labels["digest"])
        elif metric == DRAINING_METRIC and "instance" in labels:
            progress.draining[labels["instance"]] = progress.draining.get(labels["instance"], 0.0) + value
    return progress
