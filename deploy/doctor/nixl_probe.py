"""Creates a NIXL agent and one backend, in a process of its own: the only proof a plugin loads.

Self-contained (standard library + nixl): shipped as source, `python -c SOURCE BACKEND`. Prints one
JSON line. A plugin missing a symbol can abort the process; the caller treats a silent death,
a non-zero exit or a timeout as "cannot be created".
"""
import importlib
import importlib.util
import json
import sys
import time


def nixl_api():
    """NIXL's API module without importing torch.

    The `nixl` meta package may import torch just to pick nixl_cuXX (seconds); when exactly one
    nixl_cuXX is installed that choice is already made, so import it directly.
    """
    flavours = [m for m in ("nixl_cu13", "nixl_cu12") if importlib.util.find_spec(m) is not None]
    if len(flavours) == 1:
        return importlib.import_module(flavours[0] + "._api"), flavours[0]
    return importlib.import_module("nixl._api"), "nixl"


def main(argv):
    backend = argv[1]
    report = {"backend": backend, "module": None, "plugins": [], "created": False, "mem_types": [],
              "error": None, "seconds": None}
    started = time.monotonic()
    try:
        api, report["module"] = nixl_api()
        agent = api.nixl_agent("kvpush-doctor", api.nixl_agent_config(backends=[], enable_prog_thread=False))
        report["plugins"] = sorted(agent.get_plugin_list())
        agent.create_backend(backend)
        report["mem_types"] = list(agent.get_backend_mem_types(backend))
        report["created"] = True
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = round(time.monotonic() - started, 3)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0 if report["created"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
