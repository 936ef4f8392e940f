// TCPStore beyond the contract: scale, a killed server, hostile input,
// authentication, start-up ordering and the trellis-store binary.
#include <arpa/inet.h>
#include <atomic>
#include <cstring>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <thread>

#include <gtest/gtest.h>

#include "store_test_util.h"
#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/store/hash_store.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/protocol.h>
#include <trellis/store/tcp_store.h>

namespace trellis::store {
namespace {

using namespace std::chrono_literals;
using protocol::HelloStatus;
using protocol::Op;
using testing::StoreProcess;
using testing::timed;

TCPStoreOptions clientOptions(uint16_t port) {
  TCPStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = 60s;
  o.connectTimeout = 10s;
  return o;
}

// A raw socket to the server, for speaking the protocol badly on purpose.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
              0);
  }
  ~RawClient() { ::close(fd_); }

  void send(const void* data, size_t n) {
    EXPECT_EQ(::send(fd_, data, n, MSG_NOSIGNAL), static_cast<ssize_t>(n));
  }
  void send(const Bytes& b) { send(b.data(), b.size()); }
  void helloOk() {
    const auto h = protocol::encodeClientHello(protocol::kVersion, 0);
    send(h.data(), h.size());
    const Bytes reply = recvExactly(protocol::kServerHelloBytes);
    ASSERT_EQ(reply.size(), protocol::kServerHelloBytes);
    ASSERT_EQ(reply[9], static_cast<uint8_t>(HelloStatus::kOk));
  }
  // Up to n bytes, within 5 s; fewer when the peer closes.
  Bytes recvExactly(size_t n) {
    Bytes out;
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (out.size() < n && std::chrono::steady_clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) {
        continue;
      }
      uint8_t buf[4096];
      const ssize_t r =
          ::recv(fd_, buf, std::min(sizeof(buf), n - out.size()), 0);
      if (r <= 0) {
        break;
      }
      out.insert(out.end(), buf, buf + r);
    }
    return out;
  }
  // True when the server closed the connection within 5 s.
  bool closedByPeer() {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) {
        continue;
      }
      uint8_t buf[256];
      const ssize_t r = ::recv(fd_, buf, sizeof(buf), 0);
      if (r == 0 || (r < 0 && errno == ECONNRESET)) {
        return true;
      }
    }
    return false;
  }
  // Reads one response frame; returns its status byte (or -1).
  int readResponseStatus(std::string* message = nullptr) {
    const Bytes hdr = recvExactly(4);
    if (hdr.size() != 4) {
      return -1;
    }
    const uint32_t len = hdr[0] | hdr[1] << 8 | hdr[2] << 16 | hdr[3] << 24;
    const Bytes body = recvExactly(len);
    if (body.size() != len || body.empty()) {
      return -1;
    }
    if (message != nullptr) {
      protocol::Response r;
      Limits limits;
      if (protocol::decodeResponse(Op::kPing, body, limits, &r).ok()) {
        *message = r.error.message();
      }
    }
    return body[0];
  }

 private:
  int fd_ = -1;
};

Bytes le32(uint32_t v) {
  return {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
          static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
}

class TcpStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TCPStoreServerOptions o;
    o.limits.maxValueBytes = 1 << 20;
    o.limits.maxFrameBytes = 2 << 20;
    o.handshakeTimeout = 500ms;
    server_ = std::make_unique<TCPStoreServer>(std::move(o));
  }
  // A healthy client keeps working while others misbehave.
  void expectServerHealthy(TCPStore& bystander) {
    bystander.add("health", 1);
    TCPStore fresh(clientOptions(server_->port()));
    EXPECT_NO_THROW(fresh.ping());
    EXPECT_EQ(fresh.getString("health"), bystander.getString("health"));
  }

  std::unique_ptr<TCPStoreServer> server_;
};

TEST_F(TcpStoreTest, WrongMagicGetsAnErrorHelloAndIsClosed) {
  TCPStore bystander(clientOptions(server_->port()));
  RawClient raw(server_->port());
  raw.send("HTTP/1.1 ", 9);
  const Bytes reply = raw.recvExactly(protocol::kServerHelloBytes);
  ASSERT_EQ(reply.size(), protocol::kServerHelloBytes);
  EXPECT_EQ(reply[9], static_cast<uint8_t>(HelloStatus::kBadMagic));
  EXPECT_TRUE(raw.closedByPeer());
  expectServerHealthy(bystander);
}

