// A separate process for the shm tests (tests/transport/shm_test.cc).
//
//   shm_peer_helper connect ADDRESS   connect over shm, write "hello", print
//                                     "ready", then write a 64 MiB message
//                                     that nobody reads, and wait (the test
//                                     kills this process).
//   shm_peer_helper probe             with files unable to grow (RLIMIT_FSIZE
//                                     0), shm must report itself not viable
//                                     and a context must fall back to uv.
// Exit status 0 = as expected; anything else is printed on stderr.

#include <cstdio>
#include <cstring>
#include <signal.h>
#include <string>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "transport_test_util.h"
#include <trellis/core/future.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/context.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/transport.h>

using namespace trellis;
using namespace trellis::transport;
using trellis::transport::testing::writeAsync;

namespace {

int connectMode(const std::string& address) {
  ContextOptions o;
  o.name = "helper";
  o.transports = {"shm"};
  o.tokenFromEnvironment = false;
  auto ctx = Context::create(o);
  auto pipe = ctx->connect(address);
  Message hello;
  hello.descriptor = "hello";
  writeAsync(*pipe, hello).wait(std::chrono::seconds(30));
  std::printf("ready %s\n", pipe->transportName().c_str());
  std::fflush(stdout);
  std::vector<uint8_t> big(size_t{64} << 20, 0x5a);
  Message m;
  m.descriptor = "big";
  m.payloads.push_back({big.data(), big.size()});
  auto w = writeAsync(*pipe, m);
  // Bounded: the test kills us long before; the outcome is not ours to see.
  (void)w.waitFor(std::chrono::seconds(60));
  return 3;
}

int probeMode() {
  // No file may grow, memfds included: the probe's ftruncate fails with
  // EFBIG (SIGXFSZ ignored so the call returns instead of killing us). Only
  // shm is affected; descriptors, memory and sockets stay available, which
  // the sanitizer runtimes need.
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  rlimit low = old;
  low.rlim_cur = 0;
  if (::setrlimit(RLIMIT_FSIZE, &low) != 0) {
    std::perror("setrlimit");
    return 2;
  }
  auto starved = shm::create();
  const Error e = starved->viable();
  if (e.ok() || e.message().find("ftruncate") == std::string::npos) {
    std::fprintf(stderr, "expected an ftruncate failure, got '%s'\n",
                 e.what().c_str());
    return 1;
  }
  std::printf("not viable: %s\n", e.what().c_str());
  // A context whose shm cannot work offers uv only, and says why shm
  // addresses are refused instead of crashing.
  ContextOptions o;
  o.name = "probe";
  o.tokenFromEnvironment = false;
  auto ctx = Context::create(o);
  ctx->registerTransport(200, starved);
  for (const auto& n : ctx->transportNames()) {
    if (n == "shm") {
      std::fprintf(stderr, "shm still offered\n");
      return 1;
    }
  }
  try {
    ctx->listen({"shm://"});
    std::fprintf(stderr, "listen on shm:// succeeded\n");
    return 1;
  } catch (const InvalidArgumentError&) {
  }
  auto server = Context::create(o);
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto pipe = ctx->connect(l->address("uv"));
  Message m;
  m.descriptor = "x";
  writeAsync(*pipe, m).wait(std::chrono::seconds(30));
  if (pipe->transportName() != "uv") {
    std::fprintf(stderr, "fell back to '%s'\n", pipe->transportName().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::strcmp(argv[1], "connect") == 0) {
      return connectMode(argv[2]);
    }
    if (argc == 2 && std::strcmp(argv[1], "probe") == 0) {
      return probeMode();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "helper: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s connect ADDRESS | probe\n", argv[0]);
  return 2;
}
