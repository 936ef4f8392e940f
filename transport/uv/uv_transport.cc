#include <cstring>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string>
#include <sys/socket.h>
#include <vector>

#include <uv.h>

#include <trellis/core/logging.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/uv/factory.h>

namespace trellis::transport::uv {

namespace {

constexpr std::string_view kScheme = "uv://";
constexpr int kBacklog = 1024;
constexpr unsigned kKeepAliveSeconds = 10;
constexpr unsigned kUserTimeoutMs = 30000;
// Each read() asks for at most this much, even when the reader's buffer is
// larger. Measured on loopback: 64 KiB reads (one loopback segment) move 1
// to 64 MiB payloads 1.3-2x faster than one read per payload, and raw
// sockets read the same way gain as much (docs/transport.md,
// "Reading"). Our reading of it: the window update that lets the
// sender go on leaves only when a read returns, so a read that drains a
// deep receive queue makes the sender's copy and ours take turns.
constexpr size_t kMaxRead = size_t{64} << 10;

Error uvError(int rc, std::string_view what) {
  // libuv's codes are negated errnos on Unix.
  return Error::fromErrno(-rc, what);
}

// "uv://127.0.0.1:4242" or "uv://[::1]:4242".
Error parseAddress(const std::string& address, sockaddr_storage* out) {
  auto bad = [&](std::string_view why) {
    return Error::invalidArgument("bad uv address '" + address +
                                  "': " + std::string(why) +
                                  " (expected uv://HOST:PORT, IPv6 in [])");
  };
  if (address.compare(0, kScheme.size(), kScheme) != 0) {
    return bad("missing uv:// scheme");
  }
  std::string rest = address.substr(kScheme.size());
  std::string host;
  std::string port;
  bool v6 = false;
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    if (close == std::string::npos || close + 1 >= rest.size() ||
        rest[close + 1] != ':') {
      return bad("unterminated IPv6 literal or missing port");
    }
    host = rest.substr(1, close - 1);
    port = rest.substr(close + 2);
    v6 = true;
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) {
      return bad("missing port");
    }
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return bad("port is not a number");
  }
  const int p = std::stoi(port);
  if (p > 65535) {
    return bad("port out of range");
  }
  std::memset(out, 0, sizeof(*out));
  int rc =
      v6 ? uv_ip6_addr(host.c_str(), p, reinterpret_cast<sockaddr_in6*>(out))
         : uv_ip4_addr(host.c_str(), p, reinterpret_cast<sockaddr_in*>(out));
  if (rc != 0) {
    return bad(v6 ? "not an IPv6 address" : "not an IPv4 address");
  }
  return Error();
}

