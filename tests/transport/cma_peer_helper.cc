// A separate process for the cma tests (tests/transport/cma_test.cc).
//
//   cma_peer_helper send ADDRESS BYTES   connect with the default transports
//                                        and channels, write "hello", print
//                                        "ready TRANSPORT CHANNEL", write one
//                                        CPU tensor of BYTES bytes (pattern
//                                        seed 7), print "written ok" or
//                                        "written error: ..." once its
//                                        callback fires, and exit 0.
//   cma_peer_helper hold ADDRESS BYTES   the same, but after the write print
//                                        "sent" and wait (the test kills
//                                        this process before reading).
// Exit status 0 = as expected; anything else is printed on stderr.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport_test_util.h"
#include <trellis/core/future.h>
#include <trellis/transport/context.h>

using namespace trellis;
using namespace trellis::transport;
using trellis::transport::testing::fillPattern;
using trellis::transport::testing::writeAsync;

namespace {

int sendMode(const std::string& address, size_t bytes, bool hold) {
  ContextOptions o;
  o.name = "helper";
  o.tokenFromEnvironment = false;
  auto ctx = Context::create(o);
  auto pipe = ctx->connect(address);
  Message hello;
  hello.descriptor = "hello";
  writeAsync(*pipe, hello).wait(std::chrono::seconds(30));
  std::printf("ready %s %s\n", pipe->transportName().c_str(),
              pipe->channelName().c_str());
  std::fflush(stdout);
  std::vector<uint8_t> big(bytes);
  fillPattern(big.data(), big.size(), 7);
  Message m;
  m.descriptor = "big";
  m.tensors.push_back({big.data(), big.size(), Device{}});
  auto w = writeAsync(*pipe, m);
  if (hold) {
    std::printf("sent\n");
    std::fflush(stdout);
    // Bounded: the test kills us long before; the outcome is not ours to
    // see.
    (void)w.waitFor(std::chrono::seconds(60));
    return 3;
  }
  if (!w.waitFor(std::chrono::seconds(60))) {
    std::fprintf(stderr, "write callback did not fire within 60 s\n");
    return 1;
  }
  if (w.error().ok()) {
    std::printf("written ok\n");
  } else {
    std::printf("written error: %s\n", w.error().what().c_str());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 4 && (std::strcmp(argv[1], "send") == 0 ||
                      std::strcmp(argv[1], "hold") == 0)) {
      return sendMode(argv[2], std::strtoull(argv[3], nullptr, 10),
                      std::strcmp(argv[1], "hold") == 0);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "helper: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s send|hold ADDRESS BYTES\n", argv[0]);
  return 2;
}
