#!/usr/bin/env bash
# Set up everything (idempotent), bring up the built-in local-cpu topology (1 prefill + 1 decode
# real vLLM on CPU, tiny local model, router), send one request through the router, print the
# answer and its TTFT, then tear it down. `scripts/demo.sh --keep` leaves it running.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
keep=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    *) echo "demo.sh: unknown option $arg (use --keep)" >&2; exit 2 ;;
  esac
done
"$root/scripts/setup.sh"
kvpush=("$root/.venv/bin/kvpush")
# Named, not left to the default: a ./kvpush.yaml of the user's would otherwise be brought up instead.
topology="$root/templates/local-cpu.yaml"
cd "$root"
if [ "$keep" = 0 ]; then
  trap '"${kvpush[@]}" down "$topology"' EXIT
fi
"${kvpush[@]}" up "$topology"
"${kvpush[@]}" request --file "$topology" "the cache block moves from prefill to decode"
echo "(the tiny local model has random weights: its words are noise; the proof line of up counts the"
echo " prompt tokens decode received by KV transfer)"
if [ "$keep" = 1 ]; then
  echo "left running; stop with: ${kvpush[*]} down $topology"
fi
