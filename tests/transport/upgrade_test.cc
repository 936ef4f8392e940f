// The same-host upgrade (docs/transport.md, "Same-host upgrade"): pipes
// that connect over uv between processes of one host move to shm when both
// sides allow and can use it, and stay on uv otherwise; hostile peers on
// either side cost only their own pipe.

#include <arpa/inet.h>
#include <memory>
#include <netinet/in.h>
#include <string>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include "peer_process.h"
#include "transport_test_util.h"
#include <trellis/transport/channel.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport::testing {
namespace {

namespace wf = wire_format;

ContextOptions defaults(std::string name) {
  ContextOptions o;
  o.name = std::move(name);
  o.tokenFromEnvironment = false;
  return o;
}

// Writes one message each way and returns the transports both ends report.
std::pair<std::string, std::string> roundTrip(Pipe& client,
                                              const std::shared_ptr<Pipe>& s) {
  auto m = patterned("up", {100}, {1000}, 5);
  writeAsync(client, m.view()).wait(kWait);
  auto r = readAsync(s).wait(kWait);
  EXPECT_EQ(r.tensors.at(0), m.tensors.at(0));
  return {client.transportName(), s->transportName()};
}

TEST(SameHostUpgrade, OneProcessTwoContextsOverUvMoveToShm) {
  auto server = Context::create(defaults("server"));
  auto client = Context::create(defaults("client"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(l->address("uv"));
  auto s = acceptOne(*l);
  auto [ct, st] = roundTrip(*c, s);
  EXPECT_EQ(ct, "shm");
  EXPECT_EQ(st, "shm");
  // And back, many times, in order.
  for (int i = 0; i < 200; ++i) {
    auto m = patterned(std::to_string(i), {static_cast<size_t>(i)}, {}, i);
    writeAsync(*s, m.view()).wait(kWait);
    EXPECT_EQ(readAsync(c).wait(kWait).descriptor, std::to_string(i));
  }
}

TEST(SameHostUpgrade, TokensAreProvedOnTheBind) {
  auto o = defaults("server");
  o.token = auth::JobToken::fromString("upgrade-secret-0123456789");
  auto server = Context::create(o);
  o.name = "client";
  auto client = Context::create(o);
  auto l = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(l->address("uv"));
  auto s = acceptOne(*l);
  EXPECT_EQ(roundTrip(*c, s).first, "shm");
}

TEST(SameHostUpgrade, RestrictedOrUnusableShmOnEitherSideStaysOnUv) {
  auto uvOnly = defaults("restricted");
  uvOnly.transports = {"uv"};
  for (int side = 0; side < 2; ++side) {
    auto server = Context::create(side == 0 ? uvOnly : defaults("server"));
    auto client = Context::create(side == 1 ? uvOnly : defaults("client"));
    auto l = server->listen({"uv://127.0.0.1:0"});
    auto c = client->connect(l->address("uv"));
    auto s = acceptOne(*l);
    auto [ct, st] = roundTrip(*c, s);
    EXPECT_EQ(ct, "uv") << "side " << side;
    EXPECT_EQ(st, "uv") << "side " << side;
  }
  // shm not viable on one side (rings of 3 bytes: bad options).
  shm::Options bad;
  bad.ringBytes = 3;
  for (int side = 0; side < 2; ++side) {
    auto server = Context::create(defaults("server"));
    auto client = Context::create(defaults("client"));
    (side == 0 ? server : client)->registerTransport(200, shm::create(bad));
    auto l = server->listen({"uv://127.0.0.1:0"});
    auto c = client->connect(l->address("uv"));
    auto s = acceptOne(*l);
    auto [ct, st] = roundTrip(*c, s);
    EXPECT_EQ(ct, "uv") << "side " << side;
    EXPECT_EQ(st, "uv") << "side " << side;
  }
}

// ---- two processes ---------------------------------------------------------

TEST(SameHostUpgrade, TwoProcessesOverUvEndUpOnShmWithCma) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  constexpr size_t kBytes = size_t{4} << 20;
  auto child = spawnHelper(CMA_PEER_HELPER,
                           {"send", l->address("uv"), std::to_string(kBytes)});
  auto pipe = acceptOne(*l);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready shm cma");
  EXPECT_EQ(pipe->transportName(), "shm");
  EXPECT_EQ(pipe->channelName(), "cma");
  EXPECT_NE(pipe->peerAddress().find("pid " + std::to_string(child->pid)),
            std::string::npos)
      << pipe->peerAddress();
  auto r = readAsync(pipe).wait(kWait);
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_TRUE(checkPattern(r.tensors[0].data(), kBytes, 7));
  EXPECT_EQ(child->readLine(30000), "written ok");
  const int status = child->wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(SameHostUpgrade, TwoProcessesStayOnUvWhenTheClientSaysSo) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  // 1 MiB: above cma's threshold, so the helper's write waits for this
  // read and the helper cannot exit (and close the pipe) before it.
  auto child =
      spawnHelper(CMA_PEER_HELPER, {"send", l->address("uv"), "1048576"},
                  {"TRELLIS_TRANSPORTS=uv"});
  auto pipe = acceptOne(*l);
  EXPECT_EQ(readAsync(pipe).wait(kWait).descriptor, "hello");
  EXPECT_EQ(child->readLine(30000), "ready uv cma");
  EXPECT_EQ(pipe->transportName(), "uv");
  auto r = readAsync(pipe).wait(kWait);
  ASSERT_EQ(r.tensors.size(), 1u);
  EXPECT_TRUE(checkPattern(r.tensors[0].data(), r.tensors[0].size(), 7));
  EXPECT_EQ(child->readLine(30000), "written ok");
  child->wait();
}

// ---- hostile acceptor ------------------------------------------------------

struct RawAcceptor {
  int listenFd = -1;
  int fd = -1;
  std::string address;
  RawAcceptor() {
    listenFd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = 0;
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(::bind(listenFd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listenFd, 4), 0);
    socklen_t len = sizeof(a);
    ::getsockname(listenFd, reinterpret_cast<sockaddr*>(&a), &len);
    address = "uv://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~RawAcceptor() {
    if (fd >= 0) {
      ::close(fd);
    }
    ::close(listenFd);
  }
  bool acceptOne() {
    pollfd p{listenFd, POLLIN, 0};
    if (::poll(&p, 1, 10000) != 1) {
      return false;
    }
    fd = ::accept(listenFd, nullptr, nullptr);
    return fd >= 0;
  }
  bool readMessage(wf::HandshakeType type, std::vector<uint8_t>* body) {
    std::vector<uint8_t> header;
    size_t len = 0;
    return rawRecv(fd, wf::kHandshakeHeaderBytes, &header) &&
           wf::decodeHandshakeHeader(header, type, &len).ok() &&
           rawRecv(fd, len, body);
  }
  // Runs the acceptor's handshake, offering `upgrade` in the accept.
  bool handshake(const std::string& upgrade) {
    std::vector<uint8_t> body;
    if (!acceptOne() || !readMessage(wf::HandshakeType::kHello, &body)) {
      return false;
    }
    wf::Hello h;
    h.transports = {"uv", "shm"};
    h.channels = {"basic"};
    h.hostId = localHostId();
    h.pid = static_cast<uint64_t>(::getpid());
    h.nonce = auth::randomNonce();
    rawSend(fd, wf::encodeHello(wf::HandshakeType::kHelloReply, h));
    if (!readMessage(wf::HandshakeType::kAuth, &body)) {
      return false;
    }
    wf::AcceptMessage acc;
    acc.transport = "uv";
    acc.channel = "basic";
    acc.upgradeAddress = upgrade;
    acc.upgradeToken = auth::randomNonce();
    rawSend(fd, wf::encodeAccept(acc));
    return true;
  }
};

TEST(SameHostUpgradeHostile, BadAdvertisedAddressFallsBackToUv) {
  for (const std::string bad :
       {"shm://../../etc/passwd", "uv://10.0.0.1:1", "shm://",
        "shm://trellis-nobody-listens-here"}) {
    RawAcceptor raw;
    auto client = Context::create(defaults("client"));
    auto c = client->connect(raw.address);
    ASSERT_TRUE(raw.handshake(bad)) << bad;
    std::vector<uint8_t> body;
    ASSERT_TRUE(raw.readMessage(wf::HandshakeType::kUpgradeFailed, &body))
        << bad;
    std::string reason;
    ASSERT_TRUE(wf::decodeUpgradeFailed(body, &reason).ok());
    EXPECT_FALSE(reason.empty());
    rawSend(raw.fd, wf::encodeUpgradeDecision(wf::UpgradeDecision::kStay));
    // The pipe runs over the first connection.
    auto w = writeAsync(*c, patterned("after", {}, {}, 0).view());
    std::vector<uint8_t> head;
    ASSERT_TRUE(rawRecv(raw.fd, wf::kFrameHeaderBytes, &head)) << bad;
    w.wait(kWait);
    EXPECT_EQ(c->transportName(), "uv") << bad;
  }
}

TEST(SameHostUpgradeHostile, SwitchWithoutABoundConnectionFailsThatPipe) {
  RawAcceptor raw;
  auto client = Context::create(defaults("client"));
  auto c = client->connect(raw.address);
  ASSERT_TRUE(raw.handshake("shm://../bad"));
  std::vector<uint8_t> body;
  ASSERT_TRUE(raw.readMessage(wf::HandshakeType::kUpgradeFailed, &body));
  rawSend(raw.fd, wf::encodeUpgradeDecision(wf::UpgradeDecision::kSwitch));
  auto w = writeAsync(*c, Message());
  ASSERT_TRUE(w.waitFor(kWait));
  EXPECT_EQ(w.error().code(), Code::kDataLoss) << w.error().what();
  EXPECT_NE(w.error().message().find("no shm connection was bound"),
            std::string::npos)
      << w.error().what();
}

// ---- hostile connector -----------------------------------------------------

// A raw connector on one host that offers shm; returns the accept.
wf::AcceptMessage rawSameHostHandshake(int fd) {
  wf::Hello h;
  h.transports = {"uv", "shm"};
  h.channels = {"basic"};
  h.hostId = localHostId();
  h.pid = static_cast<uint64_t>(::getpid());
  rawSend(fd, wf::encodeHello(wf::HandshakeType::kHello, h));
  std::vector<uint8_t> header;
  std::vector<uint8_t> body;
  size_t len = 0;
  EXPECT_TRUE(rawRecv(fd, wf::kHandshakeHeaderBytes, &header));
  EXPECT_TRUE(
      wf::decodeHandshakeHeader(header, wf::HandshakeType::kHelloReply, &len)
          .ok());
  EXPECT_TRUE(rawRecv(fd, len, &body));
  rawSend(fd, wf::encodeAuth(wf::AuthMessage{}));
  EXPECT_TRUE(rawRecv(fd, wf::kHandshakeHeaderBytes, &header));
  EXPECT_TRUE(
      wf::decodeHandshakeHeader(header, wf::HandshakeType::kAccept, &len).ok());
  EXPECT_TRUE(rawRecv(fd, len, &body));
  wf::AcceptMessage acc;
  EXPECT_TRUE(wf::decodeAccept(body, &acc).ok());
  return acc;
}

TEST(SameHostUpgradeHostile, ConnectorThatCannotUpgradeStaysOnUv) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  const int fd = rawConnect(l->address("uv"));
  auto acc = rawSameHostHandshake(fd);
  EXPECT_EQ(acc.upgradeAddress.rfind("shm://", 0), 0u) << acc.upgradeAddress;
  ASSERT_TRUE(acc.upgradeToken.has_value());
  auto s = acceptOne(*l);
  rawSend(fd, wf::encodeUpgradeFailed("no shm here"));
  std::vector<uint8_t> header;
  std::vector<uint8_t> body;
  size_t len = 0;
  ASSERT_TRUE(rawRecv(fd, wf::kHandshakeHeaderBytes, &header));
  ASSERT_TRUE(wf::decodeHandshakeHeader(
                  header, wf::HandshakeType::kUpgradeDecision, &len)
                  .ok());
  ASSERT_TRUE(rawRecv(fd, len, &body));
  wf::UpgradeDecision d;
  ASSERT_TRUE(wf::decodeUpgradeDecision(body, &d).ok());
  EXPECT_EQ(d, wf::UpgradeDecision::kStay);
  auto head = rawFrameHead(2, {});
  head.insert(head.end(), {'o', 'k'});
  rawSend(fd, head);
  EXPECT_EQ(readAsync(s).wait(kWait).descriptor, "ok");
  EXPECT_EQ(s->transportName(), "uv");
  ::close(fd);
}

TEST(SameHostUpgradeHostile, SilentConnectorIsKeptOnUvAfterTheBindWait) {
  auto o = defaults("server");
  o.handshakeTimeout = std::chrono::seconds(2);  // bind wait: 1 s
  auto server = Context::create(o);
  auto l = server->listen({"uv://127.0.0.1:0"});
  const int fd = rawConnect(l->address("uv"));
  auto acc = rawSameHostHandshake(fd);
  ASSERT_FALSE(acc.upgradeAddress.empty());
  auto s = acceptOne(*l);
  // Neither a bind nor "upgrade failed": the acceptor decides alone.
  std::vector<uint8_t> header;
  std::vector<uint8_t> body;
  size_t len = 0;
  ASSERT_TRUE(rawRecv(fd, wf::kHandshakeHeaderBytes, &header,
                      std::chrono::seconds(10)));
  ASSERT_TRUE(wf::decodeHandshakeHeader(
                  header, wf::HandshakeType::kUpgradeDecision, &len)
                  .ok());
  ASSERT_TRUE(rawRecv(fd, len, &body));
  wf::UpgradeDecision d;
  ASSERT_TRUE(wf::decodeUpgradeDecision(body, &d).ok());
  EXPECT_EQ(d, wf::UpgradeDecision::kStay);
  auto head = rawFrameHead(1, {});
  head.push_back('x');
  rawSend(fd, head);
  EXPECT_EQ(readAsync(s).wait(kWait).descriptor, "x");
  EXPECT_EQ(s->transportName(), "uv");
  ::close(fd);
}

TEST(SameHostUpgradeHostile, GarbageInsteadOfTheUpgradeFailsThatPipeOnly) {
  auto server = Context::create(defaults("server"));
  auto l = server->listen({"uv://127.0.0.1:0"});
  const int fd = rawConnect(l->address("uv"));
  rawSameHostHandshake(fd);
  auto s = acceptOne(*l);
  rawSend(fd, std::vector<uint8_t>(64, 0xee));
  auto r = readAsync(s);
  ASSERT_TRUE(r.waitFor(kWait));
  EXPECT_EQ(r.error().code(), Code::kDataLoss) << r.error().what();
  EXPECT_TRUE(rawPeerClosed(fd, std::chrono::seconds(10)));
  ::close(fd);
  // The listener goes on, and a new pipe still upgrades.
  auto client = Context::create(defaults("client"));
  auto c = client->connect(l->address("uv"));
  auto s2 = acceptOne(*l);
  EXPECT_EQ(roundTrip(*c, s2).first, "shm");
}

}  // namespace
}  // namespace trellis::transport::testing
