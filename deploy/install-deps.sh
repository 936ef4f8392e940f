#!/usr/bin/env bash
# Installs every Debian 12 package that building, testing and benchmarking
# Trellis need. Idempotent and non-interactive: packages already present are
# skipped, so a second run costs one dpkg query. Works as root or via sudo.
# Exits non-zero, naming the packages, when any could not be installed.
#
#   deploy/install-deps.sh          everything (build, tests, benchmarks)
#   deploy/install-deps.sh --build  only what a Release build of the library,
#                                   elastic-run and the examples needs (the
#                                   build stage of deploy/container/Containerfile)
set -euo pipefail

BUILD_PACKAGES=(
  # toolchain
  make cmake ninja-build g++ pkg-config
  # libraries (DESIGN.md, "Dependencies")
  libtorch-dev libopenblas0-pthread
  libuv1-dev libboost-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libssl-dev libcli11-dev libspdlog-dev nlohmann-json3-dev zlib1g-dev
)
DEV_PACKAGES=(
  # developer toolchain
  ccache clang libclang-rt-14-dev git
  # examples/ddp_fashion_mnist and its test: the data set
  dataset-fashion-mnist
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev etcd-server
  libtensorpipe-dev libgloo-dev
  # bench/ddp_bench: PyTorch's DDP (gloo) as the baseline, run by /usr/bin/python3
  python3-torch
  # tests/deploy: a one-node Slurm cluster; Open MPI's mpirun
  slurmctld slurmd slurm-client munge openmpi-bin
  # PyTorch for the torchrun compatibility test and the DDP benchmark's
  # baseline (Debian's python3, /usr/bin/python3)
  python3-torch
  # tests/deploy: the runtime image (buildah) run by podman (runc: crun
  # cannot run in a cgroup v1/v2 hybrid); the k8s manifests' offline check
  buildah podman runc crun python3-yaml python3-jsonschema
)
case "${1:-}" in
  "") PACKAGES=("${BUILD_PACKAGES[@]}" "${DEV_PACKAGES[@]}") ;;
  --build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "install-deps: not root and no sudo; cannot install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq || echo "install-deps: apt-get update failed; trying the cached lists" >&2
if ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/trellis-install-deps.log 2>&1; then
  tail -n 30 /tmp/trellis-install-deps.log >&2
fi

failed=()
for p in "${missing[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || failed+=("$p")
done
if ((${#failed[@]} > 0)); then
  echo "install-deps: could not install: ${failed[*]} (log: /tmp/trellis-install-deps.log)" >&2
  exit 1
fi
echo "install-deps: done"
