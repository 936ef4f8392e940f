#pragma once

// Listener: accepts pipes on one address per transport.
//
// Contract
//  - accept(cb) arms one acceptance: cb fires exactly once, with the next
//    incoming pipe or with the listener's error (CANCELLED after close()).
//    Pending accept() calls are served in order. An incoming connection that
//    arrives while no accept() is pending waits (up to the context's
//    maxPendingOperations) and is handed to the next accept().
//  - The pipe is handed over before its handshake finishes; a handshake that
//    fails (bad magic, wrong version, wrong token, timeout) fails that pipe's
//    operations with ProtocolError / AuthError / TimeoutError. The listener
//    keeps serving.
//  - Callbacks run on the context's loop thread, never inline, never under a
//    lock. Every method is thread-safe. close() is async and idempotent;
//    destroying the last shared_ptr closes it.

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <trellis/core/error.h>
#include <trellis/transport/pipe.h>

namespace trellis::transport {

class Context;
class ListenerImpl;

// Made only by Context::listen().
class Listener final {
 public:
  using AcceptCallback =
      std::function<void(const Error&, std::shared_ptr<Pipe>)>;

  // Only Context can make a Passkey, so only it can construct a Listener
  // (through std::make_shared, which needs a public constructor).
  class Passkey {
    Passkey() = default;
    friend class Context;
  };
  Listener(Passkey, std::shared_ptr<ListenerImpl> impl);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  void accept(AcceptCallback cb);
  void close();

  // Transport name -> real bound address ("uv" -> "uv://127.0.0.1:40211").
  const std::map<std::string, std::string>& addresses() const;
  // The bound address of one transport; throws NotFoundError if absent.
  const std::string& address(const std::string& transport) const;

 private:
  std::shared_ptr<ListenerImpl> impl_;
};

}  // namespace trellis::transport
