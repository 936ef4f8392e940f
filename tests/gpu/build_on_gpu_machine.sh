#!/usr/bin/env bash
# Builds Trellis on a GPU machine that has PyTorch 2.x with CUDA (and its
# NCCL) but none of Trellis's Debian libraries and no package archive, and
# runs the tests that need a GPU there: the nccl backend and the cuda_ipc
# channel. It is also how the tree is checked against a libtorch 2.x.
#
#   build_on_gpu_machine.sh fetch          (here, on Debian 12) downloads the
#       Debian packages the GPU machine lacks into .gpu-debs/ (git
#       ignores it; a tool that copies only tracked files must be told to
#       take it along);
#   build_on_gpu_machine.sh test [OUTDIR]  (there, from the repository root,
#       with .gpu-debs/ copied along) unpacks them into a private prefix,
#       configures against the machine's PyTorch and NCCL, builds the GPU
#       tests (nccl, cuda_ipc, CUDA tensors over RPC, DDP over nccl) and
#       runs them, then the GPU echo benchmark (also with its stage trace,
#       and under the MPS daemon where there is one); logs go to OUTDIR;
#   build_on_gpu_machine.sh all [OUTDIR]   (there, after `test`) builds the
#       rest of the tree against the same libtorch, to show it compiles,
#       and runs the CPU suites against it;
#   build_on_gpu_machine.sh build OUTDIR TARGET...   (there) builds only
#       those targets (to debug one test against that libtorch).
#
# The packages are unpacked into /opt/trellis-deps, never over /.
set -euo pipefail
cd "$(dirname "$0")/../.."

debs=.gpu-debs
prefix=/opt/trellis-deps
build=build/gpu
packages=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev
  libgtest-dev libgmock-dev libuv1-dev libuv1 libprotobuf-dev libprotobuf32
  protobuf-compiler libprotoc32 libboost1.74-dev libssl-dev zlib1g-dev
  libcli11-dev libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29
  protobuf-compiler-grpc libabsl-dev libabsl20220623 libre2-dev libre2-9
  libc-ares-dev libc-ares2)
# elastic/ needs CLI11 and gRPC at configure time (elastic-run's etcd
# client), even where none of its targets is built.

