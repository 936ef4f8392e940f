#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <mutex>
#include <sched.h>
#include <string>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <unordered_set>
#include <vector>

#include <uv.h>

#include <trellis/core/logging.h>
#include <trellis/core/spin.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/shm/ring.h>

namespace trellis::transport::shm {

namespace {

constexpr std::string_view kScheme = "shm://";
constexpr size_t kMaxNameBytes = 100;
constexpr int kBacklog = 4096;
// Setup and reply messages: ring.h.
constexpr size_t kMaxFds = 4;
// Bytes one connection moves per direction per loop iteration, so that a
// stream of large messages does not starve the loop's other handles.
constexpr size_t kBurstBytes = size_t{8} << 20;
constexpr auto kConnectRetry = std::chrono::milliseconds(2);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

std::atomic<uint64_t> nameCounter{0};

void closeFd(int& fd) {
  if (fd >= 0) {
    ::close(fd);
    fd = -1;
  }
}

bool validName(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return false;
  }
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
  });
}

// "shm://NAME" -> NAME; "shm://" -> "" (listen only: pick one).
Error parseAddress(const std::string& address, bool allowEmpty,
                   std::string* name) {
  if (address.compare(0, kScheme.size(), kScheme) != 0) {
    return Error::invalidArgument("bad shm address '" + address +
                                  "': missing shm:// scheme");
  }
  *name = address.substr(kScheme.size());
  if (name->empty() && allowEmpty) {
    return Error();
  }
  if (!validName(*name)) {
    return Error::invalidArgument(
        "bad shm address '" + address + "': the name must be 1-" +
        std::to_string(kMaxNameBytes) + " characters from [A-Za-z0-9._-]");
  }
  return Error();
}

socklen_t abstractAddress(const std::string& name, sockaddr_un* sa) {
  std::memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  // Leading NUL: Linux abstract namespace, no file, gone with the socket.
  std::memcpy(sa->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                name.size());
}

bool isEventFd(int fd) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  char target[64] = {0};
  const ssize_t n = ::readlink(path, target, sizeof(target) - 1);
  return n > 0 && std::string_view(target, static_cast<size_t>(n)) ==
                      "anon_inode:[eventfd]";
}

void ringDoorbell(int fd) {
  const uint64_t one = 1;
  // EAGAIN only if the counter would overflow: the peer is already woken.
  [[maybe_unused]] const ssize_t r = ::write(fd, &one, sizeof(one));
}

Error sendWithFds(int sock, const uint8_t* data, size_t len, const int* fds,
                  size_t nfds) {
  iovec iov{const_cast<uint8_t*>(data), len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {0};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0) {
    return Error::fromErrno(errno, "shm setup: sendmsg");
  }
  if (static_cast<size_t>(n) != len) {
    // A fresh UNIX socket always has room for a few bytes.
    return Error::connection("shm setup: short sendmsg");
  }
  return Error();
}

struct ListenState;

