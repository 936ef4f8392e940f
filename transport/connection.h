#pragma once

// Internal: a Connection, the byte stream a Transport (transport.h) makes
// and a pipe runs on. Not installed.
//
// Contract
//  - Loop thread only: every method but writeNow(), and every ReadSink and
//    write callback runs there.
//  - Ordered: bytes arrive in the order write() was called.
//  - Exactly once: every write callback fires once, never inline from
//    write(), with OK or the error that ended the write (close() included).

#include <cstddef>
#include <functional>
#include <memory>
#include <poll.h>
#include <string>

#include <trellis/core/error.h>

namespace trellis::transport {

struct IoBuf {
  const void* data;
  size_t length;
};

// Receives the bytes of a Connection. The connection asks for a buffer before
// each read (readBuffer, which must return a non-empty span), then reports
// how many bytes landed in it (onRead) or the error that ended the stream
// (onReadError: UNAVAILABLE for EOF or reset). No call after close().
class ReadSink {
 public:
  virtual ~ReadSink() = default;
  virtual void readBuffer(char** base, size_t* length) = 0;
  virtual void onRead(size_t n) = 0;
  virtual void onReadError(const Error& error) = 0;
};

// Whether the peer of the connected socket `fd` closed or shut down its
// writing half (POLLRDHUP, set at once on a loopback TCP or UNIX socket),
// whatever data is still queued ahead of that end. Never blocks.
inline bool socketPeerHasClosed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return fd >= 0 && ::poll(&p, 1, 0) > 0 &&
         (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

class Connection {
 public:
  using WriteCallback = std::function<void(const Error&)>;
  virtual ~Connection() = default;

  virtual void startReading(ReadSink* sink) = 0;
  virtual void stopReading() = 0;

  // Writes `bufs` in order after everything written before. `cb` fires
  // exactly once, on the loop thread and never inline from write(): OK once
  // every byte has left the caller's buffers (even when that happened
  // during the call), or the error that ended the write (close() included).
  // The buffers must stay valid until then (the array itself may be freed
  // on return).
  virtual void write(const IoBuf* bufs, size_t n, WriteCallback cb) = 0;

  // Any thread. Writes all of `bufs` before returning, after everything
  // written before, and returns true; or writes nothing and returns false
  // (then write() is the way): when the connection cannot (writesNow() is
  // false), is not open, failed, still holds bytes of an earlier write(),
  // or has no room for all of them now. It never waits and calls nothing
  // back; the buffers are free again on return. A false return says
  // nothing about errors: write() reports those.
  virtual bool writeNow(const IoBuf* /*bufs*/, size_t /*n*/) { return false; }
  // Whether writeNow() can ever succeed on this connection.
  virtual bool writesNow() const { return false; }

  // Idempotent. No ReadSink call afterwards; write callbacks still pending
  // fire later with an error. After close() returns no byte is read from or
  // written to any buffer passed in.
  virtual void close() = 0;

  virtual std::string peerAddress() const = 0;

  // Loop thread. Whether the peer's end has closed (or stopped writing), as
  // the kernel knows it now: before the loop has read up to the end of the
  // stream. The pipe asks once an out-of-band copy ends, to learn whether
  // the writer let go of its buffer (docs/transport.md, "cma"). False when
  // the connection cannot tell.
  virtual bool peerHasClosed() const { return false; }

  // True when a read costs no system call (shm: bytes are copied out of a
  // ring). The reading pipe then takes a frame's header, layout and
  // descriptor in separate reads and leaves a large body in the connection
  // until its destination is known, instead of staging bytes ahead, which
  // would copy the start of every large body twice more.
  virtual bool readsAreCheap() const { return false; }
};

}  // namespace trellis::transport
