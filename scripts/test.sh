#!/usr/bin/env bash
# Set up .venv if needed and run the whole test suite (cluster tests need root + slurm-wlm;
# without them they skip with a visible reason).
#
# With no arguments the cluster tests (tests/cluster: they mostly wait on Slurm and on ranks
# starting up) run in a second pytest beside the unit tests, spread over DDP_HPC_CLUSTER_WORKERS
# (default 4) pytest-xdist workers that share one test cluster (tests/conftest.py says how), and the
# unit tests over DDP_HPC_UNIT_WORKERS (default 3) workers, a test file per worker (many of them
# wait on real ranks starting, timing out or being stopped, so a third worker fills the cores the
# waits leave idle once the cluster tests are done: 1,079 s in all against 1,137-1,161 s with 2 on
# this 2-core machine; module fixtures stay on one worker); both
# reports are printed, and the exit status is the first non-zero one. With arguments, one pytest
# gets them as they are.
#
# DDP_HPC_TEST_LOAD=0.33 runs the tests under load: busy loops (scripts/cpu_load.py) take that share
# of every core for the whole run, as another user's work would; the tests must pass all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Bytecode is written where Python compiles (ddp_hpc, the tests, the helpers the test scripts import)
# even on a machine whose environment says not to (PYTHONDONTWRITEBYTECODE: set on the CI machines):
# without it each of a run's ~1,500 Python processes compiled again, from source, every module of
# ddp_hpc it imported (0.1-0.25 s of CPU a process), and each pytest worker its test files.
unset PYTHONDONTWRITEBYTECODE
PYTEST=(.venv/bin/python -m pytest -ra --durations=12)
load_pid=
if [ -n "${DDP_HPC_TEST_LOAD:-}" ]; then
  python3 scripts/cpu_load.py "$DDP_HPC_TEST_LOAD" &
  load_pid=$!
  trap 'kill "$load_pid" 2>/dev/null || true' EXIT
fi
if [ "$#" -gt 0 ]; then
  rc=0
  "${PYTEST[@]}" "$@" || rc=$?
  exit "$rc"
fi

log=$(mktemp "${TMPDIR:-/tmp}/ddp_hpc_cluster_tests.XXXXXX")
trap 'rm -f "$log"; [ -z "$load_pid" ] || kill "$load_pid" 2>/dev/null || true' EXIT
start=$(date +%s)
# the machine's CPU seconds (busy, idle, stolen; all cores) from /proc/stat's first line: idle
# seconds tell a run that waited from a CPU-bound one, stolen ones a hypervisor's other guests
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6, $9}' /proc/stat 2>/dev/null || echo "0 0 0"; }
read -r busy0 idle0 steal0 <<<"$(cpu_ticks)"
"${PYTEST[@]}" -n "${DDP_HPC_CLUSTER_WORKERS:-4}" --dist loadgroup tests/cluster >"$log" 2>&1 &
cluster_pid=$!
unit_rc=0
"${PYTEST[@]}" -n "${DDP_HPC_UNIT_WORKERS:-3}" --dist loadfile tests --ignore=tests/cluster || unit_rc=$?
echo "unit tests: exit $unit_rc after $(( $(date +%s) - start )) s; waiting for the cluster tests"
cluster_rc=0
wait "$cluster_pid" || cluster_rc=$?
echo "================================ cluster tests (tests/cluster) ================================"
cat "$log"
echo "cluster tests: exit $cluster_rc after $(( $(date +%s) - start )) s"
read -r busy1 idle1 steal1 <<<"$(cpu_ticks)"
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
echo "both lanes: $(( $(date +%s) - start )) s on $(nproc) cores; CPU (all of the machine's processes)" \
     "busy $(( (busy1 - busy0) / hz )) s, idle $(( (idle1 - idle0) / hz )) s, stolen $(( (steal1 - steal0) / hz )) s"
# pytest's 5 means "collected nothing": never a pass here, both runs must have collected tests
if [ "$unit_rc" -ne 0 ]; then exit "$unit_rc"; fi
exit "$cluster_rc"
