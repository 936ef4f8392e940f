# The two commands (README): `make test` sets everything up and runs every
# test; `make run` runs the main job. Both install dependencies first.
JOBS ?= $(shell nproc)
FUZZ_RUNS ?= 200000
# ...or this many seconds, whichever comes first: most fuzzers do their runs
# in 5-15 s here, the handshake's (an HMAC per message) would take 2 min.
FUZZ_SECONDS ?= 20
# Lets ccache share results between clones in different folders (CI).
export CCACHE_BASEDIR ?= $(CURDIR)
# Debug info would otherwise put the clone's folder into every hash.
export CCACHE_NOHASHDIR ?= true

.PHONY: deps build test test-dev test-asan test-tsan test-fuzz tsa run clean

deps:
	bash deploy/install-deps.sh

build: deps
	cmake --preset dev
	cmake --build --preset dev -j $(JOBS)

test-dev: build
	ctest --preset dev -j $(JOBS)

# AddressSanitizer + UBSan pass over the components' tests and fuzz replays
# (ddp_test: about 25 s there, two cores).
# The 4 MiB collective sweeps (4-6 s each in dev, 14-17 s under ASan) run
# in the dev suite only; the sanitizers take the same code paths in the
# sweeps' small sizes and in the 4 MiB allreduce tests. Cases left out are
# gtest patterns (SANITIZER_GTEST_SKIP, given to CMake): a binary that loads
# libtorch runs one process per suite there, not per case
# (cmake/GtestSuites.cmake), so ctest's -E cannot pick out its cases.
SANITIZER_GTEST_SKIP := DistAutogradProcess.WorkerKilled*:*OpSweep.*_4MiB
test-asan: deps
	cmake --preset asan -DTRELLIS_SANITIZER_GTEST_SKIP='$(SANITIZER_GTEST_SKIP)'
	cmake --build --preset asan -j $(JOBS) --target core_test wire_fuzz_replay store_test store_request_fuzz_replay transport_test transport_frame_fuzz_replay transport_handshake_fuzz_replay shm_test shm_peer_helper cma_test cma_peer_helper rpc_codec_test rpc_agent_test rpc_contract_test rpc_codec_fuzz_replay rpc_envelope_fuzz_replay store_handshake_fuzz_replay transport_record_fuzz_replay shm_ring_fuzz_replay rpc_protocol_fuzz_replay collective_message_fuzz_replay flight_records_fuzz_replay rpc_quiescence_test dist_autograd_test dist_optimizer_test dist_step_gate_test dist_tutorial_test dist_autograd_process_test dist_autograd_worker collectives_kernels_test collectives_test collectives_watchdog_test collectives_process_test collectives_worker trellis-flight-recorder elastic_test elastic_run_test elastic-run elastic_test_worker elastic_error_file_fuzz_replay worker_env_fuzz_replay elastic_checkpoint_test ddp_test ddp_hybrid_test sync_batch_norm_test ddp_worker elastic_multinode_test elastic_round_record_fuzz_replay seal_fuzz_replay etcd_store_test row_shards_test
	ctest --preset asan -j $(JOBS) -L 'core|fuzz|store|transport|rpc|dist_autograd|collectives|elastic|ddp|example_code'

# ThreadSanitizer pass over the components with threads and loops.
test-tsan: deps
	cmake --preset tsan -DTRELLIS_SANITIZER_GTEST_SKIP='$(SANITIZER_GTEST_SKIP)'
	cmake --build --preset tsan -j $(JOBS) --target core_test store_test transport_test shm_test shm_peer_helper cma_test cma_peer_helper rpc_agent_test rpc_contract_test rpc_quiescence_test dist_autograd_test dist_optimizer_test dist_step_gate_test dist_tutorial_test dist_autograd_process_test dist_autograd_worker collectives_test collectives_watchdog_test ddp_test ddp_hybrid_test sync_batch_norm_test ddp_worker
	ctest --preset tsan -j $(JOBS) -L 'core|store|transport|rpc|dist_autograd|collectives|ddp' -E 'rpc_codec|CollectivesProcess'

# Clang's thread-safety analysis over the libraries that use locks (core,
# transport, the store's client side, collectives, and what of rpc, rref
# and dist_autograd clang 14 compiles against libtorch 1.13: see
# rpc/CMakeLists.txt; the store server's Asio coroutines need a newer
# clang). A GUARDED_BY/REQUIRES violation is a
# compile error (docs/threads.md, "Locks"). Compiles only: nothing to run.
TSA_TARGETS := trellis_core trellis_transport trellis_store_tsa \
    trellis_collectives_wire trellis_collectives_cpu trellis_collectives_records \
    trellis_collectives_watchdog trellis_rpc_tsa \
    $(if $(wildcard /usr/local/cuda/include/nccl.h),trellis_collectives_nccl)

tsa: deps
	cmake --preset tsa
	cmake --build --preset tsa -j $(JOBS) --target $(TSA_TARGETS)

# libFuzzer targets, a bounded number of iterations each: name and
# -max_len. Each grows its corpus in build/fuzz/corpus/<name> from the seeds
# in tests/fuzz/corpus/<name>.
FUZZERS := wire:512 store_request:512 store_handshake:128 \
    transport_frame:1024 transport_handshake:1024 transport_record:512 \
    shm_ring:512 \
    rpc_envelope:1024 rpc_codec:1024 rpc_protocol:1024 \
    collective_message:256 flight_records:4096 elastic_error_file:4096 \
    worker_env:512 elastic_round_record:4096 seal:1024

test-fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS) --target $(foreach f,$(FUZZERS),$(word 1,$(subst :, ,$(f)))_fuzz)
	set -e; for f in $(FUZZERS); do \
	  name=$${f%%:*}; len=$${f##*:}; \
	  mkdir -p build/fuzz/corpus/$$name; \
	  build/fuzz/tests/fuzz/$${name}_fuzz -runs=$(FUZZ_RUNS) -max_total_time=$(FUZZ_SECONDS) -max_len=$$len \
	      build/fuzz/corpus/$$name tests/fuzz/corpus/$$name; \
	done

test: build tsa test-asan test-tsan test-fuzz
	ctest --preset dev -j $(JOBS)

# The main job (docs/examples.md): hybrid DDP + RPC training, two parameter
# servers and two trainers under elastic-run, with one trainer failure
# injected so the restart and the resume from a checkpoint show. Builds only
# what the job needs, not the tests.
run: deps
	cmake --preset dev
	cmake --build --preset dev -j $(JOBS) --target elastic-run hybrid_training
	build/dev/elastic/elastic-run --standalone --nproc-per-node 4 --max-restarts 1 build/dev/examples/hybrid_training --fail-at-step 420

clean:
	rm -rf build
