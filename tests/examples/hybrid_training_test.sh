#!/usr/bin/env bash
# The main job as a user runs it (examples/hybrid_training.cc, issue 19):
# 2 parameter servers + 2 trainers under elastic-run --standalone.
#   1. Undisturbed: exits 0, held-out AUC well above chance, the trainers'
#      dense parameters equal after every step (--check-consistency), and
#      no server changed a row of a table that was not looked up.
#   2. The last trainer exits abnormally once (--fail-at-step): elastic-run
#      restarts the group, every rank resumes from the last checkpoint, the
#      summary says so, and the AUC is within 0.01 of run 1.
#   3. A parameter server is SIGSTOPped (hung, not dead): a trainer's call
#      to it times out naming it (--timeout-s 5), elastic-run stops the
#      group (SIGKILL for the stopped one), restarts it, every rank resumes
#      from the last checkpoint and the job ends well.
#   4. Across a checkpoint: 1 trainer, then 2, then 1 again (each resumes
#      from the last's checkpoint), a damaged newest checkpoint skipped for
#      an older one whole everywhere, another number of servers refused.
#   5. Bad input: too few processes for the servers asked for, a bad
#      restart count in the environment, bad flags: exit non-zero naming
#      what was wrong.
#
#   hybrid_training_test.sh BUILD_DIR
set -euo pipefail