class ShmConnection : public Connection,
                      public std::enable_shared_from_this<ShmConnection> {
 public:
  using SetupCallback = Transport::ConnectCallback;

  ShmConnection(Loop& loop, const Options& opts, bool connector,
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

  ~ShmConnection() override { releaseResources(); }

  void retain() { self_ = shared_from_this(); }

  // ---- setup --------------------------------------------------------------

  void startConnect(const std::string& name, SetupCallback cb) {
    setupCb_ = std::move(cb);
    name_ = name;
    startSetupTimer();
    tryConnect();
  }

  void startAccept(int fd, SetupCallback cb) {
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

  // ---- Connection ---------------------------------------------------------

  void startReading(ReadSink* sink) override {
    if (state_ == State::kClosed) {
      return;
    }
    sink_ = sink;
    reading_ = true;
    wake();
  }

  void stopReading() override { reading_ = false; }

  void write(const IoBuf* bufs, size_t n, WriteCallback cb) override {
    Error e = writeError();
    if (e.ok() && writes_.empty()) {
      size_t index = 0;
      size_t offset = 0;
      e = push(bufs, n, &index, &offset);
      if (e.ok() && index == n) {
        loop_.defer([cb = std::move(cb)] { cb(Error()); });
        return;
      }
      if (e.ok()) {
        WriteOp op;
        op.bufs.assign(bufs + index, bufs + n);
        op.offset = offset;
        op.cb = std::move(cb);
        writes_.push_back(std::move(op));
        wake();
        return;
      }
      fail(e);
    } else if (e.ok()) {
      WriteOp op;
      op.bufs.assign(bufs, bufs + n);
      op.cb = std::move(cb);
      writes_.push_back(std::move(op));
      wake();
      return;
    }
    loop_.defer([cb = std::move(cb), e] { cb(e); });
  }

  void close() override {
    if (state_ == State::kClosed) {
      return;
    }
    state_ = State::kClosed;
    sink_ = nullptr;
    reading_ = false;
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

  std::string peerAddress() const override { return peer_; }

 private:
  enum class State { kConnecting, kAwaitReply, kAwaitSetup, kOpen, kClosed };

  struct WriteOp {
    std::vector<IoBuf> bufs;
    size_t index = 0;
    size_t offset = 0;
    WriteCallback cb;
  };

  // ---- setup --------------------------------------------------------------

  void startSetupTimer() {
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

  void cancelTimers() {
    if (setupTimer_ != nullptr) {
      setupTimer_->cancel();
      setupTimer_ = nullptr;
    }
    if (retryTimer_ != nullptr) {
      retryTimer_->cancel();
      retryTimer_ = nullptr;
    }
  }

  void tryConnect() {
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
    if (Error e = createSegment(); !e.ok()) {
      failSetup(e);
      return;
    }
    uint8_t msg[kSetupBytes];
    encodeSetup(opts_.ringBytes, msg);
    const int fds[2] = {memfd_, myEfd_};
    Error e = sendWithFds(sock_, msg, sizeof(msg), fds, 2);
    closeFd(memfd_);  // the mapping and the peer's copy keep it alive
    if (!e.ok()) {
      failSetup(e.withContext("connect to " + peer_));
      return;
    }
    state_ = State::kAwaitReply;
    startSocketPoll();
  }

  Error createSegment() {
    const size_t total = segmentBytes(opts_.ringBytes);
    memfd_ = ::memfd_create("trellis-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd_ < 0) {
      return Error::fromErrno(errno, "shm: memfd_create");
    }
    if (::ftruncate(memfd_, static_cast<off_t>(total)) != 0) {
      return Error::fromErrno(errno, "shm: ftruncate");
    }
    // The acceptor refuses a segment that could shrink under its mapping
    // (which would turn its accesses into SIGBUS).
    if (::fcntl(memfd_, F_ADD_SEALS,
                F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      return Error::fromErrno(errno, "shm: seal memfd");
    }
    void* p =
        ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (p == MAP_FAILED) {
      return Error::fromErrno(errno, "shm: mmap");
    }
    map_ = static_cast<char*>(p);
    mapBytes_ = total;
    ringBytes_ = opts_.ringBytes;
    writeSegmentHeader(map_, opts_.ringBytes);
    myEfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (myEfd_ < 0) {
      return Error::fromErrno(errno, "shm: eventfd");
    }
    return Error();
  }

  void startSocketPoll() {
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

  // Reads up to want - got bytes of a setup message, collecting fds.
  // Returns false on EOF/error (then *error is set); true otherwise.
  bool receive(size_t want, Error* error) {
    iovec iov{setupBuf_ + setupGot_, want - setupGot_};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(sock_, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) {
        return true;
      }
      *error = Error::fromErrno(errno, "shm setup with " + peer_);
      return false;
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          rxFds_.push_back(fd);
        }
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      *error = Error::protocol("shm setup with " + peer_ +
                               ": too many descriptors sent");
      return false;
    }
    if (n == 0) {
      *error = Error::connection("shm setup with " + peer_ +
                                 ": peer closed the socket");
      return false;
    }
    setupGot_ += static_cast<size_t>(n);
    return true;
  }

  void closeReceivedFds() {
    for (int& fd : rxFds_) {
      closeFd(fd);
    }
    rxFds_.clear();
  }

  void onSocket(int status, int events) {
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
    } else if (receive(want, &e) && setupGot_ < want) {
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
  Error finishAccept() {
    const std::string who = "shm setup from " + peer_;
    uint64_t ring = 0;
    if (Error e = decodeSetup(setupBuf_, who, &ring); !e.ok()) {
      return e;
    }
    if (rxFds_.size() != 2) {
      return Error::protocol(who + ": expected 2 descriptors, got " +
                             std::to_string(rxFds_.size()));
    }
    const int memfd = rxFds_[0];
    const size_t total = segmentBytes(static_cast<size_t>(ring));
    struct stat st;
    if (::fstat(memfd, &st) != 0 || !S_ISREG(st.st_mode)) {
      return Error::protocol(who + ": the segment descriptor is not a file");
    }
    if (static_cast<uint64_t>(st.st_size) != total) {
      return Error::protocol(who + ": segment has " +
                             std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(total));
    }
    const int seals = ::fcntl(memfd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
                         (F_SEAL_SHRINK | F_SEAL_GROW)) {
      return Error::protocol(who +
                             ": segment is not a memfd sealed against "
                             "resizing");
    }
    if (!isEventFd(rxFds_[1])) {
      return Error::protocol(who +
                             ": the wake-up descriptor is not an "
                             "eventfd");
    }
    void* p =
        ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED) {
      return Error::fromErrno(errno, who + ": mmap");
    }
    map_ = static_cast<char*>(p);
    mapBytes_ = total;
    ringBytes_ = static_cast<size_t>(ring);
    if (Error e = checkSegmentHeader(map_, ring, who); !e.ok()) {
      return e;
    }
    myEfd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (myEfd_ < 0) {
      return Error::fromErrno(errno, "shm: eventfd");
    }
    peerEfd_ = rxFds_[1];
    rxFds_.pop_back();
    uint8_t reply[kReplyBytes];
    encodeReply(reply);
    return sendWithFds(sock_, reply, sizeof(reply), &myEfd_, 1)
        .withContext(who);
  }

  Error finishConnect() {
    const std::string who = "shm setup with " + peer_;
    uint8_t reply[kReplyBytes];
    std::memcpy(reply, setupBuf_, kReplyBytes);
    if (Error e = decodeReply(reply, who); !e.ok()) {
      return e;
    }
    if (rxFds_.size() != 1 || !isEventFd(rxFds_[0])) {
      return Error::protocol(who + ": reply does not carry one eventfd");
    }
    peerEfd_ = rxFds_[0];
    rxFds_.clear();
    return Error();
  }

  void failSetup(const Error& e) {
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

  void open() {
    cancelTimers();
    const int txRing = connector_ ? 0 : 1;
    const int rxRing = 1 - txRing;
    tx_ = RingWriter(
        reinterpret_cast<RingControl*>(map_ + kRingControlOffset[txRing]),
        map_ + ringDataOffset(txRing, ringBytes_), ringBytes_);
    rx_ = RingReader(
        reinterpret_cast<RingControl*>(map_ + kRingControlOffset[rxRing]),
        map_ + ringDataOffset(rxRing, ringBytes_), ringBytes_);
    uv_poll_init(loop_.uv(), &efdPoll_, myEfd_);
    efdPoll_.data = this;
    efdPollInit_ = true;
    ++openHandles_;
    uv_poll_start(&efdPoll_, UV_READABLE, [](uv_poll_t* h, int, int) {
      static_cast<ShmConnection*>(h->data)->onDoorbell();
    });
    state_ = State::kOpen;
  }

  // ---- data path ------------------------------------------------------------

  Error writeError() const {
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
  Error push(const IoBuf* bufs, size_t n, size_t* index, size_t* offset) {
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
      progress_ = true;
      if (tx_.takeConsumerWaiting()) {
        ringDoorbell(peerEfd_);
      }
    }
    return Error();
  }

  void flushWrites() {
    while (!writes_.empty() && state_ == State::kOpen && !life_.failed()) {
      WriteOp& op = writes_.front();
      Error e = push(op.bufs.data(), op.bufs.size(), &op.index, &op.offset);
      if (!e.ok()) {
        fail(e);
        return;
      }
      if (op.index < op.bufs.size()) {
        return;  // ring full
      }
      auto cb = std::move(op.cb);
      writes_.pop_front();
      cb(Error());  // may write or close re-entrantly
    }
  }

  void drainReads() {
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
          sink->onReadError(Error::connection("shm peer " + peer_ +
                                              " closed the connection"));
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
      progress_ = true;
      if (rx_.takeProducerWaiting()) {
        ringDoorbell(peerEfd_);
      }
      sink_->onRead(n);  // may stop reading, write or close re-entrantly
    }
  }

  // Sticky failure of an open connection (a ProtocolError from the rings):
  // the owner hears of it through its ReadSink and closes.
  void fail(const Error& e) {
    life_.fail(e.withContext("shm connection with " + peer_), [&] {
      TRELLIS_LOG_WARN("{}", life_.error().what());
      failWrites(life_.error());
      wake();
    });
  }

  void failWrites(const Error& e) {
    auto ops = std::move(writes_);
    writes_.clear();
    for (auto& op : ops) {
      loop_.defer([cb = std::move(op.cb), e] { cb(e); });
    }
  }

  void wake() {
    if (state_ != State::kOpen) {
      return;
    }
    hotUntil_ = uv_hrtime() + spinNs_;
    startIdle();
  }

  void startIdle() {
    if (!idleActive_) {
      idleActive_ = true;
      uv_idle_start(&idle_, [](uv_idle_t* h) {
        static_cast<ShmConnection*>(h->data)->pump();
      });
    }
  }

  void stopIdle() {
    if (idleActive_) {
      idleActive_ = false;
      uv_idle_stop(&idle_);
    }
  }

  void onDoorbell() {
    uint64_t v;
    [[maybe_unused]] const ssize_t r = ::read(myEfd_, &v, sizeof(v));
    if (state_ != State::kOpen) {
      return;
    }
    rx_.setWaiting(false);
    tx_.setWaiting(false);
    hotUntil_ = uv_hrtime() + spinNs_;
    pump();
  }

  void onSocketOpen(int status, int events) {
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
  void pump() {
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
    const bool wantTx = !writes_.empty();
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
    if (wantRx) {
      rx_.setWaiting(true);
    }
    if (wantTx) {
      tx_.setWaiting(true);
    }
    size_t avail = 0;
    size_t free = 0;
    const bool ready = (wantRx && (!rx_.available(&avail).ok() || avail > 0)) ||
                       (wantTx && (!tx_.space(&free).ok() || free > 0));
    if (ready) {
      rx_.setWaiting(false);
      tx_.setWaiting(false);
      startIdle();
      return;
    }
    stopIdle();
  }

  // ---- teardown ---------------------------------------------------------

  void handleClosed() {
    if (--openHandles_ > 0) {
      return;
    }
    releaseResources();
    auto keep = std::move(self_);
  }

  void releaseResources() {
    if (map_ != nullptr) {
      ::munmap(map_, mapBytes_);
      map_ = nullptr;
    }
    closeReceivedFds();
    closeFd(memfd_);
    closeFd(sock_);
    closeFd(myEfd_);
    closeFd(peerEfd_);
  }

  Loop& loop_;
  const Options opts_;
  const bool connector_;
  std::string peer_;
  std::string name_;
  uint64_t spinNs_ = 0;
  State state_ = State::kConnecting;
  SetupCallback setupCb_;
  LoopTimer* setupTimer_ = nullptr;
  LoopTimer* retryTimer_ = nullptr;

  int sock_ = -1;
  int memfd_ = -1;
  int myEfd_ = -1;
  int peerEfd_ = -1;
  char* map_ = nullptr;
  size_t mapBytes_ = 0;
  size_t ringBytes_ = 0;
  uint8_t setupBuf_[kSetupBytes] = {0};
  size_t setupGot_ = 0;
  std::vector<int> rxFds_;

  uv_idle_t idle_;
  uv_poll_t sockPoll_;
  uv_poll_t efdPoll_;
  bool sockPollInit_ = false;
  bool efdPollInit_ = false;
  int openHandles_ = 0;
  bool idleActive_ = false;

  RingWriter tx_;
  RingReader rx_;
  std::deque<WriteOp> writes_;
  ReadSink* sink_ = nullptr;
  bool reading_ = false;
  bool peerGone_ = false;
  bool readErrorDelivered_ = false;
  Lifecycle life_;
  bool pumping_ = false;
  bool progress_ = false;
  uint64_t hotUntil_ = 0;
  std::shared_ptr<ShmConnection> self_;
};

// Shared by a listener and its connections still in setup, so that either
// may go first.
struct ListenState {
  ListenState(Loop& l, Options o, Transport::AcceptCallback c)
      : loop(l), opts(o), cb(std::move(c)) {}
  Loop& loop;
  Options opts;
  Transport::AcceptCallback cb;
  std::string address;
  bool closed = false;
  std::unordered_set<std::shared_ptr<ShmConnection>> pending;
};

class ShmListener : public ConnectionListener {
 public:
  explicit ShmListener(std::shared_ptr<ListenState> state)
      : state_(std::move(state)) {}
  ~ShmListener() override { close(); }

  Error bind(const std::string& name) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd_ < 0) {
      return Error::fromErrno(errno, "shm listen: socket");
    }
    sockaddr_un sa;
    const socklen_t len = abstractAddress(name, &sa);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) != 0 ||
        ::listen(fd_, kBacklog) != 0) {
      const int err = errno;
      closeFd(fd_);
      return Error::fromErrno(err, "listen on shm://" + name);
    }
    state_->address = std::string(kScheme) + name;
    poll_ = new uv_poll_t;
    uv_poll_init(state_->loop.uv(), poll_, fd_);
    poll_->data = this;
    startPolling();
    return Error();
  }

  std::string address() const override { return state_->address; }

  void close() override {
    if (state_->closed) {
      return;
    }
    state_->closed = true;
    if (backoff_ != nullptr) {
      backoff_->cancel();
      backoff_ = nullptr;
    }
    if (poll_ != nullptr) {
      poll_->data = nullptr;
      uv_close(reinterpret_cast<uv_handle_t*>(poll_),
               [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
      poll_ = nullptr;
    }
    closeFd(fd_);  // epoll forgot it in uv_close
    auto pending = std::move(state_->pending);
    state_->pending.clear();
    for (auto& c : pending) {
      c->close();
    }
  }

 private:
  void startPolling() {
    uv_poll_start(poll_, UV_READABLE, [](uv_poll_t* h, int status, int) {
      if (h->data != nullptr) {
        static_cast<ShmListener*>(h->data)->onReadable(status);
      }
    });
  }

  void onReadable(int status) {
    if (status < 0) {
      TRELLIS_LOG_WARN("shm listener {}: {}", state_->address,
                       uv_strerror(status));
      return;
    }
    while (!state_->closed) {
      const int fd =
          ::accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EAGAIN || err == EINTR || err == ECONNABORTED) {
          return;
        }
        // Out of descriptors: this connection waits in the backlog; pause
        // instead of spinning on a socket that stays readable.
        TRELLIS_LOG_WARN("shm listener {}: accept: {}", state_->address,
                         std::strerror(err));
        uv_poll_stop(poll_);
        backoff_ = LoopTimer::start(state_->loop, kAcceptBackoff, [this] {
          backoff_ = nullptr;
          startPolling();
        });
        return;
      }
      auto conn = std::make_shared<ShmConnection>(state_->loop, state_->opts,
                                                  false, state_->address);
      conn->retain();
      state_->pending.insert(conn);
      std::weak_ptr<ListenState> weak = state_;
      std::weak_ptr<ShmConnection> weakConn = conn;
      conn->startAccept(
          fd, [weak, weakConn](const Error& e, std::shared_ptr<Connection> c) {
            auto st = weak.lock();
            if (!st) {
              return;
            }
            if (auto sc = weakConn.lock()) {
              st->pending.erase(sc);
            }
            if (!e.ok()) {
              TRELLIS_LOG_WARN("shm listener {}: {}", st->address, e.what());
              return;
            }
            if (st->closed) {
              c->close();
              return;
            }
            st->cb(Error(), std::move(c));
          });
    }
  }

  std::shared_ptr<ListenState> state_;
  int fd_ = -1;
  uv_poll_t* poll_ = nullptr;
  LoopTimer* backoff_ = nullptr;
};

Error probe() {
  const int memfd =
      ::memfd_create("trellis-shm-probe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memfd < 0) {
    return Error::fromErrno(errno, "shm not viable: memfd_create");
  }
  Error e;
  void* p = MAP_FAILED;
  if (::ftruncate(memfd, 4096) != 0) {
    e = Error::fromErrno(errno, "shm not viable: ftruncate of a memfd");
  } else if (::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    e = Error::fromErrno(errno, "shm not viable: sealing a memfd");
  } else if ((p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED,
                         memfd, 0)) == MAP_FAILED) {
    e = Error::fromErrno(errno, "shm not viable: mmap of a memfd");
  } else {
    ::munmap(p, 4096);
  }
  ::close(memfd);
  if (!e.ok()) {
    return e;
  }
  const int efd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd < 0) {
    return Error::fromErrno(errno, "shm not viable: eventfd");
  }
  const bool recognised = isEventFd(efd);
  ::close(efd);
  if (!recognised) {
    return Error(Code::kFailedPrecondition,
                 "shm not viable: /proc/self/fd does not identify eventfds "
                 "(is /proc mounted?)");
  }
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) {
    return Error::fromErrno(errno, "shm not viable: UNIX socket");
  }
  ::close(s);
  return Error();
}

