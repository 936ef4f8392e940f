#pragma once

// Internal extension points of the transport layer (not installed).
//
// A Transport makes byte-stream Connections (connect / listen) on a Context's
// Loop (uv, shm). A Channel says how tensor bytes move once a pipe is
// established: basic sends them inline through the pipe's connection, cma
// out of band (a record in the frame, a copy by the reader). Everything here is
// used on the loop thread only, except name(), viable() and the other const
// queries.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <trellis/core/error.h>
#include <trellis/transport/loop.h>
#include <trellis/transport/message.h>

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

  // Idempotent. No ReadSink call afterwards; write callbacks still pending
  // fire later with an error. After close() returns no byte is read from or
  // written to any buffer passed in.
  virtual void close() = 0;

  virtual std::string peerAddress() const = 0;
};

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

class Channel {
 public:
  virtual ~Channel() = default;
  virtual std::string name() const = 0;
  virtual Error viable() const = 0;
  virtual bool sameHostOnly() const = 0;
  virtual bool supportsDevice(const Device& device) const = 0;
  // True when tensor bytes travel inline in the frame, after the payloads,
  // through the pipe's connection (basic).
  virtual bool inlineThroughConnection() const = 0;

  // Out-of-band channels the pipe drives (cma, cuda_ipc). A pipe negotiates
  // one channel per device type (cpu, cuda). A tensor for which
  // sendsOutOfBand() is true travels as an opaque record (describeOutOfBand,
  // at most kMaxOutOfBandRecordBytes) in the frame layout instead of its
  // bytes (docs/transport.md, "Message frames"); the reader's channel
  // of the same name turns the record back into a copy straight into the
  // reader's allocation (readOutOfBand) and the reader answers with a
  // completion frame; only then does the writer's callback fire, so the
  // writer's buffer stays valid for the whole copy. Other tensors and all
  // payloads go inline.
  static constexpr size_t kMaxOutOfBandRecordBytes = 1024;
  virtual bool drivesOutOfBand() const { return false; }
  virtual bool sendsOutOfBand(const Message::Tensor& /*tensor*/) const {
    return false;
  }
  // Writer side, loop thread: fills `record` with what the peer needs to
  // fetch `tensor` (cma: pid, address, length; cuda_ipc: memory and event
  // handles). An error fails that write only. Never throws.
  virtual Error describeOutOfBand(const Message::Tensor& /*tensor*/,
                                  std::string* /*record*/) const {
    return Error(Code::kUnimplemented, name() + " carries no out-of-band data");
  }
  // Reader side, loop thread, before readOutOfBand: checks `record` against
  // what the handshake told about the peer (cma: the record must name the
  // peer's own pid, so a peer cannot make this process copy from a third
  // process or from itself). An error fails that read only. Never throws.
  virtual Error checkOutOfBandRecord(const std::string& /*record*/,
                                     uint64_t /*peerPid*/) const {
    return Error();
  }
  // Reader side, called on the loop thread: copies the tensor described by
  // `record` into `dst` (its length and device come from the descriptor).
  // `record` comes from the network: every field is validated, and a lying
  // record fails this read (and the peer's write) only. The copy may run on
  // a thread the channel owns; `done` fires exactly once, on any thread,
  // possibly inline; the pipe hops back to its loop. Errors name the peer
  // (`who`). Never throws.
  using OutOfBandCallback = std::function<void(const Error&)>;
  virtual void readOutOfBand(const std::string& /*record*/,
                             const Allocation::Buffer& /*dst*/,
                             const Device& /*device*/,
                             const std::string& /*who*/,
                             OutOfBandCallback done) const {
    auto cb = std::move(done);
    cb(Error(Code::kUnimplemented, name() + " carries no out-of-band data"));
  }
};

}  // namespace trellis::transport
