// TCPStore client: blocking sockets driven by poll() so that every step has
// a deadline, one connection per object, requests serialised by a mutex.
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <random>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include <climits>

#include <trellis/core/deadline.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/store/protocol.h>
#include <trellis/store/tcp_store.h>

namespace trellis::store {

using protocol::Op;
using protocol::Request;
using protocol::Response;

namespace {

// Blocking requests are timed by the server; the client's own deadline is
// this much later so that the server's answer (naming the keys) wins.
constexpr std::chrono::milliseconds kServerAnswerGrace{2000};
constexpr std::chrono::milliseconds kFirstBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};

int pollTimeoutMs(const Deadline& d) {
  if (d.isNever()) {
    return -1;
  }
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d.remaining());
  return static_cast<int>(std::min<int64_t>(ms.count(), INT_MAX));
}

// Waits until `fd` is ready for `events`; a timeout Error names `what`.
Error waitReady(int fd, short events, const Deadline& deadline,
                const std::string& what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, pollTimeoutMs(deadline));
    if (n > 0) {
      return Error();
    }
    if (n == 0) {
      if (deadline.expired()) {
        return Error::timeout(what + " timed out");
      }
      continue;
    }
    if (errno != EINTR) {
      return Error::fromErrno(errno, what);
    }
  }
}

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept {
    reset();
    fd_ = std::exchange(o.fd_, -1);
    return *this;
  }
  ~Socket() { reset(); }
  void reset() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

}  // namespace

struct TCPStore::Impl {
  explicit Impl(TCPStoreOptions o)
      : opts(std::move(o)), id(rootIds().next("store")) {}

  TCPStoreOptions opts;
  const std::string id;
  // One request at a time on the one connection: held across a request's
  // send and receive (each bounded by the call's deadline).
  Mutex mu;
  Socket sock TRELLIS_GUARDED_BY(mu);
  Error broken TRELLIS_GUARDED_BY(mu);  // sticky once set
  Bytes rbuf TRELLIS_GUARDED_BY(mu);

  std::string peer() const {
    return opts.host + ":" + std::to_string(opts.port);
  }

