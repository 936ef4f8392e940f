#!/usr/bin/env bash
# Runs the cuda_ipc tests (cuda_ipc_test: the channel alone;
# cuda_ipc_pipe_test: through Context and Pipe) on a GPU machine that
# cannot build Trellis itself.
#
#   run_cuda_ipc_on_gpu.sh bundle [build dir]   (here, after building
#       cuda_ipc_test, cuda_ipc_pipe_test and their helpers) copies them and the
#       shared libraries they need that the GPU machine may lack into
#       gpu_bundle/ (ignore it: echo gpu_bundle >> .git/info/exclude);
#   run_cuda_ipc_on_gpu.sh run [gtest args]   (there, from the repository
#       root, with gpu_bundle/ copied along) runs the tests against the
#       machine's own CUDA driver and runtime.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=gpu_bundle
case "${1:-}" in
  bundle)
    build=${2:-build/cuda}
    rm -rf "$bundle" && mkdir -p "$bundle/lib"
    for b in cuda_ipc_test cuda_ipc_peer_helper cuda_ipc_pipe_test \
             cuda_ipc_pipe_helper; do
      cp "$build/tests/transport/$b" "$bundle/"
    done
    # Everything but libc, libstdc++ and CUDA's own libraries, which the GPU
    # machine provides (newer or matching).
    ldd "$bundle"/cuda_ipc_* |
      awk '/=>/ {print $3}' | sort -u |
      grep -v -E 'libc\.so|libm\.so|libdl|libpthread|librt|libgcc_s|libstdc\+\+|libcudart|ld-linux' |
      xargs -r -I{} cp -L {} "$bundle/lib/"
    # Debug info would push the bundle past what a run may carry.
    strip --strip-debug "$bundle"/cuda_ipc_* "$bundle"/lib/*
    du -sh "$bundle"
    ;;
  run)
    shift
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    cudart=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib 2>/dev/null | head -1)
    export LD_LIBRARY_PATH="$PWD/$bundle/lib:${cudart}:${LD_LIBRARY_PATH:-}"
    export TRELLIS_CUDA_IPC_PEER_HELPER="$PWD/$bundle/cuda_ipc_peer_helper"
    export TRELLIS_CUDA_IPC_PIPE_HELPER="$PWD/$bundle/cuda_ipc_pipe_helper"
    ldd "$bundle"/cuda_ipc_* | grep -E 'not found' || true
    rc=0
    "$bundle/cuda_ipc_test" "$@" || rc=$?
    "$bundle/cuda_ipc_pipe_test" "$@" || rc=$?
    exit $rc
    ;;
  *)
    echo "usage: $0 bundle [build dir] | run [gtest args]" >&2
    exit 2
    ;;
esac
