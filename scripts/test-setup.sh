#!/usr/bin/env bash
# Idempotent set-up of the system packages only the test suite uses, on Debian/Ubuntu: sshd for the
# SSH test hosts (tests/sshd_hosts.py), iproute2 for the network-namespace doctor tests, and
# slurmctld, slurmd, slurm-client and munge for the local Slurm test cluster (tests/slurm_cluster.py;
# installing them starts nothing the tests rely on: they run their own daemons). Installs through
# apt-get, with sudo unless you are root, and only what is missing. scripts/test.sh runs it; kvpush
# itself, the demo and `kvpush provision` need none of these.
set -euo pipefail
log() { printf '[test-setup] %s\n' "$*" >&2; }
need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
[ -x /usr/sbin/slurmctld ] || need_apt+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need_apt+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need_apt+=(slurm-client)
[ -x /usr/sbin/munged ] || need_apt+=(munge)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  log "installing Debian packages for the tests: ${need_apt[*]}"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