  Error sendAll(const uint8_t* data, size_t n, const Deadline& deadline)
      TRELLIS_REQUIRES(mu) {
    while (n > 0) {
      const ssize_t w = ::send(sock.fd(), data, n, MSG_NOSIGNAL);
      if (w > 0) {
        data += w;
        n -= static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) {
        continue;
      }
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        Error e = waitReady(sock.fd(), POLLOUT, deadline,
                            "sending to store server " + peer());
        if (!e.ok()) {
          return e;
        }
        continue;
      }
      return Error::fromErrno(errno, "sending to store server " + peer());
    }
    return Error();
  }

  Error recvAll(uint8_t* data, size_t n, const Deadline& deadline)
      TRELLIS_REQUIRES(mu) {
    while (n > 0) {
      const ssize_t r = ::recv(sock.fd(), data, n, 0);
      if (r > 0) {
        data += r;
        n -= static_cast<size_t>(r);
        continue;
      }
      if (r == 0) {
        return Error::connection("store server " + peer() +
                                 " closed the connection");
      }
      if (errno == EINTR) {
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Error e = waitReady(sock.fd(), POLLIN, deadline,
                            "waiting for store server " + peer());
        if (!e.ok()) {
          return e;
        }
        continue;
      }
      return Error::fromErrno(errno, "receiving from store server " + peer());
    }
    return Error();
  }

  // One TCP connect to one address, non-blocking, bounded by `deadline`.
  Error connectTo(const addrinfo* ai, const Deadline& deadline)
      TRELLIS_REQUIRES(mu) {
    Socket s(::socket(ai->ai_family,
                      ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                      ai->ai_protocol));
    if (s.fd() < 0) {
      return Error::fromErrno(errno, "creating a socket");
    }
    const int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        return Error::fromErrno(errno, "connecting to store server " + peer());
      }
      Error e = waitReady(s.fd(), POLLOUT, deadline,
                          "connecting to store server " + peer());
      if (!e.ok()) {
        return e;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        return Error::fromErrno(err, "connecting to store server " + peer());
      }
    }
    sock = std::move(s);
    return Error();
  }

  Error handshake(const Deadline& deadline) TRELLIS_REQUIRES(mu) {
    const bool haveToken = opts.jobToken.has_value();
    const auto hello = protocol::encodeClientHello(
        protocol::kVersion, haveToken ? protocol::kClientHasToken : 0);
    Error e = sendAll(hello.data(), hello.size(), deadline);
    std::array<uint8_t, protocol::kServerHelloBytes> reply{};
    if (e.ok()) {
      e = recvAll(reply.data(), reply.size(), deadline);
    }
    if (!e.ok()) {
      return e.withContext("store handshake");
    }
    if (Error bad = protocol::checkServerHello(reply, haveToken, peer());
        !bad.ok()) {
      return bad;
    }
    if (!haveToken) {
      return Error();
    }
    auth::Nonce nonceA{};
    e = recvAll(nonceA.data(), nonceA.size(), deadline);
    if (!e.ok()) {
      return e.withContext("store authentication");
    }
    const auth::Nonce nonceC = auth::randomNonce();
    const auth::Mac proof =
        auth::computeProof(*opts.jobToken, "connector", nonceA, nonceC);
    std::array<uint8_t, auth::kNonceBytes + auth::kMacBytes> answer{};
    std::copy(nonceC.begin(), nonceC.end(), answer.begin());
    std::copy(proof.begin(), proof.end(), answer.begin() + auth::kNonceBytes);
    e = sendAll(answer.data(), answer.size(), deadline);
    uint8_t verdict = protocol::kAuthRejected;
    if (e.ok()) {
      e = recvAll(&verdict, 1, deadline);
    }
    if (!e.ok()) {
      return e.withContext("store authentication");
    }
    if (verdict != protocol::kAuthAccepted) {
      return Error::auth("store server " + peer() +
                         " rejected this client's job token");
    }
    auth::Mac serverProof{};
    e = recvAll(serverProof.data(), serverProof.size(), deadline);
    if (!e.ok()) {
      return e.withContext("store authentication");
    }
    return auth::verifyProof(*opts.jobToken, "acceptor", nonceC, nonceA,
                             serverProof, "store server " + peer());
  }

  // One attempt: resolve, connect to the first address that answers, then
  // hello and authentication.
  Error attempt(const Deadline& deadline) TRELLIS_REQUIRES(mu) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(opts.port);
    const int rc = ::getaddrinfo(opts.host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0) {
      return Error::connection("cannot resolve store host '" + opts.host +
                               "': " + ::gai_strerror(rc));
    }
    Error e = Error::connection("no address for " + peer());
    for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
      e = connectTo(ai, deadline);
      if (e.ok()) {
        break;
      }
    }
    ::freeaddrinfo(res);
    if (!e.ok()) {
      return e;
    }
    e = handshake(deadline);
    if (!e.ok()) {
      sock.reset();
    }
    return e;
  }

  // From the constructor, before any other thread can see the store; the
  // lock is uncontended and keeps the socket's accesses checkable.
  void connect() TRELLIS_EXCLUDES(mu) {
    MutexLock lock(mu);
    const auto window =
        opts.connectTimeout.count() > 0 ? opts.connectTimeout : opts.timeout;
    detail::checkTimeout(window);
    const Deadline deadline = Deadline::fromTimeout(window);
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<double> jitter(0.5, 1.5);
    auto backoff = kFirstBackoff;
    int attempts = 0;
    for (;;) {
      ++attempts;
      const Error e = attempt(deadline);
      if (e.ok()) {
        TRELLIS_LOG_DEBUG("{}: connected to {} after {} attempt(s)", id, peer(),
                          attempts);
        return;
      }
      // Retrying cannot fix a wrong token, a foreign server or bad input.
      if (e.code() != Code::kUnavailable &&
          e.code() != Code::kDeadlineExceeded) {
        throwError(e);
      }
      if (deadline.expired()) {
        throw ConnectionError(Error::connection(
            "could not connect to store server " + peer() + " within " +
            formatDuration(window) + " (" + std::to_string(attempts) +
            " attempts); last error: " + e.message()));
      }
      const auto sleep = std::min<Duration>(
          std::chrono::duration_cast<Duration>(backoff * jitter(rng)),
          deadline.remaining());
      std::this_thread::sleep_for(sleep);
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }

  // Fails this call with `e` and every later one with a ConnectionError
  // that carries it.
  [[noreturn]] void breakWith(const Error& e) TRELLIS_REQUIRES(mu) {
    sock.reset();
    broken =
        Error::connection("store client " + id +
                          " is unusable after an earlier failure: " + e.what());
    throwError(e);
  }

  Response call(const Request& req, const Deadline& deadline)
      TRELLIS_EXCLUDES(mu) {
    protocol::checkRequest(req, opts.limits);
    const Bytes out = protocol::frame(protocol::encodeRequest(req));
    MutexLock lock(mu);
    if (!broken.ok()) {
      throwError(broken);
    }
    const std::string what =
        std::string("store ") + protocol::opName(req.op) + " to " + peer();
    Error e = sendAll(out.data(), out.size(), deadline);
    std::array<uint8_t, protocol::kFrameHeaderBytes> hdr{};
    if (e.ok()) {
      e = recvAll(hdr.data(), hdr.size(), deadline);
    }
    if (!e.ok()) {
      breakWith(e.withContext(what));
    }
    const uint32_t len = static_cast<uint32_t>(hdr[0]) |
                         static_cast<uint32_t>(hdr[1]) << 8 |
                         static_cast<uint32_t>(hdr[2]) << 16 |
                         static_cast<uint32_t>(hdr[3]) << 24;
    if (len > opts.limits.maxFrameBytes) {
      breakWith(Error::protocol(what + ": response frame of " +
                                std::to_string(len) +
                                " bytes exceeds the limit"));
    }
    rbuf.resize(len);
    e = recvAll(rbuf.data(), len, deadline);
    if (!e.ok()) {
      breakWith(e.withContext(what));
    }
    Response resp;
    e = protocol::decodeResponse(req.op, rbuf, opts.limits, &resp);
    if (rbuf.capacity() > (1u << 20)) {
      Bytes().swap(rbuf);
    }
    if (!e.ok()) {
      breakWith(e.withContext(what));
    }
    if (!resp.error.ok()) {
      // The server closes the connection after a protocol error.
      if (resp.error.code() == Code::kDataLoss) {
        breakWith(resp.error);
      }
      throwError(resp.error);
    }
    return resp;
  }
};