unpack() {
  mkdir -p "$prefix"
  for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix"; done
  # A -dev package's libfoo.so points at a runtime library that the machine
  # may have instead of the carried prefix (libssl.so.3, libz.so.1), by a
  # relative or an absolute path: point every dangling link at the carried
  # copy, else the machine's copy of that file, else the machine's library
  # of the same soname (zlib1g-dev's libz.so names /lib/.../libz.so.1.2.13;
  # a machine with another zlib has only its own libz.so.1, and without the
  # link CMake takes the static libz.a, which a shared library cannot link).
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  find "$lib" -xtype l | while read -r link; do
    local target base soname candidate candidates=()
    target=$(readlink "$link")
    base=${target##*/}
    soname=$(sed -E 's/(\.so\.[0-9]+)\..*/\1/' <<<"$base")
    if [[ $target == /* ]]; then
      candidates+=("$prefix$target")
    fi
    candidates+=({/usr,}/lib/x86_64-linux-gnu/"$base"
      {/usr,}/lib/x86_64-linux-gnu/"$soname")
    for candidate in "${candidates[@]}"; do
      if [[ -e $candidate ]]; then
        ln -sf "$candidate" "$link"
        continue 2
      fi
    done
    echo "build_on_gpu_machine: $link -> $target is missing" >&2
  done
}

# In this shell, not in configure's (which runs in a pipeline's subshell):
# the build runs carried programs too (grpc_cpp_plugin needs libgrpc29's
# libraries).
setenv() {
  torch=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  nccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  export PKG_CONFIG_PATH=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$prefix
  export LD_LIBRARY_PATH=$lib:$nccl/lib:${LD_LIBRARY_PATH:-}
}

configure() {
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  python3 -c 'import torch; print("torch", torch.__version__, "cuda",
    torch.version.cuda, "nccl", torch.cuda.nccl.version(),
    torch.cuda.get_device_name(0))'
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch;$prefix/usr;$lib/cmake" \
    -DBoost_INCLUDE_DIR="$prefix/usr/include" \
    -DProtobuf_INCLUDE_DIR="$prefix/usr/include" \
    -DProtobuf_LIBRARY="$lib/libprotobuf.so" \
    -DProtobuf_PROTOC_EXECUTABLE="$prefix/usr/bin/protoc" \
    -DOPENSSL_ROOT_DIR="$prefix/usr" \
    -DTRELLIS_ENABLE_NCCL=ON \
    -DTRELLIS_NCCL_INCLUDE_DIR="$nccl/include" \
    -DTRELLIS_NCCL_LIBRARY="$(ls "$nccl"/lib/libnccl.so* | head -1)" \
    -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5
}

case "${1:-}" in
  fetch)
    mkdir -p "$debs"
    (cd "$debs" && apt-get download "${packages[@]}")
    du -sh "$debs"
    ;;
  test | all | build)
    out=${2:-/tmp/gpu-out}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    echo "kernel $(uname -r), $(nproc) cores"
    [[ -d $prefix/usr ]] || unpack
    setenv
    configure 2>&1 | tee "$out/configure.log" | tail -n 20
    if [[ $1 == build ]]; then
      cmake --build "$build" -j "$(nproc)" --target "${@:3}"
      exit
    fi
    if [[ $1 == test ]]; then
      targets=(collectives_nccl_test cuda_ipc_test cuda_ipc_peer_helper
        cuda_ipc_pipe_test cuda_ipc_pipe_helper transport_test rpc_cuda_test
        rpc_process_test rpc_worker_helper ddp_cuda_test rpc_cuda_bench
        elastic_checkpoint_test ddp_test ddp_worker)
      set -o pipefail
      cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" -- -k 0 \
        2>&1 | tee "$out/build.log" | grep -E 'error|FAILED' | head -n 60 || true
      rc=0
      (cd "$build" && ctest --output-on-failure -j 4 \
        -R 'Nccl|CudaIpc|PerDeviceChannels|RpcCuda|CudaTensorsBetweenProcesses|DdpCuda|Checkpoints|DdpProcess' \
        --timeout 300) 2>&1 | tee "$out/ctest.log" | tail -n 60 || rc=$?
      # The GPU tensor echo through RPC (docs/benchmarks.md).
      timeout 180 "$build/bench/rpc_cuda_bench" 2>&1 |
        tee "$out/rpc_cuda_bench.txt" || rc=$?
      # Again, shorter, with cuda_ipc's stage trace (docs/transport.md):
      # the sizes up to 64 MiB, then 1 KiB alone (the fixed cost).
      for args in "--echo-mib 64 --iters 300" "--max-kib 1 --iters 3000"; do
        echo "== rpc_cuda_bench $args" >>"$out/cuda_ipc_trace.txt"
        # shellcheck disable=SC2086
        TRELLIS_CUDA_IPC_TRACE=1 TRELLIS_LOG_LEVEL=info timeout 120 \
          "$build/bench/rpc_cuda_bench" $args 2>&1 |
          grep -E 'cuda_ipc trace|_echo_|noop' >>"$out/cuda_ipc_trace.txt" || true
      done
      # Under the MPS control daemon, where the machine has it: the
      # processes then share the GPU without switching contexts
      # (docs/benchmarks.md, "GPU tensors").
      if command -v nvidia-cuda-mps-control >/dev/null; then
        (
          export CUDA_MPS_PIPE_DIRECTORY=/tmp/trellis-mps
          export CUDA_MPS_LOG_DIRECTORY=/tmp/trellis-mps-log
          mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
          timeout 20 nvidia-cuda-mps-control -d
          timeout 120 "$build/bench/rpc_cuda_bench" --echo-mib 256 2>&1 |
            tee "$out/rpc_cuda_bench_mps.txt" || true
          echo quit | timeout 20 nvidia-cuda-mps-control
        ) || true
      fi
      exit $rc
    fi
    cmake --build "$build" -j "$(nproc)" -- -k 0 2>&1 | tee "$out/build-all.log" |
      grep -E 'error|FAILED' | head -n 80 || true
    # The CPU suites against this libtorch too, where time is left (etcd
    # and ip netns are not on such a machine).
    (cd "$build" && ctest -j "$(nproc)" --timeout 120 --output-on-failure \
      -E 'Etcd|NetworkHosts') >"$out/ctest-all.log" 2>&1 || true
    sed -n '/tests passed/,$p' "$out/ctest-all.log"
    ;;
  *)
    echo "usage: $0 fetch | test [OUTDIR] | all [OUTDIR] | build OUTDIR TARGET..." >&2
    exit 2
    ;;
esac
