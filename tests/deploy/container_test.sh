#!/usr/bin/env bash
# The Trellis runtime image, built and run for real: builds the CPU image
# with deploy/container/build-local-image.sh (buildah from scratch, no base
# image pulled) and runs the main job inside it with podman, with no network:
#
#   podman run --rm --network none --shm-size 256m IMAGE elastic-run \
#     --standalone --nproc-per-node 4 /opt/trellis/libexec/hybrid_training \
#     --steps 200 --checkpoint-dir /tmp/ckpt
#
# and checks exit 0 and trainer 0's "held-out ... AUC" line. Images and
# containers live in a containers/storage of its own (vfs driver, under a
# temp dir, through CONTAINERS_STORAGE_CONF), so the machine's images are
# untouched; the test removes the image it built (by its tag) and the temp
# dir, also when it fails.
#
# Exit 77 (ctest: skipped) only when podman truly cannot run a container
# here, with podman's own error; before that it tries each installed OCI
# runtime (crun, runc), the cgroupfs cgroup manager and the file events
# backend, and ulimits within what this process may set (podman's rootful
# defaults, nofile 1048576 and nproc 4194304, need CAP_SYS_RESOURCE).
#
#   container_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

build=$(realpath "$1")
src=$(realpath "$2")
for tool in podman buildah timeout; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "SKIP: $tool is not installed (deploy/install-deps.sh installs podman and buildah)"
    exit 77
  fi
done
for bin in elastic/elastic-run examples/hybrid_training examples/parameter_server; do
  if [[ ! -x $build/$bin ]]; then
    echo "FAIL: $build/$bin is not built" >&2
    exit 1
  fi
done

dir=$(mktemp -d /tmp/trellis-container.XXXXXX)
tag=localhost/trellis-test:$$-$RANDOM
cat >"$dir/storage.conf" <<EOF
[storage]
driver = "vfs"
graphroot = "$dir/storage"
runroot = "$dir/run"
EOF
export CONTAINERS_STORAGE_CONF=$dir/storage.conf
# Rootless podman keeps some state under XDG_RUNTIME_DIR; keep it here too.
if [[ $(id -u) -ne 0 ]]; then
  mkdir -m 700 "$dir/xdg"
  export XDG_RUNTIME_DIR=$dir/xdg
fi
# libpod's state, network configs and volumes under the temp dir too.
mkdir -p "$dir/libpod" "$dir/net" "$dir/volumes"
podman_global=(--cgroup-manager cgroupfs --events-backend file --tmpdir "$dir/libpod"
  --network-config-dir "$dir/net" --volumepath "$dir/volumes")

ctr=trellis-test-$$
cleanup() {
  local rc=$?
  podman "${podman_global[@]}" rm -f -t 0 "$ctr" >/dev/null 2>&1 || true
  podman "${podman_global[@]}" rmi -f "$tag" >/dev/null 2>&1 || true
  # vfs layers may hold read-only directories; the store is ours alone.
  chmod -R u+w "$dir" 2>/dev/null || true
  rm -rf "$dir"
  exit "$rc"
}
trap cleanup EXIT

# buildah must work at all here (rootless without user namespaces, say, it
# cannot): that is a skip, not a failure of the script.
if ! probe=$(timeout 60 buildah from scratch 2>&1); then
  echo "SKIP: buildah cannot create a container here: $probe"
  exit 77
fi
buildah rm "$probe" >/dev/null 2>&1 || true

start=$SECONDS
if ! out=$(timeout 300 nice -n 10 "$src/deploy/container/build-local-image.sh" "$build" "$tag" 2>&1); then
  echo "FAIL: build-local-image.sh: $out" >&2
  exit 1
fi
echo "$out" | tail -n 2
size=$(podman "${podman_global[@]}" image inspect --format '{{.Size}}' "$tag")
echo "image $tag: $((size / 1048576)) MiB, built in $((SECONDS - start)) s"