TEST_F(TcpStoreTest, WrongVersionGetsAnErrorHelloAndIsClosed) {
  TCPStore bystander(clientOptions(server_->port()));
  RawClient raw(server_->port());
  const auto h = protocol::encodeClientHello(protocol::kVersion + 41, 0);
  raw.send(h.data(), h.size());
  const Bytes reply = raw.recvExactly(protocol::kServerHelloBytes);
  ASSERT_EQ(reply.size(), protocol::kServerHelloBytes);
  EXPECT_EQ(reply[9], static_cast<uint8_t>(HelloStatus::kUnsupportedVersion));
  EXPECT_TRUE(raw.closedByPeer());
  expectServerHealthy(bystander);
}

TEST_F(TcpStoreTest, OversizedFrameGetsAnErrorAndIsClosed) {
  TCPStore bystander(clientOptions(server_->port()));
  RawClient raw(server_->port());
  raw.helloOk();
  raw.send(le32((2 << 20) + 1));  // one byte over the frame limit
  std::string message;
  EXPECT_EQ(raw.readResponseStatus(&message),
            static_cast<int>(Code::kDataLoss));
  EXPECT_NE(message.find("exceeds the limit"), std::string::npos) << message;
  EXPECT_TRUE(raw.closedByPeer());
  expectServerHealthy(bystander);
}

// A well-framed request over the server's limits (a client configured
// with larger ones) fails alone: the connection goes on. It used to be
// closed, and a TCPStore client then failed every later call.
TEST_F(TcpStoreTest, OversizedValueFailsThatRequestAndTheConnectionStays) {
  TCPStore bystander(clientOptions(server_->port()));
  RawClient raw(server_->port());
  raw.helloOk();
  protocol::Request req;
  req.op = Op::kSet;
  req.keys = {"big"};
  req.values = {Bytes((1 << 20) + 1, 'v')};  // over maxValueBytes
  raw.send(protocol::frame(protocol::encodeRequest(req)));
  std::string message;
  EXPECT_EQ(raw.readResponseStatus(&message),
            static_cast<int>(Code::kResourceExhausted));
  EXPECT_EQ(message,
            "store request: a value of 1048577 bytes exceeds the server's "
            "limit of 1048576 (Limits::maxValueBytes)");
  protocol::Request many;
  many.op = Op::kCheck;
  many.keys.assign(70000, "k");  // over maxKeysPerOp (65536)
  raw.send(protocol::frame(protocol::encodeRequest(many)));
  EXPECT_EQ(raw.readResponseStatus(&message),
            static_cast<int>(Code::kResourceExhausted));
  EXPECT_NE(message.find("a key count of 70000 exceeds"), std::string::npos)
      << message;
  // The same connection still serves.
  req.values = {Bytes(16, 'v')};
  raw.send(protocol::frame(protocol::encodeRequest(req)));
  EXPECT_EQ(raw.readResponseStatus(), 0);
  EXPECT_EQ(bystander.get("big").size(), 16u);
  expectServerHealthy(bystander);
}

TEST_F(TcpStoreTest, AClientWithLargerLimitsThanTheServerKeepsWorking) {
  auto o = clientOptions(server_->port());
  o.limits.maxValueBytes = 4 << 20;  // the server takes 1 MiB
  TCPStore c(o);
  try {
    c.set("k", std::string(3 << 19, 'v'));  // 1.5 MiB: within its frame limit
    FAIL() << "the server took a value over its limit";
  } catch (const ResourceExhaustedError& e) {
    EXPECT_NE(std::string(e.what()).find("Limits::maxValueBytes"),
              std::string::npos)
        << e.what();
  }
  c.set("k", "small");
  EXPECT_EQ(c.getString("k"), "small");
}

TEST_F(TcpStoreTest, MalformedRequestsGetAnErrorAndAreClosed) {
  TCPStore bystander(clientOptions(server_->port()));
  const std::vector<Bytes> payloads = {
      {},                                 // empty frame: no op
      {0xEE},                             // unknown op
      {1, 5, 'a', 'b'},                   // key claims 5 bytes, 2 follow
      {1, 1, 'k', 3, 'v'},                // value claims 3 bytes, 1 follows
      {5, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F},  // wait with 2^32-1 keys
      {8, 0},                             // numKeys with a trailing byte
      {1, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01},
  };
  for (const auto& p : payloads) {
    RawClient raw(server_->port());
    raw.helloOk();
    Bytes f = le32(static_cast<uint32_t>(p.size()));
    f.insert(f.end(), p.begin(), p.end());
    raw.send(f);
    EXPECT_EQ(raw.readResponseStatus(), static_cast<int>(Code::kDataLoss))
        << "payload of " << p.size() << " bytes";
    EXPECT_TRUE(raw.closedByPeer());
  }
  expectServerHealthy(bystander);
  EXPECT_EQ(bystander.numKeys(), 1);  // only "health"
}

