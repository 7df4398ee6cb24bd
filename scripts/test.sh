#!/usr/bin/env bash
# Set up everything (idempotent) and run the whole test suite: unit, integration, e2e.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit` or `scripts/test.sh tests/unit`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
export PYTHONUNBUFFERED=1
set +e
"$root/.venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; refusing to call that a pass" >&2
  exit 1
fi
exit "$rc"
