// The write side of a pipe: messages queued until the handshake is done,
// framed and handed to the connection in one scatter/gather write, held
// for the peer's completion frame when a channel moves tensors out of band,
// and failed when the peer goes.
#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/pipe_impl.h>

namespace trellis::transport {

namespace wf = wire_format;

namespace {

// The buffers of one frame, in wire order: its head, the descriptor, the
// payloads and the tensors that go inline (all of them when `outOfBand` is
// null; else those whose record is not present), empty ones left out, in
// `out` (cleared first, so that a caller may reuse one).
void frameBuffers(const Message& m, const std::vector<uint8_t>& head,
                  const std::vector<wf::OutOfBand>* outOfBand,
                  std::vector<IoBuf>* out) {
  std::vector<IoBuf>& iov = *out;
  iov.clear();
  iov.reserve(2 + m.payloads.size() + m.tensors.size());
  iov.push_back(IoBuf{head.data(), head.size()});
  if (!m.descriptor.empty()) {
    iov.push_back(IoBuf{m.descriptor.data(), m.descriptor.size()});
  }
  for (const auto& p : m.payloads) {
    if (p.length > 0) {
      iov.push_back(IoBuf{p.data, p.length});
    }
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    if (t.length > 0 && (outOfBand == nullptr || !(*outOfBand)[i].present)) {
      iov.push_back(IoBuf{t.data, t.length});
    }
  }
}

}  // namespace

void PipeImpl::peerClosedFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  if (readEnd_) {
    return;
  }
  readEnd_ = true;
  readEndError_ = error;
  conn_->close();
  reading_ = false;
  stopWritesFromLoop(error);
  // close() fails the writes the connection still held.
  std::vector<std::shared_ptr<WriteOp>> ops(inflightWrites_.begin(),
                                            inflightWrites_.end());
  for (auto& op : ops) {
    finishWrite(op, error);
  }
  awaitingPeer_.clear();
}

void PipeImpl::stopWritesFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  closeWriteNow();
  if (writeError_.ok()) {
    writeError_ = error;
  }
  // Writes the connection is done with but whose completion frame will not
  // come, and writes not yet handed to it.
  std::vector<std::shared_ptr<WriteOp>> ops(awaitingPeer_.begin(),
                                            awaitingPeer_.end());
  awaitingPeer_.clear();
  for (auto& op : ops) {
    if (op->wireDone) {
      finishWrite(op, error);
    }
  }
  auto queued = std::move(queuedWrites_);
  queuedWrites_.clear();
  for (auto& op : queued) {
    inflightWrites_.push_back(op);
    finishWrite(op, error);
  }
}

void PipeImpl::onCompletion(const wf::FrameLayout& completion) {
  if (awaitingPeer_.empty()) {
    failFromLoop(Error::protocol(id_ + " (peer " + peerAddress() +
                                 "): completion frame with no out-of-band "
                                 "write waiting for one"));
    return;
  }
  auto op = std::move(awaitingPeer_.front());
  awaitingPeer_.pop_front();
  op->peerDone = true;
  if (completion.completionCode != Code::kOk) {
    op->peerError = Error(completion.completionCode,
                          id_ + ": write: peer " + peerAddress() +
                              " failed to read the out-of-band tensors: " +
                              completion.completionReason);
  }
  if (op->wireDone) {
    finishWrite(op, op->peerError);
  }
}

Error PipeImpl::describeTensors(const Message& m,
                                std::vector<wf::OutOfBand>* records) const {
  size_t total = 0;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    Channel* ch = channelFor(t.device);
    const std::string what =
        "tensor " + std::to_string(i) + " on " + t.device.toString();
    if (ch == nullptr) {
      return Error::invalidArgument(
          what + ": no channel for " + t.device.toString() +
          " tensors was negotiated with this peer (cpu channel: " +
          channel_->name() + ")");
    }
    wf::OutOfBand o;
    if (ch->drivesOutOfBand() && ch->sendsOutOfBand(t)) {
      Error e = ch->describeOutOfBand(t, &o.record);
      if (!e.ok()) {
        return e.withContext(what);
      }
      if (o.record.size() > wf::kMaxOutOfBandRecordBytes) {
        return Error::invalidArgument(
            what + ": channel " + ch->name() + " described it in " +
            std::to_string(o.record.size()) + " bytes, over the limit of " +
            std::to_string(wf::kMaxOutOfBandRecordBytes));
      }
      total += o.record.size();
      o.present = true;
    } else if (t.device.type != DeviceType::kCpu && t.length > 0) {
      return Error::invalidArgument(what + ": channel " + ch->name() +
                                    " does not carry it");
    }
    records->push_back(std::move(o));
  }
  if (total > wf::kMaxOutOfBandBytesPerFrame) {
    return Error::invalidArgument(
        "out-of-band records of one message add up to " +
        std::to_string(total) + " bytes, over the limit of " +
        std::to_string(wf::kMaxOutOfBandBytesPerFrame));
  }
  return Error();
}

