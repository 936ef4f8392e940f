#pragma once

// Pipe: an ordered, bidirectional message stream between two Contexts.
//
// Contract
//  - Thread safety: every method may be called from any thread, including
//    from inside a callback of this or another pipe.
//  - Ordering: messages arrive in the order write() (or a tryWriteNow()
//    that returned true) was called; callbacks of each kind fire in the
//    order of their calls.
//  - Callbacks: each fires exactly once, on the context's loop thread, never
//    inline from the call that queued it and never under a Trellis lock. A
//    callback must not block: it holds up every pipe of the context.
//  - Reading is two-step: readDescriptor(cb) delivers the next message's
//    Descriptor; then read(allocation, cb) receives its payloads and tensors
//    straight into the caller's buffers (no intermediate copy for large
//    ones). Exactly one read() must follow each delivered descriptor. An
//    allocation that does not match the descriptor (count or length), or a
//    read() with no descriptor waiting, fails that read() with
//    InvalidArgument; the pipe stays usable and a correct read() may follow.
//  - Ownership: write() borrows every payload/tensor buffer until its
//    callback fires; read() borrows the allocation until its callback fires.
//    On a cma pipe a large CPU tensor is copied by the reader straight from
//    the writer's buffer, so that write's callback fires only once the peer
//    has read the message (or the pipe fails); a failed copy fails that
//    read and that write with the reader's error, and the pipe goes on.
//  - Transport: between processes of one host a pipe connected over uv
//    moves to shm during the handshake when both sides allow it;
//    transportName() reports where it ended up (docs/transport.md).
//  - Errors are sticky: the first connection, protocol (DATA_LOSS), auth
//    (UNAUTHENTICATED) or timeout error fails every pending and later
//    operation with the same Error. A peer that closes or dies fails them
//    with UNAVAILABLE (ConnectionError): writes at once, reads only once
//    every message received before the end of the stream has been read
//    (readDescriptor/read keep serving those in order). close() fails them
//    with CANCELLED.
//    A message exceeding this context's limits fails that write() with
//    InvalidArgument and nothing else.
//  - A pipe is usable as soon as it is returned: operations queue until the
//    handshake completes.
//  - Destroying the last shared_ptr closes the pipe.

#include <functional>
#include <memory>
#include <string>

#include <trellis/core/error.h>
#include <trellis/transport/message.h>

namespace trellis::transport {

class Context;
class ListenerImpl;
class PipeImpl;

// Made only by its Context: connect() and a listener's accept().
class Pipe final {
 public:
  using WriteCallback = std::function<void(const Error&)>;
  using ReadDescriptorCallback =
      std::function<void(const Error&, Descriptor descriptor)>;
  using ReadCallback = std::function<void(const Error&)>;

  // Only Context and its listeners can make a Passkey, so only they can
  // construct a Pipe (through std::make_shared, which needs a public
  // constructor).
  class Passkey {
    Passkey() = default;
    friend class Context;
    friend class ListenerImpl;
  };
  Pipe(Passkey, std::shared_ptr<PipeImpl> impl);
  ~Pipe();
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;

  void write(Message message, WriteCallback cb);
  // Writes `message` on the calling thread, before returning, when that
  // needs no wait, and returns true: the message is then ordered like a
  // write() made at this point, and its buffers are free again on return
  // (no callback). Otherwise writes nothing and returns false, and write()
  // is the way. It succeeds only off the loop thread (where write() is as
  // direct), on an established pipe whose connection writes from any
  // thread (shm: the caller copies into the ring and rings the peer's
  // doorbell itself, without waking this context's loop), when every
  // earlier write() has reached the connection and it has room for the
  // whole message, and when no tensor needs a channel's out-of-band copy
  // or a non-CPU device. A false return says nothing about errors:
  // write() reports them. False at once after close().
  bool tryWriteNow(const Message& message);
  void readDescriptor(ReadDescriptorCallback cb);
  void read(Allocation allocation, ReadCallback cb);

  // Fails pending operations with CANCELLED and closes the connection.
  // Asynchronous and idempotent.
  void close();

  // "ctx.pipe3"; stable for the pipe's life.
  const std::string& id() const;
  // The peer's address as the transport reports it ("uv://127.0.0.1:4242").
  std::string peerAddress() const;
  // Negotiated transport / channel names; empty until the handshake is done.
  // channelName() is the channel for CPU tensors; channelName(kCuda) the one
  // for CUDA tensors, empty when none was negotiated (a write with a CUDA
  // tensor then fails with InvalidArgument).
  std::string transportName() const;
  std::string channelName() const;
  std::string channelName(DeviceType type) const;

 private:
  std::shared_ptr<PipeImpl> impl_;
};

}  // namespace trellis::transport
