// trellis-store: runs a TCPStoreServer until SIGTERM or SIGINT.
// Prints the bound port as the first line on stdout (docs/store.md).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <pthread.h>
#include <string>

#include <CLI/CLI.hpp>

#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/store/tcp_store.h>

int main(int argc, char** argv) {
  using namespace trellis;
  CLI::App app{"trellis-store: a Trellis TCPStore server"};
  std::string host = "0.0.0.0";
  uint16_t port = 29500;
  std::string tokenEnv = auth::kTokenEnvVar;
  size_t maxValueBytes = store::Limits{}.maxValueBytes;
  app.add_option("--host", host, "address to listen on")->capture_default_str();
  app.add_option("--port", port, "port to listen on; 0 picks a free one")
      ->capture_default_str();
  app.add_option("--job-token-env", tokenEnv,
                 "environment variable holding the job token; when it is "
                 "set, every client must prove it knows the token")
      ->capture_default_str();
  app.add_option("--max-value-bytes", maxValueBytes, "largest value accepted")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 30));
  CLI11_PARSE(app, argc, argv);

  // Block the stop signals in every thread; main waits for them below.
  sigset_t stopSignals;
  sigemptyset(&stopSignals);
  sigaddset(&stopSignals, SIGTERM);
  sigaddset(&stopSignals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stopSignals, nullptr);

  store::TCPStoreServerOptions opts;
  opts.host = host;
  opts.port = port;
  opts.limits.maxValueBytes = maxValueBytes;
  opts.limits.maxFrameBytes =
      std::max(opts.limits.maxFrameBytes, 2 * maxValueBytes + (1u << 20));
  const char* secret = std::getenv(tokenEnv.c_str());
  if (secret != nullptr && *secret != '\0') {
    try {
      opts.jobToken = auth::JobToken::fromString(secret);
    } catch (const Exception& e) {
      std::fprintf(stderr, "trellis-store: %s: %s\n", tokenEnv.c_str(),
                   e.error().message().c_str());
      return 2;
    }
  } else {
    std::fprintf(stderr,
                 "trellis-store: warning: %s is not set; any client that "
                 "can reach the port may use the store\n",
                 tokenEnv.c_str());
  }

  try {
    store::TCPStoreServer server(std::move(opts));
    std::printf("%u\n", static_cast<unsigned>(server.port()));
    std::fflush(stdout);
    int sig = 0;
    sigwait(&stopSignals, &sig);
    std::fprintf(stderr, "trellis-store: %s, stopping\n",
                 sig == SIGTERM ? "SIGTERM" : "SIGINT");
    server.stop();
  } catch (const Exception& e) {
    std::fprintf(stderr, "trellis-store: %s\n", e.what());
    return 1;
  }
  return 0;
}
