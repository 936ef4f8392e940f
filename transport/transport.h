#pragma once

// Internal: the interface of a transport, which makes byte-stream
// Connections (connection.h) on a Context's Loop: uv (TCP), shm (shared
// memory rings). Not installed. A transport is registered with
// Context::registerTransport and joins the contract suite with one line in
// tests/transport/contract_test.cc (docs/transport.md, "Extending").
//
// Contract
//  - name(), viable() and sameHostOnly() may be called from any thread;
//    listen() and connect() on the loop thread only.
//  - Callbacks run on the loop thread; a connect callback fires exactly
//    once, never inline from connect().

#include <functional>
#include <memory>
#include <string>

#include <trellis/core/error.h>
#include <trellis/transport/connection.h>
#include <trellis/transport/loop.h>

namespace trellis::transport {

class ConnectionListener {
 public:
  virtual ~ConnectionListener() = default;
  // The real bound address, with the transport's scheme.
  virtual std::string address() const = 0;
  virtual void close() = 0;  // idempotent
};

class Transport {
 public:
  using AcceptCallback =
      std::function<void(const Error&, std::shared_ptr<Connection>)>;
  using ConnectCallback =
      std::function<void(const Error&, std::shared_ptr<Connection>)>;

  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // OK when this transport can work in this process (e.g. shm: /dev/shm).
  virtual Error viable() const = 0;
  // Only between processes sharing a host (and IPC namespace).
  virtual bool sameHostOnly() const = 0;

  // Loop thread. `cb` fires for every accepted connection, or once with an
  // error if accepting fails for good.
  virtual Error listen(Loop& loop, const std::string& address,
                       AcceptCallback cb,
                       std::unique_ptr<ConnectionListener>* out) = 0;
  // Loop thread. `cb` fires once, later.
  virtual void connect(Loop& loop, const std::string& address,
                       ConnectCallback cb) = 0;
};

}  // namespace trellis::transport
