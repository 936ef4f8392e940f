#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/shm/connection.h>

namespace trellis::transport::shm {

namespace {

// Bytes one connection moves per direction per loop iteration, so that a
// stream of large messages does not starve the loop's other handles.
constexpr size_t kBurstBytes = size_t{8} << 20;
constexpr auto kConnectRetry = std::chrono::milliseconds(2);

}  // namespace

ShmConnection::ShmConnection(Loop& loop, const Options& opts, bool connector,
                             std::string peer)
    : loop_(loop),
      opts_(opts),
      connector_(connector),
      peer_(std::move(peer)),
      life_(loop) {
  spinNs_ = static_cast<uint64_t>(
      std::chrono::nanoseconds(pollingTime(opts)).count());  // never < 0
  uv_idle_init(loop.uv(), &idle_);
  idle_.data = this;
  ++openHandles_;
}

void ShmConnection::startConnect(const std::string& name, SetupCallback cb) {
  setupCb_ = std::move(cb);
  name_ = name;
  startSetupTimer();
  tryConnect();
}

void ShmConnection::startAccept(int fd, SetupCallback cb) {
  setupCb_ = std::move(cb);
  sock_ = fd;
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    peer_ += " (pid " + std::to_string(cred.pid) + ")";
  }
  startSetupTimer();
  state_ = State::kAwaitSetup;
  startSocketPoll();
}

void ShmConnection::startReading(ReadSink* sink) {
  if (state_ == State::kClosed) {
    return;
  }
  sink_ = sink;
  reading_ = true;
  wake();
}

void ShmConnection::write(const IoBuf* bufs, size_t n, WriteCallback cb) {
  Error e = writeError();
  if (!e.ok()) {
    loop_.defer([cb = std::move(cb), e] { cb(e); });
    return;
  }
  bool queued = false;
  {
    MutexLock lock(txMu_);
    size_t index = 0;
    size_t offset = 0;
    if (writes_.empty()) {
      e = push(bufs, n, &index, &offset);
    }
    if (e.ok() && index < n) {
      WriteOp op;
      op.bufs.assign(bufs + index, bufs + n);
      op.offset = offset;
      op.cb = std::move(cb);
      writes_.push_back(std::move(op));
      queued = true;
    }
  }
  if (queued) {
    ++queuedWrites_;
  }
  if (!e.ok()) {
    fail(e);  // the ring's indices were bad
    loop_.defer([cb = std::move(cb), e] { cb(e); });
  } else if (queued) {
    wake();
  } else {
    loop_.defer([cb = std::move(cb)] { cb(Error()); });
  }
}

bool ShmConnection::writeNow(const IoBuf* bufs, size_t n) {
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    total += bufs[i].length;
  }
  MutexLock lock(txMu_);
  if (!txOpen_ || !writes_.empty()) {
    return false;
  }
  size_t free = 0;
  if (!tx_.space(&free).ok() || free < total) {
    // Bad indices are the loop's to report (its next pump finds them).
    return false;
  }
  for (size_t i = 0; i < n; ++i) {
    [[maybe_unused]] const size_t wrote =
        tx_.write(bufs[i].data, bufs[i].length);
    TRELLIS_DCHECK(wrote == bufs[i].length, "shm ring lost room mid-write");
  }
  return true;
}

void ShmConnection::close() {
  if (state_ == State::kClosed) {
    return;
  }
  state_ = State::kClosed;
  sink_ = nullptr;
  reading_ = false;
  // The peer sees the end now, not once the handles have closed: a pipe
  // fires its write callbacks (letting the caller reuse a buffer a cma
  // copy may still read) right after this, and the reader tells a copy
  // that overlapped that from the socket's end (Connection::peerHasClosed).
  if (sock_ >= 0) {
    ::shutdown(sock_, SHUT_RDWR);
  }
  cancelTimers();
  failWrites(Error::connection("shm connection to " + peer_ + " closed"));
  if (setupCb_ && connector_) {
    loop_.defer([cb = std::move(setupCb_), peer = peer_] {
      cb(Error::cancelled("connect to " + peer + " cancelled"), nullptr);
    });
  }
  setupCb_ = nullptr;
  auto onClosed = [](uv_handle_t* h) {
    static_cast<ShmConnection*>(h->data)->handleClosed();
  };
  uv_idle_stop(&idle_);
  uv_close(reinterpret_cast<uv_handle_t*>(&idle_), onClosed);
  if (sockPollInit_) {
    uv_close(reinterpret_cast<uv_handle_t*>(&sockPoll_), onClosed);
  }
  if (efdPollInit_) {
    uv_close(reinterpret_cast<uv_handle_t*>(&efdPoll_), onClosed);
  }
}