void PipeImpl::submitWrite(const std::shared_ptr<WriteOp>& op) {
  const Message& m = op->message;
  op->head.clear();
  std::vector<wf::OutOfBand> outOfBand;
  outOfBand.reserve(m.tensors.size());
  Error e = writeError_;
  if (e.ok()) {
    e = describeTensors(m, &outOfBand);
    if (!e.ok()) {
      e = e.withContext(id_ + ": write");
    }
  }
  if (!e.ok()) {
    // This write only.
    inflightWrites_.push_back(op);
    finishWrite(op, e);
    return;
  }
  for (const auto& o : outOfBand) {
    op->awaitsPeer = op->awaitsPeer || o.present;
  }
  if (op->awaitsPeer) {
    wf::encodeFrameHead(m, &op->head, &outOfBand);
    awaitingPeer_.push_back(op);
  } else {
    wf::encodeFrameHead(m, &op->head);
  }
  std::vector<IoBuf> iov;
  frameBuffers(m, op->head, op->awaitsPeer ? &outOfBand : nullptr, &iov);
  inflightWrites_.push_back(op);
  std::weak_ptr<PipeImpl> weak = shared_from_this();
  conn_->write(iov.data(), iov.size(), [weak, op](const Error& e) {
    if (auto self = weak.lock()) {
      self->completeWrite(op, e);
    }
  });
}

void PipeImpl::completeWrite(const std::shared_ptr<WriteOp>& op,
                             const Error& error) {
  if (op->done) {
    return;
  }
  if (!error.ok()) {
    const Error e = error.withContext(id_ + ": write to " + peerAddress());
    if (state_ == State::kEstablished && error.code() == Code::kUnavailable) {
      // The peer is gone, but what it wrote before may still be on its way
      // in: the read side goes on until the end of the stream.
      stopWritesFromLoop(e);
      finishWrite(op, e);
      return;
    }
    failFromLoop(e);
    return;
  }
  op->wireDone = true;
  if (!op->awaitsPeer || op->peerDone) {
    finishWrite(op, op->peerError);
  } else if (!writeError_.ok()) {
    finishWrite(op, writeError_);  // no completion frame will come
  }
}

void PipeImpl::finishWrite(const std::shared_ptr<WriteOp>& op,
                           const Error& error) {
  if (op->done) {
    return;
  }
  op->done = true;
  for (auto it = inflightWrites_.begin(); it != inflightWrites_.end(); ++it) {
    if (*it == op) {
      inflightWrites_.erase(it);
      break;
    }
  }
  --pendingOps_;
  auto cb = std::move(op->cb);
  op->message = Message();
  ctx_->loop().deliver([cb = std::move(cb), error] { cb(error); });
}

void PipeImpl::openWriteNow() {
  if (!conn_->writesNow() || !writeError_.ok() || life_.failed()) {
    return;
  }
  MutexLock lock(nowMu_);
  if (!closing_) {
    nowConn_ = conn_;
  }
}

void PipeImpl::closeWriteNow() {
  MutexLock lock(nowMu_);
  nowConn_ = nullptr;
}

bool PipeImpl::tryWriteNow(const Message& message) {
  if (ctx_->loop().inLoop()) {
    return false;  // write() is as direct there, and keeps the loop's order
  }
  // A write() not yet handed to the connection goes first.
  if (unsubmitted_.load(std::memory_order_acquire) != 0) {
    return false;
  }
  std::shared_ptr<Connection> conn;
  {
    MutexLock lock(nowMu_);
    conn = nowConn_;
  }
  if (conn == nullptr) {
    return false;
  }
  // channel_ was set before nowConn_, under nowMu_, and never changes.
  for (const auto& t : message.tensors) {
    if (t.device.type != DeviceType::kCpu ||
        (channel_->drivesOutOfBand() && channel_->sendsOutOfBand(t))) {
      return false;
    }
  }
  if (!wf::checkOutgoing(message, ctx_->limits()).ok()) {
    return false;  // write() reports it
  }
  // This thread's frame head and buffer list, reused: writeNow() copies
  // the message before it returns and calls nothing back.
  thread_local std::vector<uint8_t> head;
  thread_local std::vector<IoBuf> iov;
  head.clear();
  wf::encodeFrameHead(message, &head);
  frameBuffers(message, head, nullptr, &iov);
  return conn->writeNow(iov.data(), iov.size());
}

void PipeImpl::write(Message message, Pipe::WriteCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Pipe::write needs a callback");
  auto self = shared_from_this();
  unsubmitted_.fetch_add(1, std::memory_order_acq_rel);
  ctx_->loop().run([self, message = std::move(message),
                    cb = std::move(cb)]() mutable {
    // Handed to the connection, queued for the handshake, or failed, when
    // this ends (tryWriteNow() then may write after it).
    struct Submitted {
      std::atomic<size_t>& pending;
      ~Submitted() { pending.fetch_sub(1, std::memory_order_acq_rel); }
    } submitted{self->unsubmitted_};
    auto& loop = self->ctx_->loop();
    if (self->life_.refuse(cb)) {
      return;
    }
    if (!self->writeError_.ok()) {
      loop.deliver([cb = std::move(cb), e = self->writeError_] { cb(e); });
      return;
    }
    // Which tensors each channel carries is known once the handshake is
    // done (submitWrite checks again then).
    Error e = wf::checkOutgoing(message, self->ctx_->limits());
    if (e.ok() &&
        self->pendingOps_ >= self->ctx_->limits().maxPendingOperations) {
      e = Error(Code::kResourceExhausted,
                self->id_ + ": too many pending operations (limit " +
                    std::to_string(self->ctx_->limits().maxPendingOperations) +
                    ")");
    }
    if (!e.ok()) {
      loop.deliver([cb = std::move(cb),
                    e = e.withContext(self->id_ + ": write")] { cb(e); });
      return;
    }
    auto op = std::make_shared<WriteOp>();
    op->message = std::move(message);
    op->cb = std::move(cb);
    ++self->pendingOps_;
    if (self->state_ == State::kEstablished) {
      self->submitWrite(op);
    } else {
      self->queuedWrites_.push_back(std::move(op));
    }
  });
}

}  // namespace trellis::transport