TEST_F(TcpStoreTest, TruncatedRequestsOnlyAffectThatClient) {
  TCPStore bystander(clientOptions(server_->port()));
  {
    // Half a hello, then gone.
    RawClient raw(server_->port());
    raw.send("TRS", 3);
  }
  {
    // A frame header promising 100 bytes, 10 sent, then gone.
    RawClient raw(server_->port());
    raw.helloOk();
    raw.send(le32(100));
    raw.send(Bytes(10, 1));
  }
  {
    // Silent after connecting: closed at the handshake timeout.
    RawClient raw(server_->port());
    EXPECT_TRUE(raw.closedByPeer());
  }
  expectServerHealthy(bystander);
}

TEST_F(TcpStoreTest, WaiterWhoseClientHangsUpIsDroppedAtOnce) {
  TCPStore bystander(clientOptions(server_->port()));
  const size_t before = server_->numConnections();
  {
    RawClient raw(server_->port());
    raw.helloOk();
    protocol::Request req;
    req.op = Op::kWait;
    req.keys = {"never"};
    req.timeoutMs = 0;  // no timeout: only the hang-up can end it
    raw.send(protocol::frame(protocol::encodeRequest(req)));
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (server_->numConnections() <= before &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_EQ(server_->numConnections(), before + 1);
  }
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (server_->numConnections() > before &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(server_->numConnections(), before);
  expectServerHealthy(bystander);
  bystander.set("never", "now");  // wakes nobody, breaks nothing
}

TEST_F(TcpStoreTest, ClientRejectsOversizedKeysAndValuesBeforeSending) {
  auto o = clientOptions(server_->port());
  o.limits.maxValueBytes = 1 << 20;
  TCPStore c(o);
  EXPECT_THROW(c.set(std::string(5000, 'k'), "v"), InvalidArgumentError);
  EXPECT_THROW(c.set("k", std::string((1 << 20) + 1, 'v')),
               InvalidArgumentError);
  // The connection is still fine: nothing was sent.
  c.set("k", std::string(1 << 20, 'v'));
  EXPECT_EQ(c.get("k").size(), 1u << 20);
}

TEST_F(TcpStoreTest, MultiGetLargerThanAFrameIsAnErrorNotABrokenClient) {
  TCPStore c(clientOptions(server_->port()));
  const std::string big((1 << 20) - 64, 'b');  // just under the value limit
  c.set("b1", big);
  c.set("b2", big);
  c.set("b3", big);  // three of them exceed the 2 MiB frame limit
  EXPECT_THROW(c.multiGet({"b1", "b2", "b3"}), ResourceExhaustedError);
  EXPECT_EQ(c.multiGet({"b1"}).at(0).size(), big.size());  // still usable
}

TEST(TcpStoreAuthTest, TokenMismatchesAreRejectedBeforeAnyRequest) {
  const auto token = auth::JobToken::generate();
  TCPStoreServerOptions so;
  so.jobToken = token;
  TCPStoreServer server(so);
  auto o = clientOptions(server.port());
  o.jobToken = token;
  TCPStore good(o);
  good.set("seen", "1");

  // No token at all.
  auto none = clientOptions(server.port());
  try {
    TCPStore c(none);
    FAIL() << "a client without a token must be rejected";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("requires a job token"),
              std::string::npos)
        << e.what();
  }
  // The wrong token.
  auto wrong = clientOptions(server.port());
  wrong.jobToken = auth::JobToken::generate();
  try {
    TCPStore c(wrong);
    FAIL() << "a client with the wrong token must be rejected";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("rejected"), std::string::npos)
        << e.what();
  }
  // A raw client that claims a token, sends a bogus proof and then a set
  // request: the request must never be served.
  {
    RawClient raw(server.port());
    const auto h = protocol::encodeClientHello(protocol::kVersion,
                                               protocol::kClientHasToken);
    raw.send(h.data(), h.size());
    ASSERT_EQ(raw.recvExactly(protocol::kServerHelloBytes).size(),
              protocol::kServerHelloBytes);
    ASSERT_EQ(raw.recvExactly(auth::kNonceBytes).size(), auth::kNonceBytes);
    raw.send(Bytes(auth::kNonceBytes + auth::kMacBytes, 0xAB));
    protocol::Request req;
    req.op = Op::kSet;
    req.keys = {"intruder"};
    req.values = {Bytes{'x'}};
    raw.send(protocol::frame(protocol::encodeRequest(req)));
    const Bytes verdict = raw.recvExactly(1);
    ASSERT_EQ(verdict.size(), 1u);
    EXPECT_EQ(verdict[0], protocol::kAuthRejected);
    EXPECT_TRUE(raw.closedByPeer());
  }
  // A raw client that claims no token and sends a request at once.
  {
    RawClient raw(server.port());
    const auto h = protocol::encodeClientHello(protocol::kVersion, 0);
    raw.send(h.data(), h.size());
    protocol::Request req;
    req.op = Op::kSet;
    req.keys = {"intruder"};
    req.values = {Bytes{'x'}};
    raw.send(protocol::frame(protocol::encodeRequest(req)));
    const Bytes reply = raw.recvExactly(protocol::kServerHelloBytes);
    ASSERT_EQ(reply.size(), protocol::kServerHelloBytes);
    EXPECT_EQ(reply[9], static_cast<uint8_t>(HelloStatus::kAuthMismatch));
    EXPECT_TRUE(raw.closedByPeer());
  }
  EXPECT_FALSE(good.check({"intruder"}));
  EXPECT_EQ(good.numKeys(), 1);
}

