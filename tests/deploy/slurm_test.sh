#!/usr/bin/env bash
# A real one-node Slurm cluster (munged, slurmctld, slurmd from Debian's
# slurm-wlm 22.05), configured in a temp dir and run in a network namespace
# this test creates (so every daemon's port is on that namespace's
# loopback only), runs Trellis two ways:
#   1. `srun -n 3 parameter_server`: no launcher of ours; every rank finds
#      its place in SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the
#      store in the node list and job id (core/worker_env.h);
#   2. `sbatch deploy/slurm/trellis.sbatch parameter_server`: one
#      elastic-run per node over a c10d rendezvous on the first node.
# Each must print both trainers' held-out AUC and end with exit code 0.
# The test stops exactly the daemons it started (by PID) and removes its
# namespace and temp dir, also when it fails. Exit 77 (ctest: skipped)
# when Slurm or munge is not installed or the test is not root.
#
#   slurm_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

build=$(realpath "$1")
src=$(realpath "$2")
for tool in munged slurmctld slurmd srun sbatch squeue scontrol sinfo ip nsenter; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "SKIP: $tool is not installed (deploy/install-deps.sh installs Slurm and munge)"
    exit 77
  fi
done
if [[ $(id -u) -ne 0 ]]; then
  echo "SKIP: needs root (network namespace, munged, slurmd)"
  exit 77
fi

dir=$(mktemp -d /tmp/trellis-slurm.XXXXXX)
chmod 755 "$dir" # munged's socket must be reachable by slurm's clients
ns=trellis-slurm-$$
pids=()

cleanup() {
  local rc=$?
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    local until=$((SECONDS + 10))
    while ((SECONDS < until)) && kill -0 "$pid" 2>/dev/null; do
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  ip netns del "$ns" 2>/dev/null || true
  if ((rc != 0)); then
    for log in slurmctld.log slurmd.log munged.log; do
      [[ -f $dir/$log ]] && { echo "---- $log (last 20 lines)"; tail -n 20 "$dir/$log"; }
    done
  fi
  rm -rf "$dir"
  exit "$rc"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# nsenter, not `ip netns exec`: the latter remounts /sys, without the
# cgroup filesystem slurmd insists on.
in_ns() { nsenter --net="/run/netns/$ns" env SLURM_CONF="$dir/slurm.conf" "$@"; }
# Starts a daemon in the namespace; its PID (nsenter and env exec it) goes
# to `pids`.
start() {
  local log=$1
  shift
  (exec nsenter --net="/run/netns/$ns" env SLURM_CONF="$dir/slurm.conf" "$@" >"$log" 2>&1) &
  pids+=($!)
}

# Seconds left until `$1` (an absolute $SECONDS value).
before() { ((SECONDS < $1)); }

ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
# A second interface with an address: getaddrinfo's AI_ADDRCONFIG (which
# slurmctld uses to bind) finds nothing on a namespace with loopback alone.
ip netns exec "$ns" ip link add tsl0 type veth peer name tsl1
ip netns exec "$ns" ip addr add 10.233.0.1/24 dev tsl0
ip netns exec "$ns" ip link set tsl0 up
ip netns exec "$ns" ip link set tsl1 up

# munge: a fresh key, its own socket.
head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 400 "$dir/munge.key"
start "$dir/munged.out" munged --foreground --force --socket="$dir/munge.sock" \
  --key-file="$dir/munge.key" --log-file="$dir/munged.log" \
  --pid-file="$dir/munged.pid" --seed-file="$dir/munged.seed"

mkdir -p "$dir/state" "$dir/spool"
cat >"$dir/slurm.conf" <<EOF
ClusterName=trellistest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=10 State=UP
EOF

until=$((SECONDS + 10))
while before "$until" && [[ ! -S $dir/munge.sock ]]; do
  sleep 0.1
done
[[ -S $dir/munge.sock ]] || fail "munged did not create its socket"

start "$dir/slurmctld.out" slurmctld -D -f "$dir/slurm.conf"
start "$dir/slurmd.out" slurmd -D -N localhost -f "$dir/slurm.conf"

state=
until=$((SECONDS + 30))
while before "$until"; do
  state=$(in_ns timeout 5 sinfo -h -N -o %T 2>/dev/null || true)
  [[ $state == idle ]] && break
  sleep 0.2
done
[[ $state == idle ]] || fail "the node is '$state', not idle, after 30 s"
echo "slurm: one node idle in namespace $ns"

ps_bin=$build/examples/parameter_server
# Enough steps to clear the example's own AUC bar (0.75) with margin.
ps_args=(--steps 300 --log-every 100 --eval-samples 4096)

# 1. srun alone.
out=$(cd "$dir" && in_ns timeout 180 srun --ntasks=3 --overcommit "$ps_bin" "${ps_args[@]}" 2>&1) ||
  fail "srun parameter_server exited with $?: $out"
echo "$out" | tail -n 4
[[ $(grep -c "held-out" <<<"$out") == 2 ]] || fail "srun: not two trainers' held-out lines: $out"
grep -q "^ps: served" <<<"$out" || fail "srun: no server summary: $out"

# 2. sbatch with elastic-run (two workers per node: one server, one trainer).
job=$(cd "$dir" && in_ns timeout 30 env ELASTIC_RUN="$build/elastic/elastic-run" NPROC_PER_NODE=3 \
  sbatch --parsable --nodes=1 --overcommit --chdir="$dir" \
  "$src/deploy/slurm/trellis.sbatch" "$ps_bin" "${ps_args[@]}") ||
  fail "sbatch refused the script"
echo "slurm: batch job $job submitted"
finished=
until=$((SECONDS + 180))
while before "$until"; do
  if queued=$(in_ns timeout 10 squeue -h -j "$job" 2>/dev/null) && [[ -z $queued ]]; then
    finished=yes
    break
  fi
  sleep 0.2
done
[[ -n $finished ]] || fail "batch job $job still queued or running after 180 s"
info=$(in_ns timeout 10 scontrol show job "$job")
output=$(cat "$dir/trellis-$job.out" 2>/dev/null || true)
echo "$output" | tail -n 4
grep -q "JobState=COMPLETED" <<<"$info" || fail "batch job $job did not complete: $info
$output"
grep -q "ExitCode=0:0" <<<"$info" || fail "batch job $job exit code: $info"
[[ $(grep -c "held-out" <<<"$output") == 2 ]] || fail "sbatch: not two trainers' held-out lines: $output"
grep -q "rendezvous on localhost:29400" <<<"$output" || fail "sbatch: no rendezvous line: $output"
echo "PASS"