void ShmConnection::startSetupTimer() {
  std::weak_ptr<ShmConnection> weak = shared_from_this();
  const auto limit = opts_.setupTimeout;
  setupTimer_ = LoopTimer::start(loop_, limit, [weak, limit] {
    if (auto self = weak.lock()) {
      self->setupTimer_ = nullptr;
      self->failSetup(Error::timeout("shm setup with " + self->peer_ +
                                     " did not complete within " +
                                     formatDuration(limit)));
    }
  });
}

void ShmConnection::cancelTimers() {
  if (setupTimer_ != nullptr) {
    setupTimer_->cancel();
    setupTimer_ = nullptr;
  }
  if (retryTimer_ != nullptr) {
    retryTimer_->cancel();
    retryTimer_ = nullptr;
  }
}

void ShmConnection::tryConnect() {
  sock_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock_ < 0) {
    failSetup(Error::fromErrno(errno, "shm connect: socket"));
    return;
  }
  sockaddr_un sa;
  const socklen_t len = abstractAddress(name_, &sa);
  if (::connect(sock_, reinterpret_cast<sockaddr*>(&sa), len) != 0) {
    const int err = errno;
    closeFd(sock_);
    if (err == EAGAIN) {
      // The listener's backlog is full: it is alive and accepting.
      std::weak_ptr<ShmConnection> weak = shared_from_this();
      retryTimer_ = LoopTimer::start(loop_, kConnectRetry, [weak] {
        if (auto self = weak.lock()) {
          self->retryTimer_ = nullptr;
          self->tryConnect();
        }
      });
      return;
    }
    failSetup(Error::fromErrno(err, "connect to " + peer_));
    return;
  }
  int memfd = -1;
  if (Error e = createSegment(opts_.ringBytes, &seg_, &memfd); !e.ok()) {
    closeFd(memfd);
    failSetup(e);
    return;
  }
  uint8_t msg[kSetupBytes];
  encodeSetup(opts_.ringBytes, msg);
  const int fds[2] = {memfd, seg_.myEventFd()};
  Error e = sendWithFds(sock_, msg, sizeof(msg), fds, 2);
  closeFd(memfd);  // the mapping and the peer's copy keep it alive
  if (!e.ok()) {
    failSetup(e.withContext("connect to " + peer_));
    return;
  }
  state_ = State::kAwaitReply;
  startSocketPoll();
}

void ShmConnection::startSocketPoll() {
  uv_poll_init(loop_.uv(), &sockPoll_, sock_);
  sockPoll_.data = this;
  sockPollInit_ = true;
  ++openHandles_;
  uv_poll_start(&sockPoll_, UV_READABLE | UV_DISCONNECT,
                [](uv_poll_t* h, int status, int events) {
                  static_cast<ShmConnection*>(h->data)->onSocket(status,
                                                                 events);
                });
}

void ShmConnection::closeReceivedFds() {
  for (int& fd : rxFds_) {
    closeFd(fd);
  }
  rxFds_.clear();
}

void ShmConnection::onSocket(int status, int events) {
  if (state_ == State::kOpen) {
    onSocketOpen(status, events);
    return;
  }
  if (state_ != State::kAwaitReply && state_ != State::kAwaitSetup) {
    return;
  }
  const bool acceptor = state_ == State::kAwaitSetup;
  const size_t want = acceptor ? kSetupBytes : kReplyBytes;
  Error e;
  if (status < 0) {
    e = Error::fromErrno(-status, "shm setup with " + peer_);
  } else if (receiveWithFds(sock_, setupBuf_, want, &setupGot_, &rxFds_, peer_,
                            &e) &&
             setupGot_ < want) {
    return;  // more to come
  }
  if (e.ok()) {
    e = acceptor ? finishAccept() : finishConnect();
  }
  closeReceivedFds();
  if (!e.ok()) {
    failSetup(e);
    return;
  }
  open();
  auto cb = std::move(setupCb_);
  setupCb_ = nullptr;
  cb(Error(), shared_from_this());
}

// Everything here comes from an untrusted process.
Error ShmConnection::finishAccept() {
  const std::string who = "shm setup from " + peer_;
  if (Error e = acceptSegment(setupBuf_, &rxFds_, who, &seg_); !e.ok()) {
    return e;
  }
  uint8_t reply[kReplyBytes];
  encodeReply(reply);
  const int efd = seg_.myEventFd();
  return sendWithFds(sock_, reply, sizeof(reply), &efd, 1).withContext(who);
}

Error ShmConnection::finishConnect() {
  uint8_t reply[kReplyBytes];
  std::memcpy(reply, setupBuf_, kReplyBytes);
  return completeSegment(reply, &rxFds_, "shm setup with " + peer_, &seg_);
}

