// The read side of a pipe: frames parsed from the connection, descriptors
// and bodies delivered into the reader's buffers, out-of-band tensors
// fetched by their channels, completion frames sent back.
#include <algorithm>
#include <cstring>
#include <utility>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/pipe_impl.h>
#include <trellis/transport/process_gone.h>

namespace trellis::transport {

namespace wf = wire_format;

namespace {

// How long a read whose copy found the peer's memory gone waits for the
// peer's end of the connection. A writer whose pipe closed has closed its
// connection before its write failed and it let go of the buffer, so its
// EOF is already on the way; a process that lets go of its buffers on its
// way out (unwinding) ends within moments. A live peer whose record lied
// keeps the connection: its read fails this much later, as DATA_LOSS.
constexpr Duration kPeerEndWait = std::chrono::seconds(1);

}  // namespace

void PipeImpl::readBuffer(char** base, size_t* length) {
  if (state_ == State::kEstablished && buffered() == 0) {
    uint8_t* dst = nullptr;
    size_t rem = 0;
    if (rx_ == Rx::kDescriptor) {
      dst = reinterpret_cast<uint8_t*>(descriptor_.data()) + descriptorFilled_;
      rem = descriptor_.size() - descriptorFilled_;
    } else if (rx_ == Rx::kBody && segIndex_ < segments_.size()) {
      dst = segments_[segIndex_].data + segOffset_;
      rem = segments_[segIndex_].length - segOffset_;
    }
    if (rem >= kDirectThreshold) {
      direct_ = true;
      *base = reinterpret_cast<char*>(dst);
      *length = rem;
      return;
    }
  }
  direct_ = false;
  const size_t want = stageWant();
  if (want == 0) {
    *base = nullptr;
    *length = 0;
    return;
  }
  if (buffered() == 0) {
    stageBegin_ = stageEnd_ = 0;
  } else if (stageEnd_ == stage_.size() && stageBegin_ > 0) {
    std::memmove(stage_.data(), stage_.data() + stageBegin_, buffered());
    stageEnd_ -= stageBegin_;
    stageBegin_ = 0;
  }
  *base = reinterpret_cast<char*>(stage_.data() + stageEnd_);
  *length = std::min(stage_.size() - stageEnd_, want);
}

size_t PipeImpl::stageWant() const {
  if (state_ != State::kEstablished || conn_ == nullptr ||
      !conn_->readsAreCheap()) {
    return kNoLimit;
  }
  // Bytes the current step still lacks; kNoLimit once it has them all
  // (process() moves on before the next read).
  auto lacking = [&](size_t need) {
    return need > buffered() ? need - buffered() : kNoLimit;
  };
  switch (rx_) {
    case Rx::kHeader:
      return lacking(wf::kFrameHeaderBytes);
    case Rx::kLayout:
      return lacking(layoutLength_);
    case Rx::kDescriptor:
      return lacking(descriptor_.size() - descriptorFilled_);
    case Rx::kDescriptorReady:
    case Rx::kAwaitRead: {
      // The body's first bytes: read ahead they would land in the stage
      // and be copied twice more; left in the ring they go straight into
      // the reader's buffer once read() names it.
      size_t first = 0;
      for (size_t len : layout_.payloadLengths) {
        if (len > 0) {
          first = len;
          break;
        }
      }
      for (size_t i = 0; first == 0 && i < layout_.tensors.size(); ++i) {
        const bool oob =
            i < layout_.outOfBand.size() && layout_.outOfBand[i].present;
        if (!oob) {
          first = layout_.tensors[i].length;
        }
      }
      return first >= kDirectThreshold ? 0 : kNoLimit;
    }
    case Rx::kBody:
      if (segIndex_ < segments_.size()) {
        return lacking(segments_[segIndex_].length - segOffset_);
      }
      return kNoLimit;
    case Rx::kOutOfBand:
      return kNoLimit;
  }
  return kNoLimit;
}

void PipeImpl::onRead(size_t n) {
  auto self = shared_from_this();
  if (direct_) {
    direct_ = false;
    if (rx_ == Rx::kDescriptor) {
      descriptorFilled_ += n;
    } else {
      segOffset_ += n;
    }
  } else {
    stageEnd_ += n;
  }
  process();
}

void PipeImpl::onReadError(const Error& error) {
  auto self = shared_from_this();
  reading_ = false;
  if (state_ == State::kEstablished && error.code() == Code::kUnavailable) {
    // The end of the stream: every byte the peer sent is in the stage or
    // already in the reader's buffers, and stays readable (a peer that
    // writes and then closes must be heard out); process() fails the pipe
    // once nothing more can be served from it.
    peerClosedFromLoop(
        error.withContext(id_ + ": connection to " + peerAddress() + " lost"));
    if (!heldError_.ok()) {
      releaseHeldRead();
    }
    process();
    return;
  }
  std::string where;
  if (state_ != State::kEstablished) {
    where = " during the handshake";
  } else if (rx_ != Rx::kHeader || buffered() > 0) {
    where = " in the middle of a message";
  }
  failFromLoop(error.withContext(id_ + ": connection to " + peerAddress() +
                                 " lost" + where));
}

bool PipeImpl::needBytes(size_t n) {
  if (buffered() >= n) {
    return true;
  }
  if (n > stage_.size()) {
    // Only for a layout, whose length was checked against the limits.
    std::vector<uint8_t> bigger(n);
    std::memcpy(bigger.data(), stageData(), buffered());
    stageEnd_ = buffered();
    stageBegin_ = 0;
    stage_.swap(bigger);
  } else if (stageBegin_ + n > stage_.size()) {
    std::memmove(stage_.data(), stageData(), buffered());
    stageEnd_ = buffered();
    stageBegin_ = 0;
  }
  return false;
}

void PipeImpl::checkEndOfStream() {
  if (!readEnd_ || state_ != State::kEstablished) {
    return;
  }
  // Waiting for the user (a descriptor not yet asked for, a read not yet
  // posted) or for a channel's copy: what is here can still be served.
  if (rx_ == Rx::kDescriptorReady || rx_ == Rx::kAwaitRead ||
      rx_ == Rx::kOutOfBand) {
    return;
  }
  if (rx_ != Rx::kHeader || buffered() > 0) {
    failFromLoop(
        Error(readEndError_.code(),
              readEndError_.message() + " in the middle of a message"));
    return;
  }
  failFromLoop(readEndError_);
}

bool PipeImpl::stepFrame() {
  switch (rx_) {
    case Rx::kHeader: {
      if (!needBytes(wf::kFrameHeaderBytes)) {
        return false;
      }
      Error e = wf::decodeFrameHeader(
          std::span<const uint8_t>(stageData(), wf::kFrameHeaderBytes),
          ctx_->limits(), &layoutLength_);
      if (!e.ok()) {
        failFromLoop(e.withContext(id_ + " (peer " + peerAddress() + ")"));
        return false;
      }
      consume(wf::kFrameHeaderBytes);
      rx_ = Rx::kLayout;
      return true;
    }
    case Rx::kLayout: {
      if (!needBytes(layoutLength_)) {
        return false;
      }
      Error e =
          wf::decodeLayout(std::span<const uint8_t>(stageData(), layoutLength_),
                           ctx_->limits(), &layout_);
      if (e.ok() && layout_.type == wf::kFrameCompletion) {
        consume(layoutLength_);
        rx_ = Rx::kHeader;
        onCompletion(layout_);
        return !life_.failed();
      }
      for (size_t i = 0; e.ok() && i < layout_.outOfBand.size(); ++i) {
        if (!layout_.outOfBand[i].present) {
          continue;
        }
        const Device& d = layout_.tensors[i].device;
        Channel* ch = channelFor(d);
        if (ch == nullptr || !ch->drivesOutOfBand()) {
          e = Error::protocol(
              "tensor " + std::to_string(i) + ": out-of-band record for a " +
              d.toString() + " tensor, but " +
              (ch == nullptr ? std::string("no channel for that device type")
                             : "channel " + ch->name()) +
              " was negotiated, which carries none");
        }
      }
      for (size_t i = 0; e.ok() && i < layout_.tensors.size(); ++i) {
        const bool oob =
            i < layout_.outOfBand.size() && layout_.outOfBand[i].present;
        const Device& d = layout_.tensors[i].device;
        if (!oob && d.type != DeviceType::kCpu) {
          // Only empty ones (the decoder refuses the rest): still, the
          // device must be one this pipe carries.
          if (cudaChannel_ == nullptr) {
            e = Error::protocol("tensor " + std::to_string(i) + " on " +
                                d.toString() +
                                ", but no channel for CUDA tensors was "
                                "negotiated");
          }
        }
      }
      if (!e.ok()) {
        failFromLoop(e.withContext(id_ + " (peer " + peerAddress() + ")"));
        return false;
      }
      consume(layoutLength_);
      // Sized only now that the length passed the limits.
      descriptor_.assign(layout_.descriptorLength, '\0');
      descriptorFilled_ = 0;
      rx_ = Rx::kDescriptor;
      return true;
    }
    case Rx::kDescriptor: {
      const size_t want = descriptor_.size() - descriptorFilled_;
      const size_t n = std::min(want, buffered());
      if (n > 0) {
        std::memcpy(descriptor_.data() + descriptorFilled_, stageData(), n);
        consume(n);
        descriptorFilled_ += n;
      }
      if (descriptorFilled_ == descriptor_.size()) {
        rx_ = Rx::kDescriptorReady;
        return true;
      }
      return false;
    }
    case Rx::kDescriptorReady: {
      if (descriptorCbs_.empty()) {
        return false;
      }
      serveDescriptor();
      return true;
    }
    case Rx::kAwaitRead:
    case Rx::kOutOfBand:
      return false;
    case Rx::kBody: {
      bool progress = false;
      while (segIndex_ < segments_.size()) {
        auto& seg = segments_[segIndex_];
        if (segOffset_ == seg.length) {
          ++segIndex_;
          segOffset_ = 0;
          continue;
        }
        const size_t n = std::min(seg.length - segOffset_, buffered());
        if (n == 0) {
          break;
        }
        std::memcpy(seg.data + segOffset_, stageData(), n);
        consume(n);
        segOffset_ += n;
        progress = true;
      }
      if (segIndex_ == segments_.size()) {
        finishBody();
        return true;
      }
      return progress;
    }
  }
  return false;
}

void PipeImpl::serveDescriptor() {
  auto cb = descriptorCbs_.pop();
  --pendingOps_;
  Descriptor d;
  d.descriptor = std::move(descriptor_);
  descriptor_.clear();
  d.payloadLengths = layout_.payloadLengths;
  d.tensors = layout_.tensors;
  rx_ = Rx::kAwaitRead;
  ctx_->loop().deliver([cb = std::move(cb), d = std::move(d)]() mutable {
    cb(Error(), std::move(d));
  });
}

void PipeImpl::finishBody() {
  segments_.clear();
  segIndex_ = segOffset_ = 0;
  if (outOfBand_.empty()) {
    finishRead(Error());
    return;
  }
  rx_ = Rx::kOutOfBand;
  startOutOfBand();
}

Channel* PipeImpl::channelFor(const Device& device) const {
  return device.type == DeviceType::kCuda ? cudaChannel_.get() : channel_.get();
}

bool PipeImpl::writerClosed() const {
  return readEnd_ || (conn_ != nullptr && conn_->peerHasClosed());
}

Error PipeImpl::writerGone(bool copied) const {
  const std::string who =
      "pid " + std::to_string(peerPid_) + " (peer " + peerAddress() + ")";
  const std::string what =
      copied ? " while the tensor was copied; its write failed then, so the "
               "bytes may be its reused buffer's"
             : " before the tensor was read; its write failed then, so its "
               "buffer is its own again and nothing was copied";
  if (processGone(peerPid_)) {
    return Error(
        Code::kUnavailable,
        id_ + ": read: the peer process is gone: " + who + " ended" + what);
  }
  return Error(Code::kUnavailable, id_ + ": read: the peer is gone: " + who +
                                       " closed its pipe" + what);
}

void PipeImpl::startOutOfBand() {
  const std::string who = "peer " + peerAddress();
  if (writerClosed()) {
    // Its write failed when it closed: the buffer is its own again, and
    // may hold anything by now. Nothing is copied, and no completion is
    // sent (nobody reads it).
    outOfBand_.clear();
    finishRead(writerGone(/*copied=*/false));
    process();
    return;
  }
  // Records are checked before any copy starts: a lying one fails this read
  // only, and the stream stays in step.
  for (const auto& r : outOfBand_) {
    Error e = channelFor(r.device)->checkOutOfBandRecord(
        r.record, Descriptor::TensorInfo{r.dst.length, r.device}, peerPid_);
    if (!e.ok()) {
      outOfBand_.clear();
      e = e.withContext(id_ + ": read: tensor " + std::to_string(r.tensor) +
                        " (" + who + ")");
      sendCompletion(e);
      finishRead(e);
      process();
      return;
    }
  }
  outOfBandPending_ = outOfBand_.size();
  auto loop = ctx_->sharedLoop();
  for (const auto& r : outOfBand_) {
    // The callback may come on any thread, even inline: it only hops back.
    // It owns the pipe until then, so the read's callback (which must wait
    // for the copy, since the copy writes into the caller's buffer) always
    // fires; the reference moves into the task so that it is dropped on
    // the loop, never on a channel's thread.
    auto self = shared_from_this();
    const size_t tensor = r.tensor;
    channelFor(r.device)->readOutOfBand(
        r.record, r.dst, r.device, who,
        [loop, self = std::move(self), tensor](const Error& e) mutable {
          loop->defer([self = std::move(self), tensor, e] {
            self->onOutOfBandDone(tensor, e);
          });
        });
  }
}

void PipeImpl::onOutOfBandDone(size_t tensor, const Error& error) {
  if (!error.ok() && outOfBandError_.ok()) {
    outOfBandError_ = error;
    outOfBandErrorTensor_ = tensor;
  }
  if (outOfBandPending_ == 0 || --outOfBandPending_ > 0) {
    return;
  }
  const Error e = outOfBandError_;
  outOfBandError_ = Error();
  outOfBand_.clear();
  if (life_.failed()) {
    // teardownFromLoop left the connection open for the copies; the peer
    // may reuse its buffers once it sees it close.
    if (conn_ != nullptr) {
      conn_->close();
    }
    // failFromLoop kept the read's callback and the writes' for this
    // moment: the connection no longer touches their buffers.
    auto cb = std::move(readCb_);
    readCb_ = nullptr;
    auto& loop = ctx_->loop();
    const Error err = life_.error();
    if (cb) {
      loop.deliver([cb = std::move(cb), err] { cb(err); });
    }
    for (auto& w : std::exchange(heldWriteCbs_, {})) {
      loop.deliver([w = std::move(w), err] { w(err); });
    }
    return;
  }
  if (e.ok() && writerClosed()) {
    // The writer closed while the copy ran, and its write failed then: it
    // may have reused its buffer under the copy. (A writer's close reaches
    // this connection before its write callbacks run, so a copy that ends
    // with no sign of it read a buffer still lent.)
    finishRead(writerGone(/*copied=*/true));
    process();
    return;
  }
  if (e.code() == Code::kDataLoss && !peerLeft()) {
    holdForPeerEnd(e);
    return;
  }
  finishOutOfBand(e);
}

void PipeImpl::finishOutOfBand(const Error& error) {
  Error e = error;
  if (!e.ok()) {
    const std::string where =
        id_ + ": read: tensor " + std::to_string(outOfBandErrorTensor_);
    if (e.code() == Code::kDataLoss && peerLeft()) {
      // Its write failed when its end closed, and the buffer was its own
      // again: gone memory says the peer left, not that it lied.
      e = Error(Code::kUnavailable,
                where + ": the peer is gone: peer " + peerAddress() +
                    " closed its end of the connection before the tensor "
                    "was read, and the memory its record names is no longer "
                    "there (" +
                    e.message() + ")");
    } else {
      e = e.withContext(where);
    }
  }
  // The writer's callback waits for this, whatever the outcome; the stream
  // stays in step either way, so only this read fails.
  sendCompletion(e);
  finishRead(e);
  process();
}

void PipeImpl::holdForPeerEnd(const Error& error) {
  heldError_ = error;
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  peerEndTimer_ = LoopTimer::start(ctx_->loop(), kPeerEndWait, [weak] {
    if (auto p = weak.lock()) {
      p->peerEndTimer_ = nullptr;
      p->releaseHeldRead();
    }
  });
}

void PipeImpl::releaseHeldRead() {
  if (peerEndTimer_ != nullptr) {
    peerEndTimer_->cancel();
    peerEndTimer_ = nullptr;
  }
  const Error e = heldError_;
  heldError_ = Error();
  finishOutOfBand(e);
}

void PipeImpl::sendCompletion(const Error& error) {
  if (!writeError_.ok() || readEnd_) {
    return;  // the peer is gone and waits for nothing
  }
  auto frame = std::make_shared<std::vector<uint8_t>>(
      wf::encodeCompletion(error.code(), error.message()));
  const IoBuf b{frame->data(), frame->size()};
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  conn_->write(&b, 1, [weak, frame](const Error& e) {
    auto self = weak.lock();
    if (self == nullptr || e.ok()) {
      return;
    }
    const Error err = e.withContext(self->id_ + ": completion write");
    if (self->state_ == State::kEstablished && e.code() == Code::kUnavailable) {
      self->stopWritesFromLoop(err);
    } else {
      self->failFromLoop(err);
    }
  });
}

void PipeImpl::finishRead(const Error& error) {
  rx_ = Rx::kHeader;
  auto cb = std::move(readCb_);
  readCb_ = nullptr;
  --pendingOps_;
  ctx_->loop().deliver([cb = std::move(cb), error] { cb(error); });
}

void PipeImpl::readDescriptor(Pipe::ReadDescriptorCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::readDescriptor needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, cb = std::move(cb)]() mutable {
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb, Descriptor())) {
      return;
    }
    if (self->pendingOps_ >= self->ctx_->limits().maxPendingOperations) {
      Error e(Code::kResourceExhausted,
              self->id_ + ": too many pending operations");
      loop.deliver([cb = std::move(cb), e] { cb(e, Descriptor()); });
      return;
    }
    ++self->pendingOps_;
    self->descriptorCbs_.push(std::move(cb));
    self->process();
  });
}

