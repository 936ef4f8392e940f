#pragma once

// Internal: the pipe handshake and the same-host upgrade decision as a pure
// state machine (docs/transport.md, "Handshake messages", "Sequence",
// "Negotiation", "Same-host upgrade"). Not installed.
//
// Contract
//  - Bytes in, bytes out: feed() takes what arrived on the pipe's first
//    connection; takeOutgoing() returns the messages to send on it, in
//    order, and must be drained (and sent) after every call, before acting
//    on state(). No loop, socket, timer, clock or log: the pipe does the
//    I/O, bounds the waits and makes the upgrade's shm connection, and
//    reports what happened (upgradeConnected(), upgradeFailed(), bind(),
//    stay()).
//  - Ends in kEstablished (negotiated(): what both sides use) or kFailed
//    (error(): DATA_LOSS for bad bytes, UNAUTHENTICATED for a token that is
//    wrong or configured on one side only, FAILED_PRECONDITION when no
//    transport/channel is common). Both are final; feed() then consumes
//    nothing, so bytes after the handshake stay with the caller.
//  - Untrusted input: a header is checked as soon as its 9 bytes are there,
//    before its body is waited for; bodies are decoded by wire_format.
//  - Not thread-safe: one owner (the pipe, on its loop).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport {

struct Negotiated {
  std::string transport;
  std::string channel;      // CPU tensors
  std::string cudaChannel;  // CUDA tensors; empty: none
};

// What this side can use, as negotiation sees it.
struct Offer {
  std::string name;
  bool sameHostOnly = false;
  // Channels only: the pipe can drive it (inline, or out of band like cma).
  bool inlineChannel = true;
  // Channels only: the device types it carries (supportsDevice) and whether
  // it carries them out of band.
  bool cpu = true;
  bool cuda = false;
  bool outOfBand = false;
};

// Picks the highest-priority transport and channels in `local` (in priority
// order) that the peer also offers; same-host-only ones only when
// `sameHost`. One channel per device type: for CPU tensors a channel the
// pipe can drive (required); for CUDA tensors an out-of-band channel that
// carries them (optional: none leaves CUDA writes failing with
// InvalidArgument). The transport must be `bootstrap` (the one the
// handshake runs on): switching transports after the handshake comes with
// shm.
Error negotiate(const std::vector<Offer>& localTransports,
                const std::vector<Offer>& localChannels,
                const wire_format::Hello& remote, bool sameHost,
                const std::string& bootstrap, Negotiated* out);

struct HandshakeOptions {
  bool connector = false;
  // This side's hello (its nonce is filled in here).
  wire_format::Hello local;
  std::optional<auth::JobToken> token;
  // What this side may use, in priority order.
  std::vector<Offer> transports;
  std::vector<Offer> channels;
  // The transport the handshake runs on (the address's scheme).
  std::string bootstrap;
  // Acceptor: the listener's shm:// address for the same-host upgrade;
  // empty: never offered.
  std::string upgradeAddress;
  // For errors: the pipe's id and the peer's address.
  std::string id;
  std::string peer;
  // Fresh random nonces and upgrade tokens; auth::randomNonce when unset.
  std::function<auth::Nonce()> nonce;
};

class Handshake final {
 public:
  enum class State {
    kAwaitHello,       // acceptor
    kAwaitHelloReply,  // connector
    kAwaitAuth,        // acceptor
    kAwaitAccept,      // connector
    // Acceptor: the accept offered the upgrade (upgradeToken()); ends with
    // bind(), stay() or the connector's "upgrade failed".
    kAwaitBind,
    // Connector: the accept offered the upgrade; the acceptor's decision
    // ends it. Meanwhile the pipe connects to upgradeTarget() (when not
    // empty) and reports upgradeConnected() or upgradeFailed().
    kAwaitDecision,
    kEstablished,
    kFailed,
  };

  // A connector's hello is queued at once.
  explicit Handshake(HandshakeOptions options);

  State state() const { return state_; }
  bool done() const {
    return state_ == State::kEstablished || state_ == State::kFailed;
  }
  // Consumes at most one whole message from the front of `in` and returns
  // its length; 0 when `in` does not hold one yet (wanted() then says how
  // many bytes it needs), after a failure, or once done().
  size_t feed(std::span<const uint8_t> in);
  size_t wanted() const { return wanted_; }
  std::vector<std::vector<uint8_t>> takeOutgoing();

  const Error& error() const { return error_; }  // kFailed
  // kEstablished. transport is "shm" when switched() to the upgrade.
  const Negotiated& negotiated() const { return negotiated_; }
  bool switched() const { return switched_; }
  // The peer's hello (host id, pid), once received.
  const wire_format::Hello& remote() const { return remote_; }

  // The upgrade's secret, once offered (acceptor) or received (connector).
  const std::optional<auth::Nonce>& upgradeToken() const {
    return upgradeToken_;
  }
  // Connector, kAwaitDecision: the shm:// address to connect to; empty
  // when this side cannot upgrade (upgradeRefusal() says why; the "upgrade
  // failed" message is already queued).
  const std::string& upgradeTarget() const { return upgradeTarget_; }
  const std::string& upgradeRefusal() const { return upgradeRefusal_; }
  // Connector, kAwaitDecision: the shm connection is up; returns the bind
  // message to send on it.
  std::vector<uint8_t> upgradeConnected();
  // Connector, kAwaitDecision: connecting failed; queues "upgrade failed".
  void upgradeFailed(const std::string& why);

  // Acceptor: a connection to the upgrade address presented `bind`
  // (`bindPeer` names it in errors). True when the pipe switches to it (the
  // "switch" decision is queued for the first connection and the machine is
  // established); false when it stays (no longer kAwaitBind, or the bind
  // is refused: wrong token or proof, or `bootstrapBytesPending`, bytes the
  // connector sent on the first connection after the accept).
  [[nodiscard]] bool bind(const wire_format::BindMessage& bind,
                          const std::string& bindPeer,
                          bool bootstrapBytesPending);
  // Acceptor, kAwaitBind: stay on the first connection (queues the "stay"
  // decision); `why` is kept in stayReason().
  void stay(const std::string& why);
  // Why an acceptor that offered the upgrade stayed; empty otherwise.
  const std::string& stayReason() const { return stayReason_; }

 private:
  wire_format::HandshakeType expected() const;
  void onHello(std::span<const uint8_t> body);
  void onHelloReply(std::span<const uint8_t> body);
  void onAuth(std::span<const uint8_t> body);
  void onAccept(std::span<const uint8_t> body);
  void onUpgradeFailed(std::span<const uint8_t> body);
  void onDecision(std::span<const uint8_t> body, size_t after);
  Error tokenConfigMismatch() const;
  void send(std::vector<uint8_t> bytes);
  void establish(const Negotiated& n);
  void fail(const Error& error);

  HandshakeOptions o_;
  std::string who_;  // "ctx.pipe3 (peer uv://...)"
  bool shmHere_ = false;
  State state_;
  size_t wanted_ = wire_format::kHandshakeHeaderBytes;
  std::vector<std::vector<uint8_t>> outgoing_;
  Error error_;
  Negotiated negotiated_;
  bool switched_ = false;
  wire_format::Hello remote_;
  auth::Nonce myNonce_{};
  auth::Nonce peerNonce_{};
  std::optional<auth::Nonce> upgradeToken_;
  std::string upgradeTarget_;
  std::string upgradeRefusal_;
  bool bound_ = false;
  std::string stayReason_;
};

}  // namespace trellis::transport