// The collectives watchdog's store handle: its own connection, so a get
// blocked on the original does not hold it back, with its own timeout.
TEST(TcpStoreCloneTest, CloneHasItsOwnConnectionTokenAndTimeout) {
  const auto token = auth::JobToken::generate();
  TCPStoreServerOptions so;
  so.jobToken = token;
  TCPStoreServer server(so);
  auto o = clientOptions(server.port());
  o.jobToken = token;
  auto original = std::make_shared<TCPStore>(o);
  PrefixStore prefixed("pg", original);
  std::unique_ptr<Store> clone = prefixed.clone(2000ms);
  ASSERT_NE(clone, nullptr);
  EXPECT_EQ(clone->timeout(), 2000ms);
  // The original blocks in a get of a key nobody sets yet.
  std::atomic<bool> got{false};
  std::thread blocked([&] {
    (void)original->get("late");
    got = true;
  });
  const auto start = std::chrono::steady_clock::now();
  clone->set("progress", "7");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms)
      << "the clone waited behind the original's blocked get";
  EXPECT_FALSE(got.load());
  TCPStore third(o);
  third.set("late", "x");
  blocked.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(original->getString("pg/progress"), "7");
  // Stores without a connection have nothing to clone.
  auto hash = std::make_shared<HashStore>();
  EXPECT_EQ(hash->clone(1000ms), nullptr);
  EXPECT_EQ(PrefixStore("x/", hash).clone(1000ms), nullptr);
}

TEST(TcpStoreAuthTest, ClientWithATokenRefusesAServerWithout) {
  TCPStoreServer server;
  auto o = clientOptions(server.port());
  o.jobToken = auth::JobToken::generate();
  try {
    TCPStore c(o);
    FAIL() << "token mismatch must fail";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("started without one"),
              std::string::npos)
        << e.what();
  }
}

TEST(TcpStoreConnectTest, ClientStartedBeforeTheServerRetriesUntilItIsUp) {
  // Find a free port, release it, and start the server there later.
  uint16_t port = 0;
  {
    TCPStoreServer probe;
    port = probe.port();
  }
  std::atomic<bool> connected{false};
  std::thread client([&] {
    auto o = clientOptions(port);
    o.connectTimeout = 20s;
    TCPStore c(o);
    c.set("early", "bird");
    connected = true;
  });
  // Deliberate delay, not a wait for a state: the client's first attempts
  // find nothing listening (the case under test). Shorter only makes the
  // test easier.
  std::this_thread::sleep_for(300ms);
  TCPStoreServerOptions so;
  so.port = port;
  TCPStoreServer server(so);
  client.join();
  EXPECT_TRUE(connected);
  TCPStore check(clientOptions(port));
  EXPECT_EQ(check.getString("early"), "bird");
}

