"""A bench's raw files (the client's per-request results, /metrics pages): kept beside bench.json,
gzip-compressed when large, so that every pooled figure can be recomputed from them.

A committed bench may hold them packed in one DIR/raw.tar.xz (benchmarks/pack_results.py), stored
uncompressed there; KeptFiles reads a bench's files by the names bench.json gives, either way."""
from __future__ import annotations

import gzip
import io
import lzma
import os
import shutil
import tarfile
from pathlib import Path

from kvpush.common.errors import UsageError

RAW_DIR = "raw"
GZIP_ABOVE_BYTES = 256 * 1024
ARCHIVE = "raw.tar.xz"
PLAIN_SUFFIXES = (".md", ".png", ".yaml", ".yml")  # what pack() leaves beside the archive: read by people
_DECOMPRESS = {".gz": gzip.decompress, ".xz": lzma.decompress}


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
    """A raw file's text, whether kept plain or gzip- or xz-compressed."""
    return _unpacked(path.suffix, path.read_bytes()).decode()


def _unpacked(suffix: str, data: bytes) -> bytes:
    undo = _DECOMPRESS.get(suffix)
    return undo(data) if undo else data


def _plain_name(name: str) -> str:
    suffix = Path(name).suffix
    return name[: -len(suffix)] if suffix in _DECOMPRESS else name


class KeptFiles:
    """A finished bench's files by their names relative to its directory: the file itself when it is
    there, else the same name (less any .gz/.xz) inside the directory's raw.tar.xz."""

    def __init__(self, bench_dir: Path):
        self.dir = bench_dir
        self._members: dict[str, bytes] | None = None

    def archived(self) -> dict[str, bytes]:
        """The members of raw.tar.xz by name (none when there is no archive), read once."""
        if self._members is None:
            self._members = {}
            path = self.dir / ARCHIVE
            if path.is_file():
                try:
                    with tarfile.open(path, "r:xz") as tar:
                        for member in tar:
                            got = tar.extractfile(member) if member.isfile() else None
                            if got is not None:
                                self._members[member.name.removeprefix("./")] = got.read()
                except (OSError, EOFError, tarfile.TarError, lzma.LZMAError) as exc:
                    raise UsageError(f"{path}: not a readable tar.xz ({exc}); pack it again with "
                                     f"benchmarks/pack_results.py or restore it from git") from None
        return self._members

    def _member(self, name: str) -> str | None:
        members = self.archived()
        return next((m for m in (name, _plain_name(name)) if m in members), None)

    def exists(self, name: str) -> bool:
        return (self.dir / name).is_file() or self._member(name) is not None

    def where(self, name: str) -> str:
        """The file, as a message should name it."""
        if (self.dir / name).is_file():
            return str(self.dir / name)
        member = self._member(name)
        return f"{self.dir / ARCHIVE}:{member}" if member else str(self.dir / name)

    def read_text(self, name: str) -> str:
        if (self.dir / name).is_file():
            return read_text(self.dir / name)
        member = self._member(name)
        if member is None:
            raise FileNotFoundError(self.dir / name)
        return _unpacked(Path(member).suffix, self.archived()[member]).decode()


def pack(bench_dir: Path) -> list[Path]:
    """Move every file of `bench_dir` but its PLAIN_SUFFIXES ones into bench_dir/raw.tar.xz (gzip undone,
    so xz compresses across files), for committing a result; returns the files packed. An existing
    archive is kept and its members stay unless a loose file of the same name replaces them."""
    archive = bench_dir / ARCHIVE
    loose = sorted(p for p in bench_dir.rglob("*") if p.is_file() and p != archive
                   and not p.name.endswith(PLAIN_SUFFIXES) and not p.name.endswith(".tmp"))
    if not loose:
        return []
    members = dict(KeptFiles(bench_dir).archived())
    for path in loose:
        members[_plain_name(path.relative_to(bench_dir).as_posix())] = _unpacked(path.suffix, path.read_bytes())
    tmp = archive.with_name(archive.name + ".tmp")
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, archive)
    for path in loose:
        path.unlink()
    for folder in sorted({p.parent for p in loose}, key=lambda f: len(f.parts), reverse=True):
        while folder != bench_dir and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return loose


def relative(path: Path, out_dir: Path) -> str:
    try:
        return str(path.relative_to(out_dir))
    except ValueError:
        return str(path)
