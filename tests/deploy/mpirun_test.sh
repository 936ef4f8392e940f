#!/usr/bin/env bash
# Open MPI's mpirun starts the parameter-server example with no launcher of
# ours: every rank finds its place in OMPI_COMM_WORLD_* (core/worker_env.h)
# and the store in the MASTER_ADDR / MASTER_PORT passed with -x. Runs in a
# network namespace this test creates (mpirun's own listeners then exist on
# its loopback only). Exit 77 (ctest: skipped) without Open MPI or root.
#
#   mpirun_test.sh BUILD_DIR
set -euo pipefail

build=$(realpath "$1")
for tool in mpirun ip nsenter; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "SKIP: $tool is not installed (deploy/install-deps.sh installs openmpi-bin)"
    exit 77
  fi
done
if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP: needs root (network namespace)"
  exit 77
fi

ns=trellis-mpirun-$$
cleanup() {
  local rc=$?
  ip netns del "$ns" 2>/dev/null || true
  exit "$rc"
}
trap cleanup EXIT
ip netns add "$ns"
ip netns exec "$ns" ip link set lo up

# timeout ends mpirun (which ends its ranks) if anything hangs.
out=$(cd /tmp && nsenter --net="/run/netns/$ns" timeout 180 \
  mpirun --allow-run-as-root --oversubscribe -np 3 \
  --mca oob_tcp_if_include lo \
  -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 \
  "$build/examples/parameter_server" --steps 300 --log-every 100 \
  --eval-samples 4096 2>&1) || {
  echo "FAIL: mpirun exited with $?: $out" >&2
  exit 1
}
echo "$out" | tail -n 3
if [[ $(grep -c "held-out" <<<"$out") != 2 ]] || ! grep -q "^ps: served" <<<"$out"; then
  echo "FAIL: not both trainers' held-out lines and the server's summary: $out" >&2
  exit 1
fi
echo "PASS"
