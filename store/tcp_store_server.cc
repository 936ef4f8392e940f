// The TCPStore server: one io_context thread, a coroutine per connection.
// All store state lives on that thread, so it needs no lock.
#include <array>
#include <atomic>
#include <cerrno>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>  // before Boost 1.74 asio, whose awaitable.hpp misses it

#include <boost/asio.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include <trellis/core/auth.h>
#include <trellis/core/ids.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/core/thread_name.h>
#include <trellis/core/wire.h>
#include <trellis/store/protocol.h>
#include <trellis/store/tcp_store.h>

namespace trellis::store {

namespace asio = boost::asio;
using asio::ip::tcp;
using protocol::HelloStatus;
using protocol::Op;
using protocol::Request;
using protocol::Response;

namespace {

// Timeouts beyond this are treated as none (and cannot overflow a clock).
constexpr uint64_t kMaxTimeoutMs = 10ull * 365 * 24 * 3600 * 1000;
// A connection's read buffer is kept between requests up to this size.
constexpr size_t kKeptBufferBytes = 1u << 20;

std::string endpointText(const tcp::socket& s) {
  boost::system::error_code ec;
  const auto ep = s.remote_endpoint(ec);
  if (ec) {
    return "?";
  }
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

}  // namespace

struct TCPStoreServer::Impl {
  explicit Impl(TCPStoreServerOptions o)
      : opts(std::move(o)), id(rootIds().next("store_server")) {}

  struct Waiter {
    asio::steady_timer* timer;
  };

  TCPStoreServerOptions opts;
  const std::string id;

  // Loop-thread state.
  std::unordered_map<std::string, Bytes> data;
  std::unordered_map<std::string, std::unordered_set<Waiter*>> waiters;
  std::unordered_set<tcp::socket*> conns;
  std::atomic<size_t> numConns{0};

  // Declared after the state: destroying the io_context destroys suspended
  // coroutine frames, whose guards still touch the maps above.
  asio::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  tcp protocol = tcp::v4();
  uint16_t port = 0;
  // Started by start() before the server is shared; joined by the first
  // stop() (stopMu serialises concurrent stops).
  std::thread thread;
  Mutex stopMu;
  bool stopped TRELLIS_GUARDED_BY(stopMu) = false;