void ShmConnection::failSetup(const Error& e) {
  if (state_ == State::kClosed) {
    return;
  }
  auto cb = std::move(setupCb_);
  setupCb_ = nullptr;
  close();
  if (cb) {
    loop_.defer([cb = std::move(cb), e] { cb(e, nullptr); });
  }
}

void ShmConnection::open() {
  cancelTimers();
  {
    MutexLock lock(txMu_);
    tx_ = seg_.writer(connector_);
    tx_.setDoorbell(seg_.peerEventFd());
    txOpen_ = true;
  }
  rx_ = seg_.reader(connector_);
  rx_.setDoorbell(seg_.peerEventFd());
  uv_poll_init(loop_.uv(), &efdPoll_, seg_.myEventFd());
  efdPoll_.data = this;
  efdPollInit_ = true;
  ++openHandles_;
  uv_poll_start(&efdPoll_, UV_READABLE, [](uv_poll_t* h, int, int) {
    static_cast<ShmConnection*>(h->data)->onDoorbell();
  });
  state_ = State::kOpen;
}

Error ShmConnection::writeError() const {
  if (life_.failed()) {
    return life_.error();
  }
  if (state_ != State::kOpen) {
    return Error::connection("write on a closed shm connection");
  }
  if (peerGone_) {
    return Error::connection("shm peer " + peer_ + " closed the connection");
  }
  return Error();
}

// Copies bufs[*index..n) (from *offset in the first) into the ring.
Error ShmConnection::push(const IoBuf* bufs, size_t n, size_t* index,
                          size_t* offset) {
  size_t free = 0;
  Error e = tx_.space(&free);
  if (!e.ok()) {
    return e;
  }
  size_t moved = 0;
  bool refreshed = false;
  while (*index < n && moved < kBurstBytes) {
    const IoBuf& b = bufs[*index];
    if (*offset == b.length) {
      ++*index;
      *offset = 0;
      continue;
    }
    if (free == 0) {
      // The consumer may have freed space meanwhile; look once more.
      if (refreshed) {
        break;
      }
      refreshed = true;
      if (Error e2 = tx_.space(&free); !e2.ok()) {
        return e2;
      }
      continue;
    }
    const size_t wrote = tx_.write(static_cast<const char*>(b.data) + *offset,
                                   std::min(b.length - *offset, free));
    *offset += wrote;
    free -= wrote;
    moved += wrote;
    refreshed = false;
  }
  if (moved > 0) {
    progress_ = true;  // the ring woke a waiting consumer chunk by chunk
  }
  return Error();
}

void ShmConnection::flushWrites() {
  // Nothing queued: no lock. A polling loop that took txMu_ on every pass
  // found it held by a thread in writeNow() and slept on it (27 % of the
  // trainer loop's sleeps in dist_autograd_bench, perf sched_switch).
  while (queuedWrites_ > 0 && state_ == State::kOpen && !life_.failed()) {
    WriteCallback cb;
    Error e;
    {
      MutexLock lock(txMu_);
      if (writes_.empty()) {
        return;
      }
      WriteOp& op = writes_.front();
      e = push(op.bufs.data(), op.bufs.size(), &op.index, &op.offset);
      if (e.ok()) {
        if (op.index < op.bufs.size()) {
          return;  // ring full
        }
        cb = std::move(op.cb);
        writes_.pop_front();
        --queuedWrites_;
      }
    }
    if (!e.ok()) {
      fail(e);
      return;
    }
    cb(Error());  // may write or close re-entrantly
  }
}

void ShmConnection::drainReads() {
  size_t moved = 0;
  while (reading_ && sink_ != nullptr && state_ == State::kOpen &&
         !life_.failed() && moved < kBurstBytes) {
    size_t avail = 0;
    if (Error e = rx_.available(&avail); !e.ok()) {
      fail(e);
      return;
    }
    if (avail == 0) {
      if (peerGone_ && !readErrorDelivered_) {
        readErrorDelivered_ = true;
        reading_ = false;
        auto* sink = sink_;
        sink->onReadError(
            Error::connection("shm peer " + peer_ + " closed the connection"));
      }
      return;
    }
    char* base = nullptr;
    size_t len = 0;
    sink_->readBuffer(&base, &len);
    if (len == 0 || base == nullptr) {
      return;
    }
    const size_t n = rx_.read(base, std::min(len, avail));
    moved += n;
    progress_ = true;  // the ring woke a waiting producer chunk by chunk
    sink_->onRead(n);  // may stop reading, write or close re-entrantly
  }
}

// Sticky failure of an open connection (a ProtocolError from the rings):
// the owner hears of it through its ReadSink and closes.
void ShmConnection::fail(const Error& e) {
  life_.fail(e.withContext("shm connection with " + peer_), [&] {
    TRELLIS_LOG_WARN("{}", life_.error().what());
    failWrites(life_.error());
    wake();
  });
}

