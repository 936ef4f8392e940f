#include "transport_test_util.h"

#include <arpa/inet.h>
#include <cstring>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <trellis/transport/cma/factory.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport::testing {

namespace wf = wire_format;

namespace {
thread_local int tlInCall = 0;
}

std::string backendName(const ::testing::TestParamInfo<Backend>& info) {
  return info.param.name;
}

InCall::InCall() { ++tlInCall; }
InCall::~InCall() { --tlInCall; }
bool OnceChecker::inCall() { return tlInCall > 0; }

bool eventually(const std::function<bool()>& done,
                std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

bool OnceChecker::waitAll(std::chrono::milliseconds timeout) const {
  return eventually([&] { return fired_.load() >= created_.load(); }, timeout);
}

ContextOptions optionsFor(const Backend& b, std::string name) {
  ContextOptions o;
  o.name = std::move(name);
  o.transports = {b.transport};
  o.channels = b.channels;
  o.tokenFromEnvironment = false;
  return o;
}

std::shared_ptr<Pipe> acceptOne(Listener& l) {
  Promise<std::shared_ptr<Pipe>> p;
  l.accept([p](const Error& e, std::shared_ptr<Pipe> pipe) mutable {
    if (e.ok()) {
      p.setValue(std::move(pipe));
    } else {
      p.setError(e);
    }
  });
  return p.getFuture().wait(kWait);
}

PipePair makePair(const Backend& b, ContextOptions serverOpts,
                  ContextOptions clientOpts) {
  PipePair pp;
  pp.server = Context::create(std::move(serverOpts));
  pp.client = Context::create(std::move(clientOpts));
  if (b.cmaThreshold) {
    pp.server->registerChannel(150, cma::create({*b.cmaThreshold}));
    pp.client->registerChannel(150, cma::create({*b.cmaThreshold}));
  }
  pp.listener = pp.server->listen({b.listenAddr});
  pp.clientPipe = pp.client->connect(pp.listener->address(b.transport));
  pp.serverPipe = acceptOne(*pp.listener);
  return pp;
}

PipePair shmPair(size_t ringBytes,
                 std::optional<std::chrono::microseconds> spin) {
  auto setup = [&](std::shared_ptr<Context> c) {
    shm::Options o;
    o.ringBytes = ringBytes;
    o.spin = spin;
    c->registerTransport(200, shm::create(o));
    return c;
  };
  const Backend shmBackend{"shm",     "shm",   "shm://",
                           {"basic"}, "basic", std::nullopt};
  PipePair pp;
  pp.server = setup(Context::create(optionsFor(shmBackend, "server")));
  pp.client = setup(Context::create(optionsFor(shmBackend, "client")));
  pp.listener = pp.server->listen({shmBackend.listenAddr});
  pp.clientPipe = pp.client->connect(pp.listener->address("shm"));
  pp.serverPipe = acceptOne(*pp.listener);
  return pp;
}

Future<void> writeAsync(Pipe& pipe, Message m) {
  Promise<void> p;
  pipe.write(std::move(m), [p](const Error& e) mutable {
    if (e.ok()) {
      p.setValue();
    } else {
      p.setError(e);
    }
  });
  return p.getFuture();
}

Future<Received> readAsync(const std::shared_ptr<Pipe>& pipe) {
  Promise<Received> p;
  std::weak_ptr<Pipe> weak = pipe;
  pipe->readDescriptor([p, weak](const Error& e, Descriptor d) mutable {
    if (!e.ok()) {
      p.setError(e);
      return;
    }
    auto pipe = weak.lock();
    if (!pipe) {
      p.setError(Error::cancelled("pipe gone"));
      return;
    }
    auto rec = std::make_shared<Received>();
    rec->descriptor = std::move(d.descriptor);
    Allocation a;
    for (size_t len : d.payloadLengths) {
      rec->payloads.emplace_back(len);
      a.payloads.push_back({rec->payloads.back().data(), len});
    }
    for (const auto& t : d.tensors) {
      rec->tensors.emplace_back(t.length);
      a.tensors.push_back({rec->tensors.back().data(), t.length});
    }
    pipe->read(std::move(a), [p, rec](const Error& e) mutable {
      if (e.ok()) {
        p.setValue(std::move(*rec));
      } else {
        p.setError(e);
      }
    });
  });
  return p.getFuture();
}

void fillPattern(uint8_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    p[i] = static_cast<uint8_t>(x >> 24);
  }
}