build=$(realpath "$1")
run=$build/elastic/elastic-run
job=$build/examples/hybrid_training
tmp=$(mktemp -d /tmp/trellis-hybrid-test.XXXXXX)
er=""       # the elastic-run of stage 3 while it runs
stopped=""  # the worker stage 3 stopped
cleanup() {
  if [[ -n $stopped ]]; then kill -KILL "$stopped" 2>/dev/null || true; fi
  if [[ -n $er ]]; then kill -TERM "$er" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

auc_of() {  # the held-out AUC printed by trainer 0
  sed -n 's/.*held-out AUC \([0-9.]*\).*/\1/p' <<<"$1" | tail -n 1
}

expect_line() {  # expect_line PATTERN WHY: $out has a line matching PATTERN
  grep -q -- "$1" <<<"$out" || fail "$2: $out"
}

auc_well_above_chance() {  # auc_well_above_chance WHEN: trainer 0's AUC >= 0.75
  local auc
  auc=$(auc_of "$out")
  [[ -n $auc ]] || fail "no AUC line $1: $out"
  awk -v a="$auc" 'BEGIN { exit !(a >= 0.75) }' ||
    fail "AUC $auc $1 is not well above chance (0.5): $out"
  echo "$auc"
}

check_servers() {  # 2 servers x 3 tables, none changed a row it did not look up
  local n
  n=$(grep -c ' 0 changed without a lookup' <<<"$1" || true)
  [[ $n -eq 6 ]] || fail "expected 6 (server, table) lines with no unlooked change, got $n: $1"
}

common=(--steps 400 --log-every 100 --eval-samples 4096 --checkpoint-every 50
        --check-consistency --timeout-s 60)

# timeout ends elastic-run (which ends its workers) if anything hangs.
out=$(timeout 150 "$run" --standalone --nproc-per-node 4 "$job" "${common[@]}" \
  --checkpoint-dir "$tmp/a" 2>&1) || fail "undisturbed run exited with $?: $out"
auc1=$(auc_well_above_chance "of the undisturbed run")
expect_line 'no restart' "no summary line"
check_servers "$out"
echo "undisturbed: AUC $auc1"

out=$(timeout 200 "$run" --standalone --nproc-per-node 4 --max-restarts 1 "$job" \
  "${common[@]}" --checkpoint-dir "$tmp/b" --fail-at-step 230 2>&1) ||
  fail "run with a failure exited with $?: $out"
expect_line 'trainer1: injected failure at step 230' "the failure was not injected"
expect_line 'restarting the worker group (restart 1' \
  "elastic-run did not restart the group"
expect_line 'resumed from the checkpoint of step 199' \
  "the group did not resume from the step-199 checkpoint"
expect_line 'restarts: 1 (resumed from the checkpoint of step 199), recovery' \
  "the summary does not report the restart"
check_servers "$out"
auc2=$(auc_of "$out")
awk -v a="$auc1" -v b="$auc2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.01) }' ||
  fail "AUC after a restart $auc2 is not within 0.01 of $auc1: $out"
echo "with a restart: AUC $auc2 ($(grep -o 'recovery [0-9.]* s' <<<"$out"))"

# Stage 3: a hung parameter server. Stopped once the servers have saved
# step 99, so the group resumes from a checkpoint.
"$run" --standalone --nproc-per-node 4 --max-restarts 1 "$job" --steps 400 \
  --log-every 100 --eval-samples 4096 --checkpoint-every 50 --timeout-s 5 \
  --checkpoint-dir "$tmp/c" >"$tmp/stop.log" 2>&1 &
er=$!
for _ in $(seq 600); do  # 60 s
  [[ -e $tmp/c/server1/tables-000000000099.ckpt ]] && break
  kill -0 "$er" 2>/dev/null || fail "the job ended early: $(cat "$tmp/stop.log")"
  sleep 0.1
done
[[ -e $tmp/c/server1/tables-000000000099.ckpt ]] ||
  fail "no checkpoint of step 99 in 60 s: $(cat "$tmp/stop.log")"
for pid in $(ps --ppid "$er" -o pid=); do
  if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'RANK=1'; then
    stopped=$pid
  fi
done
[[ -n $stopped ]] || fail "no worker of rank 1 under elastic-run $er"
kill -STOP "$stopped"
for _ in $(seq 1800); do  # 180 s
  kill -0 "$er" 2>/dev/null || break
  sleep 0.1
done
if kill -0 "$er" 2>/dev/null; then
  fail "the job did not end within 180 s of the stop: $(cat "$tmp/stop.log")"
fi
set +e
wait "$er"
rc=$?
set -e
er=""
out=$(cat "$tmp/stop.log")
[[ $rc -eq 0 ]] || fail "the job with a hung server exited with $rc: $out"
expect_line "to worker 'ps1' (rank 1) timed out after 5s" \
  "no error names the hung server"
expect_line 'restarting the worker group (restart 1' \
  "elastic-run did not restart the group"
expect_line 'resumed from the checkpoint of step' \
  "the group did not resume from a checkpoint"
auc3=$(auc_well_above_chance "after the hung server")
stopped=""
echo "with a hung server: AUC $auc3"

# Stage 4: across a checkpoint the number of trainers changes (1 -> 2 ->
# 1: scale up, then down), a damaged newest checkpoint is skipped for the
# newest one whole on every rank, and another number of servers is refused
# naming why.
short=(--log-every 50 --eval-samples 1024 --checkpoint-every 50 --timeout-s 60
       --checkpoint-dir "$tmp/d")
out=$(timeout 120 "$run" --standalone --nproc-per-node 3 "$job" "${short[@]}" \
  --steps 120 2>&1) || fail "1 trainer, 120 steps, exited with $?: $out"
out=$(timeout 120 "$run" --standalone --nproc-per-node 4 "$job" "${short[@]}" \
  --steps 220 2>&1) || fail "scaled up to 2 trainers, exited with $?: $out"
expect_line 'resumed from the checkpoint of step 99 (attempt 1, 2 trainers)' \
  "2 trainers did not resume from 1 trainer's checkpoint"
check_servers "$out"
out=$(timeout 120 "$run" --standalone --nproc-per-node 3 "$job" "${short[@]}" \
  --steps 320 2>&1) || fail "scaled down to 1 trainer, exited with $?: $out"
expect_line 'resumed from the checkpoint of step 199 (attempt 1, 1 trainer)' \
  "1 trainer did not resume from 2 trainers' checkpoint"
newest=$tmp/d/server1/tables-000000000299.ckpt
[[ -f $newest ]] || fail "no $newest: $(ls -R "$tmp/d")"
printf '\377\377\377\377' |
  dd of="$newest" bs=1 seek=$(($(stat -c %s "$newest") / 2)) conv=notrunc 2>/dev/null
out=$(timeout 120 "$run" --standalone --nproc-per-node 4 "$job" "${short[@]}" \
  --steps 340 2>&1) || fail "with a damaged checkpoint, exited with $?: $out"
expect_line "skipped the checkpoint of step 299: ps1: $newest: it is corrupted" \
  "the damaged checkpoint is not named"
expect_line 'resumed from the checkpoint of step 249 (attempt 1, 2 trainers)' \
  "the job did not fall back to step 249"
set +e
out=$(timeout 120 "$run" --standalone --nproc-per-node 3 "$job" "${short[@]}" \
  --servers 1 --steps 400 2>&1)
rc=$?
set -e
[[ $rc -ne 0 ]] || fail "another number of servers was accepted: $out"
expect_line "was taken with 2 servers and this job has 1 (--servers)" \
  "the refusal does not say why"
expect_line "no checkpoint in $tmp/d is whole on every rank" \
  "the refusal does not name the checkpoint folder"
echo "scale up, down, a damaged checkpoint skipped, other servers refused"

set +e
out=$(timeout 60 "$run" --standalone --nproc-per-node 2 "$job" --servers 2 2>&1)
rc=$?
set -e
[[ $rc -ne 0 ]] || fail "2 processes for 2 servers succeeded: $out"
expect_line 'needs at least one trainer' "no reason given"

set +e
out=$(RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 \
  TORCHELASTIC_RESTART_COUNT=x1 timeout 30 "$job" 2>&1)
rc=$?
set -e
[[ $rc -eq 2 ]] || fail "a bad TORCHELASTIC_RESTART_COUNT gave exit $rc: $out"
expect_line "TORCHELASTIC_RESTART_COUNT is not a count: 'x1'" \
  "the bad variable is not named"

# A bad flag is refused in the flag's own terms, before anything starts.
for bad in "--steps 0" "--timeout-s 0" "--checkpoint-every -1"; do
  set +e
  # shellcheck disable=SC2086  # $bad is a flag and its value
  out=$(timeout 30 "$job" $bad 2>&1)
  rc=$?
  set -e
  [[ $rc -ne 0 ]] || fail "$bad was accepted: $out"
done
out=$(timeout 30 "$job" --steps 0 2>&1 || true)
expect_line "--steps: must be a whole number of at least 1 (got '0')" \
  "--steps 0 is not refused in the flag's terms"
out=$(timeout 30 "$job" --timeout-s 0 2>&1 || true)
expect_line "--timeout-s: must be a number above 0 (got '0')" \
  "--timeout-s 0 is not refused in the flag's terms"
echo "PASS"
