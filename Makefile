# The two commands (README): `make test` sets everything up and runs every
# test; `make run` runs the main job. Both install dependencies first.
JOBS ?= $(shell nproc)
FUZZ_RUNS ?= 200000
# Lets ccache share results between clones in different folders (CI).
export CCACHE_BASEDIR ?= $(CURDIR)

.PHONY: deps build test test-dev test-asan test-tsan test-fuzz run clean

deps:
	bash deploy/install-deps.sh

build: deps
	cmake --preset dev
	cmake --build --preset dev -j $(JOBS)

test-dev: build
	ctest --preset dev -j $(JOBS)

# AddressSanitizer + UBSan pass over the components' tests and fuzz replays.
test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS) --target core_test wire_fuzz_replay store_test store_request_fuzz_replay transport_test transport_frame_fuzz_replay shm_test shm_peer_helper cma_test cma_peer_helper rpc_codec_test rpc_agent_test rpc_codec_fuzz_replay rpc_envelope_fuzz_replay dist_autograd_test dist_optimizer_test
	ctest --preset asan -j $(JOBS) -L 'core|fuzz|store|transport|rpc|dist_autograd' -E 'rpc_process|dist_autograd_process'

# ThreadSanitizer pass over the components with threads and loops.
test-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS) --target core_test store_test transport_test shm_test shm_peer_helper cma_test cma_peer_helper rpc_agent_test dist_autograd_test dist_optimizer_test
	ctest --preset tsan -j $(JOBS) -L 'core|store|transport|rpc|dist_autograd' -E 'rpc_process|rpc_codec|dist_autograd_process'

# libFuzzer targets, a bounded number of iterations each.
test-fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS) --target wire_fuzz
	mkdir -p build/fuzz/corpus/wire
	build/fuzz/tests/fuzz/wire_fuzz -runs=$(FUZZ_RUNS) -max_len=512 \
	    build/fuzz/corpus/wire tests/fuzz/corpus/wire
	cmake --build --preset fuzz -j $(JOBS) --target store_request_fuzz
	mkdir -p build/fuzz/corpus/store_request
	build/fuzz/tests/fuzz/store_request_fuzz -runs=$(FUZZ_RUNS) -max_len=512 \
	    build/fuzz/corpus/store_request tests/fuzz/corpus/store_request
	cmake --build --preset fuzz -j $(JOBS) --target transport_frame_fuzz
	mkdir -p build/fuzz/corpus/transport_frame
	build/fuzz/tests/fuzz/transport_frame_fuzz -runs=$(FUZZ_RUNS) -max_len=1024 \
	    build/fuzz/corpus/transport_frame tests/fuzz/corpus/transport_frame
	cmake --build --preset fuzz -j $(JOBS) --target rpc_envelope_fuzz
	mkdir -p build/fuzz/corpus/rpc_envelope
	build/fuzz/tests/fuzz/rpc_envelope_fuzz -runs=$(FUZZ_RUNS) -max_len=1024 \
	    build/fuzz/corpus/rpc_envelope tests/fuzz/corpus/rpc_envelope
	cmake --build --preset fuzz -j $(JOBS) --target rpc_codec_fuzz
	mkdir -p build/fuzz/corpus/rpc_codec
	build/fuzz/tests/fuzz/rpc_codec_fuzz -runs=$(FUZZ_RUNS) -max_len=1024 \
	    build/fuzz/corpus/rpc_codec tests/fuzz/corpus/rpc_codec

test: build test-asan test-tsan test-fuzz
	ctest --preset dev -j $(JOBS)

# The parameter-server job (docs/examples.md): one server, two trainers.
run: build
	build/dev/examples/trellis-launch --nproc 3 -- build/dev/examples/parameter_server

clean:
	rm -rf build
