# Every dependency comes from Debian 12 packages (deploy/install-deps.sh).
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
if(TRELLIS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# libtorch (rpc/ and above). Debian's libtorch-dev ships TorchConfig.cmake;
# a libtorch 2.x tree works the same way via CMAKE_PREFIX_PATH / Torch_DIR.
find_package(Torch REQUIRED)
# Protobuf for the RPC envelopes (generated code stays out of installed headers).
find_package(Protobuf REQUIRED)
find_package(nlohmann_json REQUIRED)