TEST(TcpStoreConnectTest, NoServerIsAConnectionErrorAtTheConnectTimeout) {
  uint16_t port = 0;
  {
    TCPStoreServer probe;
    port = probe.port();
  }
  auto o = clientOptions(port);
  o.connectTimeout = 300ms;
  const auto elapsed = timed([&] {
    try {
      TCPStore c(o);
      FAIL() << "connect should fail";
    } catch (const ConnectionError& e) {
      EXPECT_NE(std::string(e.what()).find("attempts"), std::string::npos)
          << e.what();
    }
  });
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 10s);
}

TEST(TcpStoreServerDeathTest, KilledServerFailsEveryClientPromptly) {
  StoreProcess proc;
  ASSERT_NE(proc.port(), 0);
  constexpr int kClients = 5;
  std::vector<std::unique_ptr<TCPStore>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(std::make_unique<TCPStore>(clientOptions(proc.port())));
  }
  clients[0]->set("k", "v");
  // A get blocked in the server, with a 60 s timeout.
  std::atomic<int> blockedOutcome{0};  // 1 = ConnectionError, 2 = other
  std::chrono::milliseconds blockedElapsed{0};
  std::thread blocked([&] {
    blockedElapsed = timed([&] {
      try {
        clients[1]->get("never");
        blockedOutcome = 2;
      } catch (const ConnectionError&) {
        blockedOutcome = 1;
      } catch (...) {
        blockedOutcome = 2;
      }
    });
  });
  // Deliberate delay: lets the get reach the server and block there. A get
  // not yet sent fails with the same ConnectionError, so a short delay
  // cannot make the test pass wrongly, only less pointed.
  std::this_thread::sleep_for(300ms);
  const int status = proc.signalAndReap(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(status));
  blocked.join();
  EXPECT_EQ(blockedOutcome, 1);
  EXPECT_LT(blockedElapsed, 10s);

  // Every other client: every kind of operation fails with ConnectionError,
  // well before its 60 s timeout.
  std::vector<std::function<void(TCPStore&)>> ops = {
      [](TCPStore& c) { c.set("a", "b"); },
      [](TCPStore& c) { c.get("k"); },
      [](TCPStore& c) { c.add("n", 1); },
      [](TCPStore& c) { c.wait({"never"}); },
      [](TCPStore& c) { (void)c.check({"k"}); },  // expected to throw
  };
  for (int i = 2; i < kClients; ++i) {
    for (const auto& op : ops) {
      const auto elapsed =
          timed([&] { EXPECT_THROW(op(*clients[i]), ConnectionError); });
      EXPECT_LT(elapsed, 5s);
    }
  }
  EXPECT_THROW(clients[1]->ping(), ConnectionError);  // sticky
}

TEST(TcpStoreServerDeathTest, FrozenServerIsATimeoutThenTheClientIsBroken) {
  StoreProcess proc;
  ASSERT_NE(proc.port(), 0);
  auto o = clientOptions(proc.port());
  o.timeout = 300ms;
  TCPStore c(o);
  c.set("k", "v");
  ASSERT_EQ(::kill(proc.pid(), SIGSTOP), 0);
  // kill() returns before the stop lands: wait until it has.
  const int stopped = testing::waitPid(proc.pid(), 10s, WUNTRACED);
  ASSERT_TRUE(stopped != -1 && WIFSTOPPED(stopped)) << stopped;
  const auto elapsed = timed([&] {
    try {
      c.set("k", "w");
      ADD_FAILURE() << "a frozen server cannot answer";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("set"), std::string::npos)
          << e.what();
    }
  });
  EXPECT_GE(elapsed, 250ms);
  EXPECT_LT(elapsed, 10s);
  // A late answer would desynchronise the stream: the object is done.
  EXPECT_THROW(c.ping(), ConnectionError);
  ::kill(proc.pid(), SIGCONT);
}

TEST(TcpStoreServerDeathTest, StoppedEmbeddedServerFailsBlockedClients) {
  auto server = std::make_unique<TCPStoreServer>();
  TCPStore c(clientOptions(server->port()));
  std::atomic<bool> gotConnectionError{false};
  std::thread waiter([&] {
    try {
      c.wait({"never"}, 60s);
    } catch (const ConnectionError&) {
      gotConnectionError = true;
    } catch (...) {
    }
  });
  // Deliberate delay: lets the wait reach the server first (same outcome
  // either way, so it cannot make the test pass wrongly).
  std::this_thread::sleep_for(200ms);
  server->stop();
  server->stop();  // idempotent
  waiter.join();
  EXPECT_TRUE(gotConnectionError);
}

