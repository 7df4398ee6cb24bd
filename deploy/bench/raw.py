"""A bench's raw files (the client's per-request results, /metrics pages): kept beside bench.json,
gzip-compressed when large, so that every pooled figure can be recomputed from them."""
from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

RAW_DIR = "raw"
GZIP_ABOVE_BYTES = 256 * 1024


def keep(path: Path) -> Path:
    """`path`, or `path.gz` in its place when it is larger than GZIP_ABOVE_BYTES; returns the file kept."""
    if path.stat().st_size <= GZIP_ABOVE_BYTES:
        return path
    packed = path.with_name(path.name + ".gz")
    tmp = packed.with_name(packed.name + ".tmp")
    with open(path, "rb") as source, gzip.open(tmp, "wb") as target:
        shutil.copyfileobj(source, target)
    os.replace(tmp, packed)
    path.unlink()
    return packed


def read_text(path: Path) -> str:
    """A raw file's text, whether kept plain or gzip-compressed."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return f.read()
    return path.read_text()


def relative(path: Path, out_dir: Path) -> str:
    try:
        return str(path.relative_to(out_dir))
    except ValueError:
        return str(path)
