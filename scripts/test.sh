#!/usr/bin/env bash
# Set up everything (idempotent) and run the test suite in lanes: unit, then integration, then e2e,
# each its own pytest run; the first lane that fails stops the run and is named.
#
#   scripts/test.sh                  all three lanes
#   scripts/test.sh -x -k router     all three lanes, extra arguments passed to each
#   scripts/test.sh -m unit          one pytest run with these arguments (the quick loop);
#   scripts/test.sh tests/unit/x.py  likewise whenever a marker (-m) or a path under tests/ is given
#
# Unit and integration tests run on one pytest-xdist worker per core (up to 4), a whole module to a
# worker, so a module's processes start once; modules take ports of their own (tests/conftest.py gives
# each worker its own sshd addresses). E2e tests each fill the cores with vLLM servers: one at a time,
# on a pool of deployments that `up` brings up once per session and revives after a test broke one
# (tests/e2e/conftest.py). Ctrl-C, SIGTERM and SIGHUP unwind a lane: nothing it started is left running.
# Per-test timeouts are set per lane in tests/conftest.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/test-setup.sh"  # the system packages only the tests use (sshd, Slurm, munge)
cd "$root"
export PYTHONUNBUFFERED=1
# The suite imports kvpush in hundreds of processes (xdist workers, routers, CLIs, vLLM servers); with
# bytecode not written, each of them compiles again every kvpush module it imports.
unset PYTHONDONTWRITEBYTECODE

pytest_passing_signals() {  # pytest ARGS... with Ctrl-C, SIGTERM and SIGHUP of this script passed on to it
  # as SIGTERM, which pytest turns into the unwinding Ctrl-C gets (tests/conftest.py): every fixture's
  # teardown stops what it started. (A background job ignores SIGINT, hence SIGTERM for all three.)
  local pid rc=0
  "$root/.venv/bin/python" -m pytest "$@" &
  pid=$!
  trap 'kill -TERM "$pid" 2>/dev/null' INT TERM HUP
  wait "$pid" || rc=$?
  while kill -0 "$pid" 2>/dev/null; do  # a signal ended the wait, not pytest: wait for its teardown
    rc=0
    wait "$pid" || rc=$?
  done
  trap - INT TERM HUP
  return "$rc"
}

run_pytest() {  # run_pytest LABEL ARGS...: pytest's status, with "collected nothing" counted as a failure
  local label=$1 rc
  shift
  set +e
  pytest_passing_signals "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: $label: pytest collected no tests; refusing to call that a pass" >&2
    return 1
  fi
  return "$rc"
}

workers=$(nproc)
[ "$workers" -gt 4 ] && workers=4
in_parallel=(-n "$workers" --dist loadfile)

selects_itself=0 selects_parallel_lane=0 previous=
for arg in "$@"; do
  case "$arg" in
    -m|-m*|tests|tests/*|./tests/*) selects_itself=1 ;;
  esac
  case "$previous $arg" in
    "-m unit"|"-m integration"|*" -munit"|*" -mintegration") selects_parallel_lane=1 ;;
  esac
  previous=$arg
done

if [ "$selects_itself" -eq 1 ]; then
  if [ "$selects_parallel_lane" -eq 1 ]; then
    run_pytest "pytest $*" "${in_parallel[@]}" "$@"
  else
    run_pytest "pytest $*" "$@"
  fi
  exit $?
fi

lanes_run=0
for lane in unit integration e2e; do
  echo "test.sh: lane $lane" >&2
  started=$SECONDS
  lane_options=()
  [ "$lane" != e2e ] && lane_options=("${in_parallel[@]}")
  set +e
  pytest_passing_signals "tests/$lane" "${lane_options[@]}" "$@"
  rc=$?
  set -e
  if [ "$rc" -eq 5 ] && [ "$#" -gt 0 ]; then
    echo "test.sh: lane $lane: nothing matches $*" >&2  # e.g. -k naming tests of another lane
    continue
  fi
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 5 ] && echo "test.sh: lane $lane: pytest collected no tests; refusing to call that a pass" >&2
    echo "test.sh: lane $lane FAILED after $((SECONDS - started)) s (later lanes not run)" >&2
    exit 1
  fi
  echo "test.sh: lane $lane passed in $((SECONDS - started)) s" >&2
  lanes_run=$((lanes_run + 1))
done
if [ "$lanes_run" -eq 0 ]; then
  echo "test.sh: no lane has a test matching $*; refusing to call that a pass" >&2
  exit 1
fi
