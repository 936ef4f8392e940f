#pragma once

// TCPStore: a Store served over TCP by a TCPStoreServer (docs/store.md).
//
// The server runs one Boost.Asio io_context thread with a coroutine per
// connection, so thousands of idle or waiting clients cost no thread each.
// It can be embedded in any process (TCPStoreServer) or run as the
// `trellis-store` binary. Blocking requests (get, wait, multiGet) are
// answered by the server as soon as the keys exist or their timeout passes;
// the client never polls.
//
// Client: one connection per TCPStore object, one request in flight at a
// time (a mutex serialises callers, so a blocked get holds back the other
// threads using the same object; give each thread its own TCPStore for
// concurrency). Connecting retries with jittered exponential backoff until
// the connect timeout, so clients may start before the server.
//
// Errors: a lost server (EOF, reset) is a ConnectionError, promptly, for the
// call in flight and every later call on that object (sticky: the object
// never reconnects once it has lost its connection). A request that breaks a
// limit is an InvalidArgumentError before anything is sent. Job-token
// problems are AuthError. A server that stops answering is a TimeoutError at
// the call's deadline and leaves the object broken (ConnectionError after).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <trellis/core/auth.h>
#include <trellis/store/store.h>

namespace trellis::store {

// Sizes the server and the client enforce; they should agree.
struct Limits {
  size_t maxKeyBytes = 4096;
  size_t maxValueBytes = 64u << 20;  // 64 MiB
  size_t maxKeysPerOp = 65536;
  // A whole request or response frame (payload bytes).
  size_t maxFrameBytes = (128u << 20) + (1u << 20);
};

struct TCPStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;
  // Default timeout of the store (see Store): blocking calls wait this long
  // and every other request must complete within it. 0 = none.
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  // How long the constructor keeps retrying to connect; 0 = use `timeout`.
  std::chrono::milliseconds connectTimeout{0};
  // Proves knowledge of the job token when the server requires one. When
  // unset the client uses none (TCPStoreOptions never reads the environment;
  // use auth::JobToken::fromEnvironment() for that).
  std::optional<auth::JobToken> jobToken;
  Limits limits;
};

class TCPStore final : public Store {
 public:
  // Connects (with retries) and authenticates. Throws ConnectionError when
  // no connection could be made within the connect timeout, AuthError on a
  // token mismatch, ProtocolError when the peer is not a Trellis store of a
  // supported version.
  explicit TCPStore(TCPStoreOptions options);
  ~TCPStore() override;

  const std::string& host() const;
  uint16_t port() const;
  // A short id for logs ("store3").
  const std::string& id() const;

  using Store::compareSet;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, std::span<const uint8_t> value) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, std::span<const uint8_t> expected,
                   std::span<const uint8_t> desired) override;
  [[nodiscard]] bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<Bytes>& values) override;
  // A round trip that touches no key.
  void ping();
  // A new connection to the same server with the same token; `timeout`
  // bounds connecting and every request.
  std::unique_ptr<Store> clone(std::chrono::milliseconds timeout) override;

 protected:
  Bytes getWithTimeout(const std::string& key,
                       std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TCPStoreServerOptions {
  // The address to listen on: "127.0.0.1", "::1", "0.0.0.0", "::" or a name.
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 = any free port; read it back with port()
  // When set, every connection must prove knowledge of it before any
  // request is read.
  std::optional<auth::JobToken> jobToken;
  Limits limits;
  // A connection must finish hello and authentication within this.
  std::chrono::milliseconds handshakeTimeout{10'000};
};

class TCPStoreServer {
 public:
  // Binds and starts serving on its own thread. Throws ConnectionError when
  // the address cannot be bound (message names it and errno's text).
  explicit TCPStoreServer(TCPStoreServerOptions options = {});
  // stop()s.
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;

  // The bound port (the real one when asked for port 0).
  uint16_t port() const;
  const std::string& host() const;
  // Closes the listener and every connection (clients see ConnectionError),
  // then joins the server thread. Idempotent; any thread but the server's.
  void stop();
  // Connections currently open (for tests and monitoring).
  size_t numConnections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trellis::store
