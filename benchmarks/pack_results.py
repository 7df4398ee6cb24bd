"""Pack a results folder for committing: README, PNG and YAML files stay plain, everything else moves
into one raw.tar.xz (gzip undone, so xz compresses across files) that `kvpush bench --recompute DIR`
reads directly.

    python benchmarks/pack_results.py benchmarks/results/<run> [...]
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvpush.bench.raw import ARCHIVE, pack


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for arg in argv:
        folder = Path(arg)
        if not folder.is_dir():
            print(f"{folder}: not a directory; give a results folder", file=sys.stderr)
            return 2
        packed = pack(folder)
        if not packed:
            print(f"{folder}: nothing to pack")
            continue
        print(f"{folder}: {len(packed)} files into {ARCHIVE} ({(folder / ARCHIVE).stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