bool checkPattern(const uint8_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    if (p[i] != static_cast<uint8_t>(x >> 24)) {
      return false;
    }
  }
  return true;
}

Message OwnedMessage::view() const {
  Message m;
  m.descriptor = descriptor;
  for (const auto& p : payloads) {
    m.payloads.push_back({p.data(), p.size()});
  }
  for (const auto& t : tensors) {
    m.tensors.push_back({t.data(), t.size(), Device::cpu()});
  }
  return m;
}

OwnedMessage patterned(const std::string& descriptor,
                       const std::vector<size_t>& payloadSizes,
                       const std::vector<size_t>& tensorSizes, uint32_t seed) {
  OwnedMessage m;
  m.descriptor = descriptor;
  uint32_t s = seed;
  for (size_t n : payloadSizes) {
    m.payloads.emplace_back(n);
    fillPattern(m.payloads.back().data(), n, s++);
  }
  for (size_t n : tensorSizes) {
    m.tensors.emplace_back(n);
    fillPattern(m.tensors.back().data(), n, s++);
  }
  return m;
}

int rawConnect(const std::string& uvAddress) {
  // Only the forms the tests use: uv://127.0.0.1:P and uv://[::1]:P.
  const std::string rest = uvAddress.substr(5);
  const size_t colon = rest.rfind(':');
  const int port = std::stoi(rest.substr(colon + 1));
  int fd;
  if (rest[0] == '[') {
    fd = ::socket(AF_INET6, SOCK_STREAM, 0);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET6, "::1", &a.sin6_addr);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      return -1;
    }
  } else {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, rest.substr(0, colon).c_str(), &a.sin_addr);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      return -1;
    }
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void rawSend(int fd, const std::vector<uint8_t>& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n =
        ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      return;
    }
    off += static_cast<size_t>(n);
  }
}

bool rawRecv(int fd, size_t n, std::vector<uint8_t>* out,
             std::chrono::milliseconds timeout) {
  out->resize(n);
  size_t off = 0;
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (off < n) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) {
      return false;
    }
    const ssize_t r = ::recv(fd, out->data() + off, n - off, 0);
    if (r <= 0) {
      return false;
    }
    off += static_cast<size_t>(r);
  }
  return true;
}

bool rawPeerClosed(int fd, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  uint8_t buf[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, 50) > 0) {
      const ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
      if (r <= 0) {
        return true;
      }
    }
  }
  return false;
}

static bool readHandshake(int fd, wf::HandshakeType type,
                          std::vector<uint8_t>* body) {
  std::vector<uint8_t> header;
  if (!rawRecv(fd, wf::kHandshakeHeaderBytes, &header)) {
    return false;
  }
  size_t len = 0;
  if (!wf::decodeHandshakeHeader(header, type, &len).ok()) {
    return false;
  }
  return rawRecv(fd, len, body);
}

bool rawHandshake(int fd) {
  std::string chosen;
  return rawHandshake(fd, {"basic"}, false, &chosen);
}

bool rawHandshake(int fd, const std::vector<std::string>& channels,
                  bool sameHost, std::string* chosen) {
  wf::Hello h;
  h.transports = {"uv"};
  h.channels = channels;
  h.hostId = sameHost ? localHostId() : "raw-test-peer";
  h.pid = sameHost ? static_cast<uint64_t>(::getpid()) : 1;
  rawSend(fd, wf::encodeHello(wf::HandshakeType::kHello, h));
  std::vector<uint8_t> body;
  if (!readHandshake(fd, wf::HandshakeType::kHelloReply, &body)) {
    return false;
  }
  wf::AuthMessage a;
  rawSend(fd, wf::encodeAuth(a));
  if (!readHandshake(fd, wf::HandshakeType::kAccept, &body)) {
    return false;
  }
  wf::AcceptMessage acc;
  if (!wf::decodeAccept(body, &acc).ok() ||
      acc.status != wf::AcceptStatus::kOk) {
    return false;
  }
  *chosen = acc.channel;
  return true;
}

std::vector<uint8_t> rawFrameHead(size_t descriptorLen,
                                  const std::vector<size_t>& payloads) {
  static const std::vector<std::vector<uint8_t>> kNoBuffers;
  Message m;
  m.descriptor.assign(descriptorLen, 'd');
  static const uint8_t kByte = 0;
  for (size_t n : payloads) {
    m.payloads.push_back({&kByte, n});
  }
  std::vector<uint8_t> out;
  wf::encodeFrameHead(m, &out);
  return out;
}

double processCpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

}  // namespace trellis::transport::testing