void ShmConnection::failWrites(const Error& e) {
  std::deque<WriteOp> ops;
  {
    MutexLock lock(txMu_);
    txOpen_ = false;  // writeNow() too
    ops.swap(writes_);
    queuedWrites_ = 0;
  }
  for (auto& op : ops) {
    loop_.defer([cb = std::move(op.cb), e] { cb(e); });
  }
}

void ShmConnection::wake() {
  if (state_ != State::kOpen) {
    return;
  }
  hotUntil_ = uv_hrtime() + spinNs_;
  startIdle();
}

void ShmConnection::startIdle() {
  if (!idleActive_) {
    idleActive_ = true;
    uv_idle_start(&idle_, [](uv_idle_t* h) {
      static_cast<ShmConnection*>(h->data)->pump();
    });
  }
}

void ShmConnection::stopIdle() {
  if (idleActive_) {
    idleActive_ = false;
    uv_idle_stop(&idle_);
  }
}

void ShmConnection::onDoorbell() {
  uint64_t v;
  [[maybe_unused]] const ssize_t r = ::read(seg_.myEventFd(), &v, sizeof(v));
  if (state_ != State::kOpen) {
    return;
  }
  rx_.setWaiting(false);
  clearTxWaiting();
  hotUntil_ = uv_hrtime() + spinNs_;
  pump();
}

void ShmConnection::onSocketOpen(int status, int events) {
  char byte;
  const ssize_t n = status < 0 ? -1 : ::recv(sock_, &byte, 1, MSG_DONTWAIT);
  if (n < 0 && status >= 0 && (errno == EAGAIN || errno == EINTR) &&
      (events & UV_DISCONNECT) == 0) {
    return;
  }
  uv_poll_stop(&sockPoll_);
  if (n > 0) {
    fail(Error::protocol("unexpected bytes on the shm control socket"));
    return;
  }
  // EOF or reset: the peer closed or died. What it wrote before is still
  // in the ring and is delivered before the error.
  peerGone_ = true;
  failWrites(writeError());
  hotUntil_ = 0;
  startIdle();
}

// Moves bytes both ways, then decides between polling on (hot) and
// sleeping on the eventfd (cold).
void ShmConnection::pump() {
  if (pumping_) {
    return;
  }
  auto self = shared_from_this();
  pumping_ = true;
  progress_ = false;
  if (state_ == State::kOpen && !life_.failed()) {
    flushWrites();
    drainReads();
  }
  pumping_ = false;
  if (state_ != State::kOpen) {
    stopIdle();
    return;
  }
  if (life_.failed()) {
    if (reading_ && sink_ != nullptr && !readErrorDelivered_) {
      readErrorDelivered_ = true;
      reading_ = false;
      sink_->onReadError(life_.error());
    }
    stopIdle();
    return;
  }
  const uint64_t now = uv_hrtime();
  if (progress_) {
    hotUntil_ = now + spinNs_;
  }
  const bool wantRx = reading_ && !readErrorDelivered_;
  const bool wantTx = queuedWrites_ > 0;
  if (!wantRx && !wantTx) {
    stopIdle();
    return;
  }
  if (progress_ || (peerGone_ && wantRx)) {
    startIdle();
    return;
  }
  if (now < hotUntil_) {
    // Polling with nothing to do: let a runnable thread (often the peer
    // we wait for, on a busy machine) have this core for a moment.
    sched_yield();
    startIdle();
    return;
  }
  // Going to sleep: ask to be woken, then look once more, since the peer
  // may have acted just before it could see the request.
  // Each ring: set the flag, then look (the flag's fence orders the two).
  bool ready = false;
  if (wantRx) {
    rx_.setWaiting(true);
    size_t avail = 0;
    ready = !rx_.available(&avail).ok() || avail > 0;
  }
  if (wantTx) {
    MutexLock lock(txMu_);
    tx_.setWaiting(true);
    txWaiting_ = true;
    size_t free = 0;
    ready = ready || !tx_.space(&free).ok() || free > 0;
  }
  if (ready) {
    rx_.setWaiting(false);
    clearTxWaiting();
    startIdle();
    return;
  }
  stopIdle();
}

void ShmConnection::clearTxWaiting() {
  if (txWaiting_) {
    MutexLock lock(txMu_);
    tx_.setWaiting(false);
    txWaiting_ = false;
  }
}

void ShmConnection::handleClosed() {
  if (--openHandles_ > 0) {
    return;
  }
  releaseResources();
  auto keep = std::move(self_);
}

void ShmConnection::releaseResources() {
  seg_.reset();
  closeReceivedFds();
  closeFd(sock_);
}

}  // namespace trellis::transport::shm