void PipeImpl::read(Allocation allocation, Pipe::ReadCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::read needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, allocation = std::move(allocation),
                    cb = std::move(cb)]() mutable {
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb)) {
      return;
    }
    auto reject = [&](const std::string& why) {
      loop.deliver([cb = std::move(cb),
                    e = Error::invalidArgument(self->id_ + ": read: " + why)] {
        cb(e);
      });
    };
    if (self->rx_ != Rx::kAwaitRead) {
      reject(self->rx_ == Rx::kBody
                 ? "a read is already in progress"
                 : "no descriptor is waiting: call readDescriptor() and wait "
                   "for its callback first");
      return;
    }
    const auto& lay = self->layout_;
    if (allocation.payloads.size() != lay.payloadLengths.size() ||
        allocation.tensors.size() != lay.tensors.size()) {
      reject("allocation has " + std::to_string(allocation.payloads.size()) +
             " payloads and " + std::to_string(allocation.tensors.size()) +
             " tensors; the descriptor announced " +
             std::to_string(lay.payloadLengths.size()) + " and " +
             std::to_string(lay.tensors.size()));
      return;
    }
    // Built in the last read's vector (empty since its body finished), so
    // a steady stream of reads allocates none.
    std::vector<Segment> segs;
    segs.swap(self->segments_);
    segs.clear();
    segs.reserve(allocation.payloads.size() + allocation.tensors.size());
    auto check = [&](const Allocation::Buffer& b, size_t want,
                     const std::string& what) -> bool {
      if (b.length != want) {
        reject(what + " buffer has " + std::to_string(b.length) +
               " bytes; the descriptor announced " + std::to_string(want));
        return false;
      }
      if (want > 0 && b.data == nullptr) {
        reject(what + " buffer is null");
        return false;
      }
      if (want > 0) {
        segs.push_back(Segment{static_cast<uint8_t*>(b.data), want});
      }
      return true;
    };
    for (size_t i = 0; i < allocation.payloads.size(); ++i) {
      if (!check(allocation.payloads[i], lay.payloadLengths[i],
                 "payload " + std::to_string(i))) {
        return;
      }
    }
    std::vector<OutOfBandRead> oob;
    for (size_t i = 0; i < allocation.tensors.size(); ++i) {
      const size_t before = segs.size();
      if (!check(allocation.tensors[i], lay.tensors[i].length,
                 "tensor " + std::to_string(i))) {
        return;
      }
      if (i < lay.outOfBand.size() && lay.outOfBand[i].present &&
          segs.size() > before) {
        // Its bytes are not in the stream: its channel copies them once the
        // inline bytes are in.
        segs.pop_back();
        oob.push_back(OutOfBandRead{i, allocation.tensors[i],
                                    lay.tensors[i].device,
                                    lay.outOfBand[i].record});
      }
    }
    self->segments_ = std::move(segs);
    self->outOfBand_ = std::move(oob);
    self->segIndex_ = 0;
    self->segOffset_ = 0;
    self->readCb_ = std::move(cb);
    ++self->pendingOps_;
    self->rx_ = Rx::kBody;
    self->process();
  });
}

}  // namespace trellis::transport
