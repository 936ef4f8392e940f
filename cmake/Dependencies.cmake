# Every dependency comes from Debian 12 packages (deploy/install-deps.sh).
find_package(Threads REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(spdlog REQUIRED)
find_package(fmt REQUIRED)
if(TRELLIS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