TEST(TcpStoreBinaryTest, SigtermStopsTheServerCleanly) {
  StoreProcess proc;
  ASSERT_NE(proc.port(), 0);
  {
    TCPStore c(clientOptions(proc.port()));
    c.set("x", "y");
    EXPECT_EQ(c.getString("x"), "y");
  }
  const int status = proc.signalAndReap(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(TcpStoreBinaryTest, ServesOnlyClientsWithTheJobToken) {
  const auto token = auth::JobToken::generate();
  StoreProcess proc(token.secret());
  ASSERT_NE(proc.port(), 0);
  auto o = clientOptions(proc.port());
  EXPECT_THROW(TCPStore{o}, AuthError);
  o.jobToken = token;
  TCPStore c(o);
  c.set("x", "y");
  EXPECT_EQ(c.numKeys(), 1);
}

// Thousands of connections blocked in wait() cost the server no thread:
// 2000 raw connections each send a wait and are all answered by one set.
TEST(TcpStoreScaleTest, TwoThousandWaitingConnectionsOnOneServerThread) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < 8192 && lim.rlim_max >= 8192) {
    lim.rlim_cur = 8192;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  if (lim.rlim_cur < 4200) {
    GTEST_SKIP() << "needs 4200 file descriptors, have " << lim.rlim_cur;
  }
  TCPStoreServer server;
  constexpr int kWaiters = 2000;
  std::vector<std::unique_ptr<RawClient>> waiters;
  protocol::Request req;
  req.op = Op::kWait;
  req.keys = {"release"};
  req.timeoutMs = 60000;
  const Bytes frame = protocol::frame(protocol::encodeRequest(req));
  for (int i = 0; i < kWaiters; ++i) {
    waiters.push_back(std::make_unique<RawClient>(server.port()));
    waiters.back()->helloOk();
    waiters.back()->send(frame);
  }
  EXPECT_EQ(server.numConnections(), static_cast<size_t>(kWaiters));
  TCPStore c(clientOptions(server.port()));
  c.set("other", "x");  // the server still serves while they all wait
  EXPECT_EQ(c.getString("other"), "x");
  c.set("release", "1");
  int answered = 0;
  for (auto& w : waiters) {
    answered += w->readResponseStatus() == 0 ? 1 : 0;
  }
  EXPECT_EQ(answered, kWaiters);
}

// 512 clients, each its own connection on its own thread, doing set, add,
// wait and get against one server; bounded by the clients' 60 s timeouts.
TEST(TcpStoreScaleTest, FiveHundredTwelveConcurrentClients) {
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  if (lim.rlim_cur < 4096 && lim.rlim_max >= 4096) {
    lim.rlim_cur = 4096;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  TCPStoreServer server;
  constexpr int kClients = 512;
  std::atomic<int> failures{0};
  std::atomic<int> connected{0};
  std::vector<std::thread> threads;
  threads.reserve(kClients);
  const auto elapsed = timed([&] {
    for (int i = 0; i < kClients; ++i) {
      threads.emplace_back([&, i] {
        try {
          TCPStore c(clientOptions(server.port()));
          connected.fetch_add(1);
          const std::string mine = "rank" + std::to_string(i);
          const std::string next = "rank" + std::to_string((i + 1) % kClients);
          c.set(mine, std::to_string(i));
          c.add("arrived", 1);
          c.wait({next});  // every client waits for its neighbour
          if (c.getString(next) != std::to_string((i + 1) % kClients)) {
            failures.fetch_add(1);
          }
          c.wait({"all-done"});  // woken by one set, all at once
        } catch (const std::exception& e) {
          ADD_FAILURE() << "client " << i << ": " << e.what();
          failures.fetch_add(1);
        }
      });
    }
    TCPStore coordinator(clientOptions(server.port()));
    // Every client must be connected (and thus holding a server coroutine,
    // no thread) before the release.
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (coordinator.getString("arrived") != std::to_string(kClients) &&
           std::chrono::steady_clock::now() < until) {
      coordinator.wait({"arrived"});
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_GE(server.numConnections(), static_cast<size_t>(kClients));
    coordinator.set("all-done", "1");
    for (auto& t : threads) {
      t.join();
    }
  });
  EXPECT_EQ(connected.load(), kClients);
  EXPECT_EQ(failures.load(), 0);
  RecordProperty("elapsed_ms", static_cast<int>(elapsed.count()));
}

}  // namespace
}  // namespace trellis::store
