#!/usr/bin/env bash
# The README's entry point on a fresh Debian 12 machine: installs every
# dependency (make included), then runs the Makefile target given:
#   ./dev.sh test   configure, build and run the whole test suite
#   ./dev.sh run    build and run the main job
#   ./dev.sh tsa    clang thread-safety analysis build (also part of test)
set -euo pipefail
cd "$(dirname "$0")"
bash deploy/install-deps.sh
exec make "${@:-test}"
