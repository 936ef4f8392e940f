#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <string>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <unordered_set>
#include <vector>

#include <uv.h>

#include <trellis/core/logging.h>
#include <trellis/core/spin.h>
#include <trellis/transport/shm/connection.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/shm/ring.h>
#include <trellis/transport/shm/segment.h>
#include <trellis/transport/transport.h>

namespace trellis::transport::shm {

namespace {

constexpr std::string_view kScheme = "shm://";
constexpr size_t kMaxNameBytes = 100;
constexpr int kBacklog = 4096;
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

std::atomic<uint64_t> nameCounter{0};

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

class ShmListener final : public ConnectionListener {
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

class ShmTransport final : public Transport {
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
