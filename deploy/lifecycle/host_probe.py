"""Runs on a host (its source is piped to `python -`) and prints one JSON line about that Python.

Standalone on purpose: stdlib only, no kvpush imports, because the host may not have kvpush yet.
The same `source_digest` runs locally, so both sides hash the installed kvpush identically.
"""
import hashlib
import importlib
import importlib.util
import json
import os
import sys

PACKAGES = ["kvpush.bench", "kvpush.cli", "kvpush.common", "kvpush.connector", "kvpush.deploy", "kvpush.router",
            "kvpush.templates"]
HASHED_SUFFIXES = (".py", ".yaml")
FOUND_ONLY = ["vllm", "nixl"]  # importing vLLM takes seconds; finding it is enough here
IMPORTED = ["pydantic", "aiohttp", "kvpush.connector"]


def _package_dir(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def source_digest():
    """Content hash of kvpush's installed package files (editable or wheel); None if absent."""
    return digest_of({package: _package_dir(package) for package in PACKAGES})


def digest_of(package_dirs):
    """Hash of every .py/.yaml file under each package's directory (None: package missing)."""
    h = hashlib.sha256()
    found = False
    for package in PACKAGES:
        root = package_dirs.get(package)
        if root is None or not os.path.isdir(root):
            h.update(("missing " + package).encode())
            continue
        found = True
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for filename in sorted(filenames):
                if filename.endswith(HASHED_SUFFIXES):
                    path = os.path.join(dirpath, filename)
                    rel = package + "/" + os.path.relpath(path, root).replace(os.sep, "/")
                    with open(path, "rb") as f:
                        h.update(rel.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16] if found else None


def main():
    missing = {}
    for name in FOUND_ONLY:
        try:
            if importlib.util.find_spec(name) is None:
                missing[name] = "not installed"
        except (ImportError, ValueError) as exc:
            missing[name] = str(exc)
    for name in IMPORTED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report any import failure, whatever its kind
            missing[name] = "%s: %s" % (type(exc).__name__, exc)  # noqa: UP031 (runs on whatever Python a host has)
    import sysconfig

    site_dirs = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    deploy_dir = _package_dir("kvpush.deploy")
    editable = deploy_dir is not None and not any(
        os.path.realpath(deploy_dir).startswith(d + os.sep) for d in site_dirs
    )
    print(json.dumps({
        "python": sys.executable,
        "version": "%d.%d.%d" % sys.version_info[:3],  # noqa: UP031 (runs on whatever Python a host has)
        "digest": source_digest(),
        "missing": missing,
        "editable": editable,  # kvpush runs from a source checkout there: never overwrite it
    }))


if __name__ == "__main__":
    main()