# ulimits this process may pass on: podman's rootful defaults exceed the
# hard limits of a root without CAP_SYS_RESOURCE, and conmon runs the OCI
# runtime with nproc at most 32768.
nofile=$(ulimit -Hn)
[[ $nofile == unlimited ]] && nofile=1048576
nproc=$(ulimit -Hu)
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")

# Pick the first OCI runtime that can start this image at all.
runtime=
errors=
for rt in crun runc; do
  command -v "$rt" >/dev/null 2>&1 || continue
  if probe=$(timeout 60 podman "${podman_global[@]}" --runtime "$rt" run --rm --network none \
    "${limits[@]}" "$tag" sh -c 'echo container-ok' 2>&1) && [[ $probe == *container-ok* ]]; then
    runtime=$rt
    break
  fi
  errors+="  $rt: $probe"$'\n'
done
if [[ -z $runtime ]]; then
  if [[ -z $errors ]]; then
    echo "SKIP: neither crun nor runc is installed (podman needs an OCI runtime)"
  else
    echo "SKIP: podman cannot run a container on this machine; podman's errors per OCI runtime:"
    echo -n "$errors"
  fi
  exit 77
fi
echo "podman runs containers here with --runtime $runtime --cgroup-manager cgroupfs --events-backend file ${limits[*]}"

start=$SECONDS
rc=0
out=$(timeout 150 podman "${podman_global[@]}" --runtime "$runtime" run --rm --network none \
  --shm-size 256m "${limits[@]}" "$tag" \
  elastic-run --standalone --nproc-per-node 4 /opt/trellis/libexec/hybrid_training \
  --steps 200 --checkpoint-dir /tmp/ckpt 2>&1) || rc=$?
grep -E "held-out|restart" <<<"$out" || echo "$out" | tail -n 20
echo "the job ran in $((SECONDS - start)) s (exit $rc)"
if ((rc != 0)); then
  echo "FAIL: podman run exited with $rc" >&2
  exit 1
fi
if ! grep -q "held-out.*AUC" <<<"$out"; then
  echo "FAIL: no held-out AUC line in the job's output" >&2
  exit 1
fi

# As Kubernetes runs it: elastic-run is PID 1 (the entrypoint execs it), the
# liveness probe (trellis-entrypoint --liveness) passes while it runs, and
# SIGTERM (podman stop, the kubelet) stops the agent and its workers within
# the grace period, without SIGKILL.
run=(podman "${podman_global[@]}" --runtime "$runtime")
"${run[@]}" run -d --name "$ctr" --network none --shm-size 256m "${limits[@]}" "$tag" \
  elastic-run --standalone --nproc-per-node 4 hybrid_training --steps 1000000 >/dev/null
live=
for _ in $(seq 60); do
  if probe=$(timeout 10 "${run[@]}" exec "$ctr" trellis-entrypoint --liveness 2>&1); then
    live=1
    break
  fi
  sleep 0.5
done
if [[ -z $live ]]; then
  echo "FAIL: the liveness probe never passed: $probe" >&2
  "${run[@]}" logs "$ctr" 2>&1 | tail -n 20 >&2
  exit 1
fi
if ! timeout 10 "${run[@]}" run --rm --network none "${limits[@]}" "$tag" \
    trellis-entrypoint --liveness >/dev/null 2>&1; then
  echo "liveness probe: passes with elastic-run as PID 1, fails without it"
else
  echo "FAIL: the liveness probe does not tell a running agent from none" >&2
  exit 1
fi
start=$SECONDS
timeout 60 "${run[@]}" stop -t 20 "$ctr" >/dev/null
code=$("${run[@]}" inspect --format '{{.State.ExitCode}}' "$ctr")
echo "SIGTERM: the agent stopped in $((SECONDS - start)) s with exit code $code"
if ((code == 137)); then
  echo "FAIL: the agent did not stop on SIGTERM within 20 s (killed)" >&2
  exit 1
fi
echo "PASS"
