#pragma once

#include <optional>

// Helpers shared by the transport tests: pipe pairs over any transport,
// synchronous wrappers with deadlines, a callback checker, and a raw TCP
// client that speaks the wire format byte by byte.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/core/future.h>
#include <trellis/transport/context.h>

namespace trellis::transport::testing {

constexpr auto kWait = std::chrono::seconds(60);

// Calls `done` every 2 ms until it returns true (then true) or `timeout`
// has passed (then false): for states a test can only poll for.
bool eventually(const std::function<bool()>& done,
                std::chrono::milliseconds timeout = kWait);

// What a contract instance needs to know about its backend: adding a
// transport or channel to the suite is one INSTANTIATE line with one of these.
struct Backend {
  std::string name;                   // test-name suffix
  std::string transport;              // "uv"
  std::string listenAddr;             // "uv://127.0.0.1:0"
  std::vector<std::string> channels;  // restricts ContextOptions::channels
  std::string expectChannel;
  // When set, both contexts register cma with this threshold (0: every
  // non-empty CPU tensor goes by process_vm_readv, even between two contexts
  // of one process).
  std::optional<size_t> cmaThreshold;
};

std::string backendName(const ::testing::TestParamInfo<Backend>& info);
inline void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

struct PipePair {
  std::shared_ptr<Context> server;
  std::shared_ptr<Context> client;
  std::shared_ptr<Listener> listener;
  std::shared_ptr<Pipe> clientPipe;
  std::shared_ptr<Pipe> serverPipe;
};

ContextOptions optionsFor(const Backend& b, std::string name);
PipePair makePair(const Backend& b, ContextOptions serverOpts,
                  ContextOptions clientOpts);
// Two contexts of this process joined by an shm pipe (no upgrade) whose
// rings hold `ringBytes`, polling for `spin` (unset: the default).
PipePair shmPair(size_t ringBytes,
                 std::optional<std::chrono::microseconds> spin = std::nullopt);
std::shared_ptr<Pipe> acceptOne(Listener& l);

struct Received {
  std::string descriptor;
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<std::vector<uint8_t>> tensors;
};

Future<void> writeAsync(Pipe& pipe, Message m);
Future<Received> readAsync(const std::shared_ptr<Pipe>& pipe);

// A message whose payload/tensor bytes are a pattern derived from `seed`;
// the vectors own the bytes and must outlive the write.
struct OwnedMessage {
  std::string descriptor;
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<std::vector<uint8_t>> tensors;
  Message view() const;
};
OwnedMessage patterned(const std::string& descriptor,
                       const std::vector<size_t>& payloadSizes,
                       const std::vector<size_t>& tensorSizes, uint32_t seed);
void fillPattern(uint8_t* p, size_t n, uint32_t seed);
bool checkPattern(const uint8_t* p, size_t n, uint32_t seed);

// Marks the current thread as "inside a public call" for OnceChecker.
struct InCall {
  InCall();
  ~InCall();
};

// Counts callback invocations: each wrapped callback must fire exactly once
// and never while the calling thread is inside an InCall scope.
class OnceChecker {
 public:
  template <typename F>
  auto wrap(F f) {
    created_.fetch_add(1);
    auto count = std::make_shared<std::atomic<int>>(0);
    return [this, count, f = std::move(f)](auto&&... args) mutable {
      if (count->fetch_add(1) != 0) {
        doubled_.fetch_add(1);
      }
      if (inCall()) {
        inlined_.fetch_add(1);
      }
      f(std::forward<decltype(args)>(args)...);
      fired_.fetch_add(1);
    };
  }
  bool waitAll(std::chrono::milliseconds timeout) const;
  int created() const { return created_.load(); }
  int fired() const { return fired_.load(); }
  int doubled() const { return doubled_.load(); }
  int inlined() const { return inlined_.load(); }
  static bool inCall();

 private:
  std::atomic<int> created_{0};
  std::atomic<int> fired_{0};
  std::atomic<int> doubled_{0};
  std::atomic<int> inlined_{0};
};

// ---- raw TCP peer ------------------------------------------------------
// Blocking socket helpers with bounded waits, for hostile-peer tests.
int rawConnect(const std::string& uvAddress);
void rawSend(int fd, const std::vector<uint8_t>& bytes);
// Reads exactly n bytes within `timeout`; false on EOF/timeout.
bool rawRecv(int fd, size_t n, std::vector<uint8_t>* out,
             std::chrono::milliseconds timeout = std::chrono::seconds(10));
// Runs the connector side of the handshake without a token; returns false
// if the acceptor does not accept.
bool rawHandshake(int fd);
// The same, offering `channels` and, when `sameHost`, this host's id and
// pid; `chosen` receives the channel the acceptor picked.
bool rawHandshake(int fd, const std::vector<std::string>& channels,
                  bool sameHost, std::string* chosen);
// Frame head (header + layout) for a message with the given sizes.
std::vector<uint8_t> rawFrameHead(size_t descriptorLen,
                                  const std::vector<size_t>& payloads);
// True once the peer has closed `fd` (EOF or reset) within `timeout`.
bool rawPeerClosed(int fd, std::chrono::milliseconds timeout);

// User plus system CPU time of this process so far, in seconds: for tests
// that check an idle process burns no CPU.
double processCpuSeconds();

}  // namespace trellis::transport::testing