namespace {
Deadline blockingDeadline(std::chrono::milliseconds timeout) {
  if (timeout.count() == 0) {
    return Deadline::never();
  }
  return Deadline::after(timeout + kServerAnswerGrace);
}
}  // namespace

TCPStore::TCPStore(TCPStoreOptions options)
    : Store(options.timeout),
      impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->connect();
}

TCPStore::~TCPStore() = default;

const std::string& TCPStore::host() const { return impl_->opts.host; }
uint16_t TCPStore::port() const { return impl_->opts.port; }
const std::string& TCPStore::id() const { return impl_->id; }

std::unique_ptr<Store> TCPStore::clone(std::chrono::milliseconds timeout) {
  TCPStoreOptions o = impl_->opts;
  o.timeout = timeout;
  o.connectTimeout = timeout;
  return std::make_unique<TCPStore>(std::move(o));
}

namespace {
Deadline plainDeadline(const Store& s) {
  return Deadline::fromTimeout(Duration(s.timeout()));
}
}  // namespace

void TCPStore::set(const std::string& key, std::span<const uint8_t> value) {
  Request req;
  req.op = Op::kSet;
  req.keys = {key};
  req.values.emplace_back(value.begin(), value.end());
  impl_->call(req, plainDeadline(*this));
}

Bytes TCPStore::getWithTimeout(const std::string& key,
                               std::chrono::milliseconds timeout) {
  detail::checkTimeout(timeout);
  Request req;
  req.op = Op::kGet;
  req.keys = {key};
  req.timeoutMs = static_cast<uint64_t>(timeout.count());
  Response r = impl_->call(req, blockingDeadline(timeout));
  return std::move(r.values.at(0));
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  Request req;
  req.op = Op::kAdd;
  req.keys = {key};
  req.delta = delta;
  return impl_->call(req, plainDeadline(*this)).integer;
}

Bytes TCPStore::compareSet(const std::string& key,
                           std::span<const uint8_t> expected,
                           std::span<const uint8_t> desired) {
  Request req;
  req.op = Op::kCompareSet;
  req.keys = {key};
  req.values.emplace_back(expected.begin(), expected.end());
  req.values.emplace_back(desired.begin(), desired.end());
  Response r = impl_->call(req, plainDeadline(*this));
  return std::move(r.values.at(0));
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  Request req;
  req.op = Op::kCheck;
  req.keys = keys;
  return impl_->call(req, plainDeadline(*this)).flag;
}

bool TCPStore::deleteKey(const std::string& key) {
  Request req;
  req.op = Op::kDelete;
  req.keys = {key};
  return impl_->call(req, plainDeadline(*this)).flag;
}

int64_t TCPStore::numKeys() {
  Request req;
  req.op = Op::kNumKeys;
  return impl_->call(req, plainDeadline(*this)).integer;
}

void TCPStore::wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) {
  detail::checkTimeout(timeout);
  Request req;
  req.op = Op::kWait;
  req.keys = keys;
  req.timeoutMs = static_cast<uint64_t>(timeout.count());
  impl_->call(req, blockingDeadline(timeout));
}

std::vector<Bytes> TCPStore::multiGet(const std::vector<std::string>& keys) {
  Request req;
  req.op = Op::kMultiGet;
  req.keys = keys;
  req.timeoutMs = static_cast<uint64_t>(timeout().count());
  return std::move(impl_->call(req, blockingDeadline(timeout())).values);
}

void TCPStore::multiSet(const std::vector<std::string>& keys,
                        const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "store multiSet: " + std::to_string(keys.size()) + " keys but " +
        std::to_string(values.size()) + " values"));
  }
  Request req;
  req.op = Op::kMultiSet;
  req.keys = keys;
  req.values = values;
  impl_->call(req, plainDeadline(*this));
}

void TCPStore::ping() {
  Request req;
  req.op = Op::kPing;
  impl_->call(req, plainDeadline(*this));
}

}  // namespace trellis::store
