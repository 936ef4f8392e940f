#pragma once

// Context: owns one event-loop thread and the transports and channels that
// pipes use (docs/transport.md).
//
// Contract
//  - Transports (byte streams: uv, shm) and channels (how tensor bytes
//    move: basic, cma) are registered with a priority; the handshake picks
//    the highest-priority pair that both ends support and that is viable
//    between them (same-host-only ones only on one host). create()
//    registers the built-in ones: transports uv (100) and shm (200),
//    channels basic (100) and cma (150).
//  - The choice is restricted by ContextOptions::transports / channels and by
//    the environment variables TRELLIS_TRANSPORTS / TRELLIS_CHANNELS (comma
//    lists). An unknown name is an InvalidArgumentError naming the variable
//    (or option) and the entry.
//  - Limits bound everything a peer can make this process allocate; every
//    length on the wire is checked against them before allocating.
//  - Thread safety: every method may be called from any thread. All pipe and
//    listener state lives on the loop thread; callbacks run there.
//  - close() fails every pipe and listener operation with CANCELLED and
//    stops the loop; it is asynchronous and idempotent. join() waits for the
//    loop thread, at most `timeout` (0 = no limit), and returns false if it
//    is still running then. The destructor closes and joins.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

namespace trellis::transport {

class Transport;  // transport/transport.h (not installed)
class Channel;    // transport/channel.h (not installed)
class ContextImpl;

struct Limits {
  size_t maxDescriptorBytes = 64u << 20;
  size_t maxPayloadBytes = size_t{16} << 30;
  size_t maxTensorBytes = size_t{16} << 30;
  size_t maxPayloadsPerMessage = 4096;
  size_t maxTensorsPerMessage = 4096;
  // Queued operations per pipe (writes + readDescriptors + reads), and
  // connections waiting for accept() per listener.
  size_t maxPendingOperations = 65536;
};

struct ContextOptions {
  // Prefix of every pipe/listener id in logs and errors.
  std::string name = "ctx";
  // When set, peers must prove knowledge of the same token (mutual HMAC)
  // before any message is read. When unset, TRELLIS_JOB_TOKEN is used if
  // set. A peer with a token meeting one without fails with AuthError.
  std::optional<auth::JobToken> token;
  bool tokenFromEnvironment = true;
  // Allowed transport / channel names; empty = all registered.
  std::vector<std::string> transports;
  std::vector<std::string> channels;
  Limits limits;
  // Bound on connect + handshake; 0 = none.
  Duration handshakeTimeout = std::chrono::seconds(30);
};

class Context final {
 public:
  // Throws InvalidArgumentError for a bad option or environment variable.
  static std::shared_ptr<Context> create(ContextOptions options = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Only before the first listen()/connect(); else FailedPreconditionError.
  // Higher priority wins.
  void registerTransport(int priority, std::shared_ptr<Transport> transport);
  void registerChannel(int priority, std::shared_ptr<Channel> channel);

  // Listens on each address ("uv://127.0.0.1:0", "uv://[::1]:0"), one per
  // transport. Synchronous: throws InvalidArgumentError for a malformed
  // address or unknown transport, AlreadyExistsError for an address in use,
  // another typed error (Error::fromErrno) if binding fails otherwise.
  std::shared_ptr<Listener> listen(const std::vector<std::string>& addresses);

  // Returns at once; the connection and handshake proceed in the background
  // and a failure fails the pipe's operations (see pipe.h).
  std::shared_ptr<Pipe> connect(const std::string& address);

  void close();
  // Waits for the loop thread to exit; false when `timeout` passed first,
  // or when called on the loop thread itself (which cannot join itself).
  bool join(Duration timeout = Duration::zero());
  // True on this context's loop thread (callbacks of its pipes and
  // listeners run there).
  bool inLoop() const;

  // A hint that work will reach this context from another thread within
  // microseconds, such as a reply a worker thread is computing: until the
  // matching endExpectedWork(), the context's loop polls briefly
  // (TRELLIS_SPIN_US, default 50 µs, after each piece of work) instead of
  // sleeping, which saves a thread wake-up per hand-off. Balanced calls;
  // thread-safe; never needed for correctness.
  void beginExpectedWork();
  void endExpectedWork();

  const std::string& name() const;
  // Transports / channels usable after the option and environment filters,
  // highest priority first.
  std::vector<std::string> transportNames() const;
  std::vector<std::string> channelNames() const;

 private:
  explicit Context(std::shared_ptr<ContextImpl> impl);
  std::shared_ptr<ContextImpl> impl_;
};

// Parses a comma list of names from `variable` against `known`; unknown
// entries throw InvalidArgumentError naming the variable and the entry.
// nullopt when the variable is unset or empty.
std::optional<std::vector<std::string>> parseNameList(
    const std::string& variable, const std::string& value,
    const std::vector<std::string>& known);

}  // namespace trellis::transport