  void start();
  void stop() TRELLIS_EXCLUDES(stopMu);
  asio::awaitable<void> acceptLoop();
  asio::awaitable<void> session(tcp::socket sock);
  asio::awaitable<bool> handshake(tcp::socket& sock, const std::string& peer);
  asio::awaitable<Response> execute(tcp::socket& sock, Request& req);
  asio::awaitable<Error> waitFor(tcp::socket& sock,
                                 const std::vector<std::string>& keys,
                                 uint64_t timeoutMs, std::string_view op);
  void notify(const std::string& key);
  asio::awaitable<void> sendError(tcp::socket& sock, const Error& e);
};

void TCPStoreServer::Impl::start() {
  try {
    tcp::resolver resolver(ioc);
    auto results = resolver.resolve(
        opts.host, std::to_string(opts.port),
        tcp::resolver::passive | tcp::resolver::numeric_service);
    const tcp::endpoint ep = results.begin()->endpoint();
    // Close-on-exec from the start (Asio's open() leaves it inheritable):
    // a process this one starts, elastic-run's workers and everything they
    // start, must not hold the store's port.
    const int fd = ::socket(ep.protocol().family(),
                            SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) {
      throw boost::system::system_error(errno, boost::system::system_category(),
                                        "socket");
    }
    acceptor.assign(ep.protocol(), fd);
    protocol = ep.protocol();
    acceptor.non_blocking(true);
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    acceptor.bind(ep);
    acceptor.listen(asio::socket_base::max_listen_connections);
    port = acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    throw ConnectionError(Error::connection(
        "store server cannot listen on " + opts.host + ":" +
        std::to_string(opts.port) + ": " + e.code().message()));
  }
  asio::co_spawn(ioc, acceptLoop(), asio::detached);
  thread = std::thread([this] {
    setThreadName("store-server");
    ioc.run();
  });
  TRELLIS_LOG_INFO("{}: listening on {}:{}{}", id, opts.host, port,
                   opts.jobToken ? " (job token required)" : "");
}

void TCPStoreServer::Impl::stop() {
  MutexLock lock(stopMu);
  if (stopped) {
    return;
  }
  stopped = true;
  if (!thread.joinable()) {
    return;
  }
  asio::post(ioc, [this] {
    boost::system::error_code ignored;
    acceptor.close(ignored);
    for (tcp::socket* s : conns) {
      s->shutdown(tcp::socket::shutdown_both, ignored);
      s->close(ignored);
    }
    ioc.stop();
  });
  thread.join();
}

asio::awaitable<void> TCPStoreServer::Impl::acceptLoop() {
  for (;;) {
    boost::system::error_code ec;
    co_await acceptor.async_wait(tcp::acceptor::wait_read,
                                 asio::redirect_error(asio::use_awaitable, ec));
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) {
      co_return;
    }
    int fd = -1;
    if (!ec) {
      // accept4, not Asio's accept: the connection is close-on-exec from
      // the start, as the listener is.
      fd = ::accept4(acceptor.native_handle(), nullptr, nullptr,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK ||
                     errno == EINTR || errno == ECONNABORTED)) {
        continue;  // the peer gave up between readiness and accept
      }
      if (fd < 0) {
        ec.assign(errno, boost::system::system_category());
      }
    }
    tcp::socket sock(ioc);
    if (!ec) {
      sock.assign(protocol, fd, ec);
      if (ec) {
        ::close(fd);
      }
    }
    if (ec) {
      // Out of descriptors and the like: keep serving the others and try
      // again shortly rather than spinning.
      TRELLIS_LOG_WARN("{}: accept failed: {}", id, ec.message());
      asio::steady_timer pause(ioc, std::chrono::milliseconds(50));
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    sock.set_option(tcp::no_delay(true), ec);
    asio::co_spawn(ioc, session(std::move(sock)), asio::detached);
  }
}

asio::awaitable<void> TCPStoreServer::Impl::sendError(tcp::socket& sock,
                                                      const Error& e) {
  Response resp;
  resp.error = e;
  const Bytes out = protocol::frame(protocol::encodeResponse(Op::kPing, resp));
  boost::system::error_code ec;
  co_await asio::async_write(sock, asio::buffer(out),
                             asio::redirect_error(asio::use_awaitable, ec));
}

asio::awaitable<bool> TCPStoreServer::Impl::handshake(tcp::socket& sock,
                                                      const std::string& peer) {
  // Bound the whole handshake so that silent connections cannot pile up
  // before authenticating.
  auto done = std::make_shared<bool>(false);
  asio::steady_timer guard(ioc, opts.handshakeTimeout);
  guard.async_wait([done, &sock](const boost::system::error_code& ec) {
    if (!ec && !*done) {
      boost::system::error_code ignored;
      sock.close(ignored);
    }
  });
  struct Done {
    std::shared_ptr<bool> flag;
    ~Done() { *flag = true; }
  } markDone{done};

  std::array<uint8_t, protocol::kClientHelloBytes> helloBytes{};
  co_await asio::async_read(sock, asio::buffer(helloBytes),
                            asio::use_awaitable);
  const protocol::ClientHello hello = protocol::decodeClientHello(helloBytes);
  const HelloStatus status =
      protocol::judgeClientHello(hello, opts.jobToken.has_value());
  const auto reply = protocol::encodeServerHello(
      opts.jobToken ? protocol::kServerRequiresToken : 0, status);
  co_await asio::async_write(sock, asio::buffer(reply), asio::use_awaitable);
  if (status != HelloStatus::kOk) {
    TRELLIS_LOG_WARN("{}: rejected {} at hello: {}", id, peer,
                     protocol::describeRefusal(hello, status));
    co_return false;
  }
  if (!opts.jobToken) {
    co_return true;
  }
  const auth::Nonce nonceA = auth::randomNonce();
  co_await asio::async_write(sock, asio::buffer(nonceA), asio::use_awaitable);
  std::array<uint8_t, protocol::kClientAnswerBytes> answer{};
  co_await asio::async_read(sock, asio::buffer(answer), asio::use_awaitable);
  auth::Nonce nonceC{};
  const Error verdict = protocol::checkClientAnswer(*opts.jobToken, nonceA,
                                                    answer, peer, &nonceC);
  if (!verdict.ok()) {
    const uint8_t rejected = protocol::kAuthRejected;
    co_await asio::async_write(sock, asio::buffer(&rejected, 1),
                               asio::use_awaitable);
    TRELLIS_LOG_WARN("{}: {}", id, verdict.message());
    co_return false;
  }
  std::array<uint8_t, 1 + auth::kMacBytes> accept{};
  accept[0] = protocol::kAuthAccepted;
  const auth::Mac proof =
      auth::computeProof(*opts.jobToken, "acceptor", nonceC, nonceA);
  std::copy(proof.begin(), proof.end(), accept.begin() + 1);
  co_await asio::async_write(sock, asio::buffer(accept), asio::use_awaitable);
  co_return true;
}

asio::awaitable<void> TCPStoreServer::Impl::session(tcp::socket sock) {
  const std::string peer = endpointText(sock);
  conns.insert(&sock);
  numConns.fetch_add(1, std::memory_order_relaxed);
  struct Unregister {
    Impl* self;
    tcp::socket* s;
    ~Unregister() {
      self->conns.erase(s);
      self->numConns.fetch_sub(1, std::memory_order_relaxed);
    }
  } unregister{this, &sock};

  try {
    if (!co_await handshake(sock, peer)) {
      co_return;
    }
    Bytes buf;
    for (;;) {
      std::array<uint8_t, protocol::kFrameHeaderBytes> hdr{};
      co_await asio::async_read(sock, asio::buffer(hdr), asio::use_awaitable);
      const uint32_t len = static_cast<uint32_t>(hdr[0]) |
                           static_cast<uint32_t>(hdr[1]) << 8 |
                           static_cast<uint32_t>(hdr[2]) << 16 |
                           static_cast<uint32_t>(hdr[3]) << 24;
      if (len > opts.limits.maxFrameBytes) {
        const Error e =
            Error::protocol("store request frame of " + std::to_string(len) +
                            " bytes exceeds the limit of " +
                            std::to_string(opts.limits.maxFrameBytes));
        TRELLIS_LOG_WARN("{}: closing {}: {}", id, peer, e.message());
        co_await sendError(sock, e);
        co_return;
      }
      buf.resize(len);
      co_await asio::async_read(sock, asio::buffer(buf), asio::use_awaitable);
      Request req;
      const Error decoded = protocol::decodeRequest(buf, opts.limits, &req);
      if (buf.capacity() > kKeptBufferBytes) {
        Bytes().swap(buf);
      }
      if (decoded.code() == Code::kResourceExhausted) {
        // Well framed, only over this server's limits (a client configured
        // with larger ones): that request fails, the connection stays.
        TRELLIS_LOG_DEBUG("{}: refusing a request from {}: {}", id, peer,
                          decoded.message());
        co_await sendError(sock, decoded);
        continue;
      }
      if (!decoded.ok()) {
        TRELLIS_LOG_WARN("{}: closing {}: {}", id, peer, decoded.message());
        co_await sendError(sock, decoded);
        co_return;
      }
      const Response resp = co_await execute(sock, req);
      const Bytes out = protocol::frame(protocol::encodeResponse(req.op, resp));
      co_await asio::async_write(sock, asio::buffer(out), asio::use_awaitable);
    }
  } catch (const boost::system::system_error& e) {
    if (e.code() != asio::error::eof &&
        e.code() != asio::error::operation_aborted) {
      TRELLIS_LOG_DEBUG("{}: connection {} ended: {}", id, peer,
                        e.code().message());
    }
  } catch (const std::exception& e) {
    TRELLIS_LOG_WARN("{}: connection {} failed: {}", id, peer, e.what());
  }
}

void TCPStoreServer::Impl::notify(const std::string& key) {
  auto it = waiters.find(key);
  if (it == waiters.end()) {
    return;
  }
  // A woken waiter re-checks every key it needs and re-registers if one is
  // still missing, so it is simply dropped from this key's list here.
  std::unordered_set<Waiter*> woken = std::move(it->second);
  waiters.erase(it);
  for (Waiter* w : woken) {
    w->timer->cancel();
  }
}

asio::awaitable<Error> TCPStoreServer::Impl::waitFor(
    tcp::socket& sock, const std::vector<std::string>& keys, uint64_t timeoutMs,
    std::string_view op) {
  const auto expiry = timeoutMs == 0 || timeoutMs > kMaxTimeoutMs
                          ? asio::steady_timer::time_point::max()
                          : asio::steady_timer::clock_type::now() +
                                std::chrono::milliseconds(timeoutMs);
  // Shared with the socket watch below, whose handler may run after this
  // frame is gone.
  struct Watch {
    explicit Watch(asio::io_context& io) : timer(io) {}
    asio::steady_timer timer;
    bool pending = false;
    bool peerReadable = false;
  };
  auto watch = std::make_shared<Watch>(ioc);
  Waiter self{&watch->timer};
  std::vector<const std::string*> registered;
  struct Unregister {
    Impl* impl;
    Waiter* w;
    std::vector<const std::string*>* keys;
    void run() {
      for (const std::string* k : *keys) {
        auto it = impl->waiters.find(*k);
        if (it != impl->waiters.end()) {
          it->second.erase(w);
          if (it->second.empty()) {
            impl->waiters.erase(it);
          }
        }
      }
      keys->clear();
    }
    ~Unregister() { run(); }
  } unregister{this, &self, &registered};
  auto stopWatching = [&] {
    if (watch->pending) {
      boost::system::error_code ignored;
      sock.cancel(ignored);
    }
  };

  for (;;) {
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!data.contains(k)) {
        missing.push_back(k);
      }
    }
    if (missing.empty()) {
      stopWatching();
      co_return Error();
    }
    if (watch->peerReadable) {
      // Nothing may arrive while a request is in flight: the client hung
      // up (or broke the protocol). End the connection now rather than
      // holding the waiter until its timeout.
      throw boost::system::system_error(asio::error::connection_aborted);
    }
    if (asio::steady_timer::clock_type::now() >= expiry) {
      stopWatching();
      co_return Error::timeout(detail::timeoutMessage(
          op, missing, std::chrono::milliseconds(timeoutMs)));
    }
    if (!watch->pending) {
      watch->pending = true;
      sock.async_wait(tcp::socket::wait_read,
                      [watch](const boost::system::error_code& ec) {
                        watch->pending = false;
                        if (!ec) {
                          watch->peerReadable = true;
                          watch->timer.cancel();
                        }
                      });
    }
    for (const auto& k : keys) {
      if (!data.contains(k)) {
        waiters[k].insert(&self);
        registered.push_back(&k);
      }
    }
    watch->timer.expires_at(expiry);
    boost::system::error_code ec;
    co_await watch->timer.async_wait(
        asio::redirect_error(asio::use_awaitable, ec));
    unregister.run();
  }
}

