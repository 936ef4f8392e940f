# Every dependency comes from Debian 12 packages (deploy/install-deps.sh).
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
if(TRELLIS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# Protobuf for the RPC envelopes (generated code stays out of installed
# headers). Found before libtorch: a PyTorch wheel's Caffe2Config makes a
# protobuf::libprotobuf of its own where none exists yet, and with it the
# RPC targets linked no protobuf at all.
find_package(Protobuf REQUIRED)
# A PyTorch wheel's include folder carries protobuf headers of its own (an
# older version): ahead of it, every target sees the headers of the
# protobuf it links. A no-op where they live in /usr/include.
include_directories(BEFORE SYSTEM ${Protobuf_INCLUDE_DIRS})
# libtorch (rpc/ and above). Debian's libtorch-dev ships TorchConfig.cmake;
# a libtorch 2.x tree works the same way via CMAKE_PREFIX_PATH / Torch_DIR.
find_package(Torch REQUIRED)
find_package(nlohmann_json REQUIRED)