class ShmTransport : public Transport {
 public:
  explicit ShmTransport(Options opts) : opts_(opts) {}

  std::string name() const override { return "shm"; }

  Error viable() const override {
    std::call_once(probed_, [this] {
      if (!validRingBytes(opts_.ringBytes)) {
        probe_ = Error::invalidArgument(
            "shm::Options::ringBytes = " + std::to_string(opts_.ringBytes) +
            " is not a power of two in [" + std::to_string(kMinRingBytes) +
            ", " + std::to_string(kMaxRingBytes) + "]");
      } else {
        probe_ = probe();
      }
      if (!probe_.ok()) {
        TRELLIS_LOG_INFO("{}", probe_.what());
      }
    });
    return probe_;
  }

  bool sameHostOnly() const override { return true; }

  Error listen(Loop& loop, const std::string& address, AcceptCallback cb,
               std::unique_ptr<ConnectionListener>* out) override {
    if (Error e = viable(); !e.ok()) {
      return e;
    }
    std::string name;
    if (Error e = parseAddress(address, true, &name); !e.ok()) {
      return e;
    }
    if (name.empty()) {
      name = "trellis-shm-" + std::to_string(::getpid()) + "-" +
             std::to_string(nameCounter.fetch_add(1));
    }
    auto state = std::make_shared<ListenState>(loop, opts_, std::move(cb));
    auto l = std::make_unique<ShmListener>(state);
    if (Error e = l->bind(name); !e.ok()) {
      return e;
    }
    *out = std::move(l);
    return Error();
  }

  void connect(Loop& loop, const std::string& address,
               ConnectCallback cb) override {
    std::string name;
    Error e = viable();
    if (e.ok()) {
      e = parseAddress(address, false, &name);
    }
    if (!e.ok()) {
      loop.defer([cb = std::move(cb), e] { cb(e, nullptr); });
      return;
    }
    auto conn = std::make_shared<ShmConnection>(loop, opts_, true, address);
    conn->retain();
    conn->startConnect(name, std::move(cb));
  }

 private:
  const Options opts_;
  mutable std::once_flag probed_;
  mutable Error probe_;
};

}  // namespace

std::shared_ptr<Transport> create(Options options) {
  return std::make_shared<ShmTransport>(options);
}

std::chrono::microseconds pollingTime(const Options& options) {
  if (options.spin.has_value()) {
    return std::max(*options.spin, std::chrono::microseconds(0));
  }
  return 2 *
         std::chrono::duration_cast<std::chrono::microseconds>(spinBudget());
}

}  // namespace trellis::transport::shm