asio::awaitable<Response> TCPStoreServer::Impl::execute(tcp::socket& sock,
                                                        Request& req) {
  Response resp;
  try {
    switch (req.op) {
      case Op::kSet:
        data[req.keys[0]] = std::move(req.values[0]);
        notify(req.keys[0]);
        break;
      case Op::kGet: {
        resp.error = co_await waitFor(sock, req.keys, req.timeoutMs, "get");
        if (resp.error.ok()) {
          resp.values.push_back(data.at(req.keys[0]));
        }
        break;
      }
      case Op::kAdd: {
        const std::string& key = req.keys[0];
        auto it = data.find(key);
        resp.integer = detail::addToCounter(
            key, it == data.end() ? nullptr : &it->second, req.delta);
        data[key] = detail::toBytes(std::to_string(resp.integer));
        notify(key);
        break;
      }
      case Op::kCompareSet: {
        const std::string& key = req.keys[0];
        Bytes& expected = req.values[0];
        Bytes& desired = req.values[1];
        auto it = data.find(key);
        if (it == data.end()) {
          if (expected.empty()) {
            data[key] = desired;
            resp.values.push_back(std::move(desired));
            notify(key);
          } else {
            resp.values.push_back(std::move(expected));
          }
        } else if (it->second == expected) {
          it->second = desired;
          resp.values.push_back(std::move(desired));
          notify(key);
        } else {
          resp.values.push_back(it->second);
        }
        break;
      }
      case Op::kWait:
        resp.error = co_await waitFor(sock, req.keys, req.timeoutMs, "wait");
        break;
      case Op::kCheck:
        resp.flag = true;
        for (const auto& k : req.keys) {
          if (!data.contains(k)) {
            resp.flag = false;
            break;
          }
        }
        break;
      case Op::kDelete:
        resp.flag = data.erase(req.keys[0]) > 0;
        break;
      case Op::kNumKeys:
        resp.integer = static_cast<int64_t>(data.size());
        break;
      case Op::kMultiGet:
        resp.error =
            co_await waitFor(sock, req.keys, req.timeoutMs, "multiGet");
        if (resp.error.ok()) {
          // The answer must fit in a frame the client accepts; say so
          // instead of sending one it would reject.
          size_t total = 16;
          for (const auto& k : req.keys) {
            total += data.at(k).size() + wire::kMaxVarintBytes;
          }
          if (total > opts.limits.maxFrameBytes) {
            resp.error =
                Error(Code::kResourceExhausted,
                      "store multiGet: the " + std::to_string(req.keys.size()) +
                          " values total about " + std::to_string(total) +
                          " bytes, over the frame limit of " +
                          std::to_string(opts.limits.maxFrameBytes) +
                          "; fetch them in smaller groups");
            break;
          }
          for (const auto& k : req.keys) {
            resp.values.push_back(data.at(k));
          }
        }
        break;
      case Op::kMultiSet:
        for (size_t i = 0; i < req.keys.size(); ++i) {
          data[req.keys[i]] = std::move(req.values[i]);
        }
        for (const auto& k : req.keys) {
          notify(k);
        }
        break;
      case Op::kPing:
        break;
    }
  } catch (const Exception& e) {
    resp = Response();
    resp.error = e.error();
  }
  co_return resp;
}

TCPStoreServer::TCPStoreServer(TCPStoreServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->start();
}

TCPStoreServer::~TCPStoreServer() { stop(); }

uint16_t TCPStoreServer::port() const { return impl_->port; }

const std::string& TCPStoreServer::host() const { return impl_->opts.host; }

void TCPStoreServer::stop() { impl_->stop(); }

size_t TCPStoreServer::numConnections() const {
  return impl_->numConns.load(std::memory_order_relaxed);
}

}  // namespace trellis::store