std::string formatAddress(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    uv_ip6_name(a, host, sizeof(host));
    return std::string(kScheme) + "[" + host +
           "]:" + std::to_string(ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  uv_ip4_name(a, host, sizeof(host));
  return std::string(kScheme) + host + ":" + std::to_string(ntohs(a->sin_port));
}

class UvConnection final : public Connection,
                           public std::enable_shared_from_this<UvConnection> {
 public:
  explicit UvConnection(Loop& loop) : loop_(loop), life_(loop) {
    uv_tcp_init(loop.uv(), &tcp_);
    tcp_.data = this;
  }

  // Keeps itself alive until the handle's close callback.
  void retain() { self_ = shared_from_this(); }

  void configure() {
    uv_tcp_nodelay(&tcp_, 1);
    uv_tcp_keepalive(&tcp_, 1, kKeepAliveSeconds);
    // Bound how long a silently vanished peer (host down, partition) can
    // keep operations pending: idle connections are probed every
    // kKeepAliveSeconds, 3 misses close it; unacknowledged data fails the
    // connection after kUserTimeoutMs. Best effort: failures are ignored.
    uv_os_fd_t fd;
    if (uv_fileno(reinterpret_cast<uv_handle_t*>(&tcp_), &fd) == 0) {
      int interval = static_cast<int>(kKeepAliveSeconds);
      int count = 3;
      unsigned userTimeout = kUserTimeoutMs;
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
      ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeout,
                   sizeof(userTimeout));
    }
    sockaddr_storage ss;
    int len = sizeof(ss);
    if (uv_tcp_getpeername(&tcp_, reinterpret_cast<sockaddr*>(&ss), &len) ==
        0) {
      peer_ = formatAddress(ss);
    }
  }

  uv_tcp_t* tcp() { return &tcp_; }

  void startReading(ReadSink* sink) override {
    if (life_.failed()) {
      return;
    }
    sink_ = sink;
    uv_read_start(reinterpret_cast<uv_stream_t*>(&tcp_), &UvConnection::onAlloc,
                  &UvConnection::onRead);
  }

  void stopReading() override {
    if (!life_.failed()) {
      uv_read_stop(reinterpret_cast<uv_stream_t*>(&tcp_));
    }
  }

  void write(const IoBuf* bufs, size_t n, WriteCallback cb) override {
    if (life_.failed()) {
      loop_.defer([cb = std::move(cb), e = life_.error()] { cb(e); });
      return;
    }
    bufs_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      bufs_[i] =
          uv_buf_init(static_cast<char*>(const_cast<void*>(bufs[i].data)),
                      static_cast<unsigned>(bufs[i].length));
    }
    // uv_buf_t lengths are unsigned int: split anything larger.
    splitLarge(bufs, n);
    auto* stream = reinterpret_cast<uv_stream_t*>(&tcp_);
    uv_buf_t* first = bufs_.data();
    size_t count = bufs_.size();
    const int rc = uv_try_write(stream, first, static_cast<unsigned>(count));
    if (rc >= 0) {
      size_t written = static_cast<size_t>(rc);
      while (count > 0 && written >= first->len) {
        written -= first->len;
        ++first;
        --count;
      }
      if (count == 0) {
        loop_.defer([cb = std::move(cb)] { cb(Error()); });
        return;
      }
      first->base += written;
      first->len -= static_cast<unsigned>(written);
    } else if (rc != UV_EAGAIN) {
      loop_.defer([cb = std::move(cb), rc] { cb(uvError(rc, "uv write")); });
      return;
    }
    auto* req = new WriteReq{{}, std::move(cb), shared_from_this()};
    req->req.data = req;
    const int wrc =
        uv_write(&req->req, stream, first, static_cast<unsigned>(count),
                 &UvConnection::onWrite);
    if (wrc != 0) {
      auto c = std::move(req->cb);
      delete req;
      loop_.defer([c = std::move(c), wrc] { c(uvError(wrc, "uv write")); });
    }
  }

  // Closing is this connection's one way to end: the Lifecycle's sticky
  // error is what writes after it fail with.
  void close() override {
    life_.fail(Error::connection("write on a closed connection"), [&] {
      sink_ = nullptr;
      uv_close(reinterpret_cast<uv_handle_t*>(&tcp_), [](uv_handle_t* h) {
        auto* self = static_cast<UvConnection*>(h->data);
        auto keep = std::move(self->self_);
      });
    });
  }

  std::string peerAddress() const override { return peer_; }

  bool peerHasClosed() const override {
    uv_os_fd_t fd;
    return !life_.failed() &&
           uv_fileno(reinterpret_cast<const uv_handle_t*>(&tcp_), &fd) == 0 &&
           socketPeerHasClosed(fd);
  }

 private:
  struct WriteReq {
    uv_write_t req;
    WriteCallback cb;
    std::shared_ptr<UvConnection> conn;
  };

  void splitLarge(const IoBuf* bufs, size_t n) {
    constexpr size_t kMax = size_t{1} << 30;
    bool large = false;
    for (size_t i = 0; i < n; ++i) {
      large = large || bufs[i].length > kMax;
    }
    if (!large) {
      return;
    }
    bufs_.clear();
    for (size_t i = 0; i < n; ++i) {
      auto* p = static_cast<char*>(const_cast<void*>(bufs[i].data));
      size_t left = bufs[i].length;
      do {
        const size_t chunk = std::min(left, kMax);
        bufs_.push_back(uv_buf_init(p, static_cast<unsigned>(chunk)));
        p += chunk;
        left -= chunk;
      } while (left > 0);
    }
  }

  static void onWrite(uv_write_t* r, int status) {
    auto* req = static_cast<WriteReq*>(r->data);
    Loop::Scope scope(req->conn->loop_);
    auto cb = std::move(req->cb);
    delete req;
    cb(status == 0 ? Error() : uvError(status, "uv write"));
  }

  static void onAlloc(uv_handle_t* h, size_t, uv_buf_t* buf) {
    auto* self = static_cast<UvConnection*>(h->data);
    char* base = nullptr;
    size_t len = 0;
    if (self->sink_ != nullptr) {
      self->sink_->readBuffer(&base, &len);
    }
    *buf = uv_buf_init(base, static_cast<unsigned>(std::min(len, kMaxRead)));
  }

  static void onRead(uv_stream_t* s, ssize_t nread, const uv_buf_t*) {
    auto* self = static_cast<UvConnection*>(s->data);
    if (self->sink_ == nullptr || nread == 0 || nread == UV_ENOBUFS) {
      return;
    }
    Loop::Scope scope(self->loop_);
    if (nread > 0) {
      self->sink_->onRead(static_cast<size_t>(nread));
      return;
    }
    auto* sink = self->sink_;
    self->stopReading();
    if (nread == UV_EOF) {
      sink->onReadError(Error::connection("peer closed the connection"));
    } else {
      sink->onReadError(uvError(static_cast<int>(nread), "uv read"));
    }
  }

  Loop& loop_;
  uv_tcp_t tcp_;
  ReadSink* sink_ = nullptr;
  Lifecycle life_;
  std::string peer_;
  std::vector<uv_buf_t> bufs_;
  std::shared_ptr<UvConnection> self_;
};

