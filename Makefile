# The two commands (README): `make test` sets everything up and runs every
# test; `make run` runs the main job. Both install dependencies first.
JOBS ?= $(shell nproc)
FUZZ_RUNS ?= 200000
# Lets ccache share results between clones in different folders (CI).
export CCACHE_BASEDIR ?= $(CURDIR)

.PHONY: deps build test test-dev test-asan test-fuzz run clean

deps:
	bash deploy/install-deps.sh

build: deps
	cmake --preset dev
	cmake --build --preset dev -j $(JOBS)

test-dev: build
	ctest --preset dev -j $(JOBS)

# Sanitizer pass over the components whose tests are labelled 'sanitize'.
test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS) --target core_test wire_fuzz_replay
	ctest --preset asan -j $(JOBS) -L 'core|fuzz'

# libFuzzer targets, a bounded number of iterations each.
test-fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS) --target wire_fuzz
	mkdir -p build/fuzz/corpus/wire
	build/fuzz/tests/fuzz/wire_fuzz -runs=$(FUZZ_RUNS) -max_len=512 \
	    build/fuzz/corpus/wire tests/fuzz/corpus/wire

test: build test-asan test-fuzz
	ctest --preset dev -j $(JOBS)

run: build
	@echo "The main job (a parameter-server training run) arrives with the RPC layer (issue 5)." >&2
	@exit 2

clean:
	rm -rf build
