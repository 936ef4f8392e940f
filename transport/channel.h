#pragma once

// Internal: the interface of a channel, which says how tensor bytes move
// once a pipe is established: basic sends them inline through the pipe's
// connection; cma and cuda_ipc out of band (a record in the frame, a copy
// by the reader). Not installed. A channel is registered with
// Context::registerChannel (docs/transport.md, "Extending").
//
// Contract
//  - The const queries may be called from any thread; describeOutOfBand,
//    checkOutOfBandRecord and readOutOfBand are called on the loop thread.
//  - Never throws; failures are Errors that fail one read or write.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include <trellis/core/error.h>
#include <trellis/transport/message.h>

namespace trellis::transport {

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
  // Reader side, loop thread, before readOutOfBand: checks everything about
  // `record` that needs nothing of the peer's memory: that it decodes, that
  // it describes `tensor` (the descriptor's entry for it: its length, at
  // least) and that it matches what the handshake told about the peer
  // (cma: the record must name the peer's own pid, so a peer cannot make
  // this process copy from a third process or from itself). A failure is a
  // lie whatever the peer does next (DATA_LOSS) and fails that read only.
  // Never throws.
  virtual Error checkOutOfBandRecord(const std::string& /*record*/,
                                     const Descriptor::TensorInfo& /*tensor*/,
                                     uint64_t /*peerPid*/) const {
    return Error();
  }
  // Reader side, called on the loop thread: copies the tensor described by
  // `record` into `dst` (its length and device come from the descriptor).
  // `record` comes from the network: every field is validated again, and a
  // lying record fails this read (and the peer's write) only. The copy may
  // run on a thread the channel owns; `done` fires exactly once, on any
  // thread, possibly inline; the pipe hops back to its loop. Errors name
  // the peer (`who`). For a record checkOutOfBandRecord passed, what fails
  // is reaching the memory it names:
  //  - UNAVAILABLE when the peer process is gone (exited, killed, exiting):
  //    its memory went with it;
  //  - DATA_LOSS when that memory cannot be read although the peer lives:
  //    a record naming memory the peer does not have, or a buffer the peer
  //    let go of once its write failed (its pipe closed); the pipe tells
  //    the two apart by whether the peer's end of the connection closes
  //    (docs/transport.md, "Errors");
  //  - other codes for causes on this side (permission, resources, time).
  // Never throws.
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