class UvListener final : public ConnectionListener {
 public:
  UvListener(Loop& loop, Transport::AcceptCallback cb)
      : loop_(loop), cb_(std::move(cb)) {
    server_ = new uv_tcp_t;
    uv_tcp_init(loop.uv(), server_);
    server_->data = this;
  }
  ~UvListener() override { close(); }

  Error bind(const std::string& address) {
    sockaddr_storage ss;
    if (Error e = parseAddress(address, &ss); !e.ok()) {
      return e;
    }
    int rc = uv_tcp_bind(server_, reinterpret_cast<sockaddr*>(&ss),
                         ss.ss_family == AF_INET6 ? UV_TCP_IPV6ONLY : 0);
    if (rc == 0) {
      rc = uv_listen(reinterpret_cast<uv_stream_t*>(server_), kBacklog,
                     &UvListener::onConnection);
    }
    if (rc != 0) {
      return uvError(rc, "listen on " + address);
    }
    int len = sizeof(ss);
    uv_tcp_getsockname(server_, reinterpret_cast<sockaddr*>(&ss), &len);
    address_ = formatAddress(ss);
    return Error();
  }

  std::string address() const override { return address_; }

  void close() override {
    if (server_ == nullptr) {
      return;
    }
    server_->data = nullptr;
    uv_close(reinterpret_cast<uv_handle_t*>(server_),
             [](uv_handle_t* h) { delete reinterpret_cast<uv_tcp_t*>(h); });
    server_ = nullptr;
  }

 private:
  static void onConnection(uv_stream_t* s, int status) {
    auto* self = static_cast<UvListener*>(s->data);
    if (self == nullptr) {
      return;
    }
    Loop::Scope scope(self->loop_);
    if (status != 0) {
      // EMFILE and friends: this connection is lost, the listener goes on.
      TRELLIS_LOG_WARN("uv listener {}: accept: {}", self->address_,
                       uv_strerror(status));
      return;
    }
    auto conn = std::make_shared<UvConnection>(self->loop_);
    conn->retain();
    const int rc = uv_accept(s, reinterpret_cast<uv_stream_t*>(conn->tcp()));
    if (rc != 0) {
      conn->close();
      TRELLIS_LOG_WARN("uv listener {}: accept: {}", self->address_,
                       uv_strerror(rc));
      return;
    }
    conn->configure();
    self->cb_(Error(), std::move(conn));
  }

  Loop& loop_;
  Transport::AcceptCallback cb_;
  uv_tcp_t* server_;
  std::string address_;
};

class UvTransport final : public Transport {
 public:
  std::string name() const override { return "uv"; }
  Error viable() const override { return Error(); }
  bool sameHostOnly() const override { return false; }

  Error listen(Loop& loop, const std::string& address, AcceptCallback cb,
               std::unique_ptr<ConnectionListener>* out) override {
    auto l = std::make_unique<UvListener>(loop, std::move(cb));
    if (Error e = l->bind(address); !e.ok()) {
      return e;
    }
    *out = std::move(l);
    return Error();
  }

  void connect(Loop& loop, const std::string& address,
               ConnectCallback cb) override {
    sockaddr_storage ss;
    if (Error e = parseAddress(address, &ss); !e.ok()) {
      loop.defer([cb = std::move(cb), e] { cb(e, nullptr); });
      return;
    }
    auto conn = std::make_shared<UvConnection>(loop);
    conn->retain();
    struct Req {
      uv_connect_t req;
      ConnectCallback cb;
      std::shared_ptr<UvConnection> conn;
      std::string address;
      Loop& loop;
    };
    auto* req = new Req{{}, std::move(cb), conn, address, loop};
    req->req.data = req;
    const int rc = uv_tcp_connect(
        &req->req, conn->tcp(), reinterpret_cast<sockaddr*>(&ss),
        [](uv_connect_t* r, int status) {
          std::unique_ptr<Req> req(static_cast<Req*>(r->data));
          Loop::Scope scope(req->loop);
          if (status != 0) {
            req->conn->close();
            req->cb(uvError(status, "connect to " + req->address), nullptr);
            return;
          }
          req->conn->configure();
          req->cb(Error(), std::move(req->conn));
        });
    if (rc != 0) {
      auto c = std::move(req->cb);
      delete req;
      conn->close();
      loop.defer([c = std::move(c), rc, address] {
        c(uvError(rc, "connect to " + address), nullptr);
      });
    }
  }
};

}  // namespace

std::shared_ptr<Transport> create() { return std::make_shared<UvTransport>(); }

}  // namespace trellis::transport::uv
