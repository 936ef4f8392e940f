#!/usr/bin/env bash
# Compatibility with torchrun (issue 18): a plain PyTorch DDP script (Debian
# python3-torch, gloo backend; tests/elastic/python/ddp_compat.py) runs
# unchanged under `torchrun --standalone --nproc_per_node 2` and under
# `elastic-run --standalone --nproc_per_node 2`. Both runs train to the same
# parameters, and each worker's launcher variables are the same under both
# launchers apart from those that must differ (the port, the run id and the
# error file path that holds it).
#
#   python_compat_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

build=$(realpath "$1")
src=$(realpath "$2")
script=$src/tests/elastic/python/ddp_compat.py
# Debian's python3 (with python3-torch) first: elastic-run, like torchrun,
# runs a .py program with the python3 it finds on PATH.
export PATH=/usr/bin:$PATH
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null || ! command -v torchrun >/dev/null; then
  echo "FAIL: Debian's python3-torch (torchrun) is missing; deploy/install-deps.sh installs it" >&2
  exit 1
fi

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

tmp=$(mktemp -d /tmp/trellis-pycompat.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"

# Both with the workers' stdout redirected into --log_dir (torchrun's
# layout: <log_dir>/<run id>_<random>/attempt_<n>/<local rank>/stdout.log),
# which the test reads. (Debian's torchrun 1.13 under Python 3.11 cannot
# run with the default --redirects 0 or --tee 0: its Std.from_str finds no
# flag for 0
# and returns None, and the agent fails before starting any worker.)
# timeout bounds each launcher (and through it, its workers).
launch() {  # NAME COMMAND...: the workers' stdout, rank 0 first
  local name=$1
  shift
  OMP_NUM_THREADS=1 timeout 120 "$@" --standalone --nproc_per_node 2 \
    --redirects 1 --tee 1 --log_dir "$tmp/$name-logs" "$script" \
    >"$tmp/$name.out" 2>"$tmp/$name.err" ||
    fail "$name exited with $?: $(cat "$tmp/$name.out" "$tmp/$name.err")"
  local logs
  logs=$(ls -d "$tmp/$name-logs"/*/attempt_0) ||
    fail "$name wrote no attempt_0 log folder: $(find "$tmp/$name-logs")"
  cat "$logs/0/stdout.log" "$logs/1/stdout.log"
}
torch_out=$(launch torchrun torchrun)
ours_out=$(launch elastic-run "$build/elastic/elastic-run")

# Output lines may carry a launcher's prefix; take what follows the tag.
field() { sed -n "s/.*\($1 .*\)/\1/p" <<<"$2"; }

r1=$(field result "$torch_out")
r2=$(field result "$ours_out")
[[ -n $r1 && $r1 == "$r2" ]] ||
  fail "different training results: torchrun '$r1', elastic-run '$r2'"
echo "same result under both launchers: $r1"

# Values that must differ between two runs.
# MASTER_ADDR: torchrun --standalone says "localhost", elastic-run the
# address its store listens on, 127.0.0.1 (a name could resolve to ::1 on
# one host and 127.0.0.1 on another; docs/elastic.md): both loopback.
normalize() {
  sed -E -e 's/MASTER_PORT=[0-9]+/MASTER_PORT=<port>/' \
    -e 's/MASTER_ADDR=(localhost|127\.0\.0\.1)( |$)/MASTER_ADDR=<loopback>\2/' \
    -e 's/TORCHELASTIC_RUN_ID=[^ ]+/TORCHELASTIC_RUN_ID=<id>/' \
    -e 's#TORCHELASTIC_ERROR_FILE=[^ ]+/attempt_([0-9]+)/([0-9]+)/error.json#TORCHELASTIC_ERROR_FILE=<log_dir>/attempt_\1/\2/error.json#'
}
for rank in 0 1; do
  e1=$(field "env rank$rank" "$torch_out" | normalize)
  e2=$(field "env rank$rank" "$ours_out" | normalize)
  [[ -n $e1 ]] || fail "no env line from rank $rank under torchrun: $torch_out"
  if [[ $e1 != "$e2" ]]; then
    diff <(tr ' ' '\n' <<<"$e1") <(tr ' ' '\n' <<<"$e2") >&2 || true
    fail "rank $rank's environment differs (torchrun <, elastic-run >)"
  fi
done
echo "same worker environment under both launchers"
echo PASS
