// Transport benchmark: 8-byte ping-pong round trip and one-way throughput
// over Trellis pipes, next to baselines measured in the same run (raw TCP
// and UNIX sockets, memcpy). `--json` prints one JSON object per line.
//
// Buffers are allocated and touched once before timing: fresh pages fault
// at a fraction of copy bandwidth and would measure the kernel, not us.

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>
#include <vector>

#ifdef TRELLIS_BENCH_TENSORPIPE
#include <tensorpipe/tensorpipe.h>
#endif

#include "bench_util.h"
#include <trellis/core/future.h>
#include <trellis/transport/basic_channel.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/context.h>
#include <trellis/transport/shm/factory.h>

using namespace trellis;
using namespace trellis::transport;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kPingWarmup = 2000;
constexpr int kPings = 30000;
constexpr size_t kMiB = size_t{1} << 20;
const std::vector<size_t> kSizes = {1 * kMiB, 16 * kMiB, 64 * kMiB};
constexpr size_t kBytesPerSize = size_t{2} << 30;  // per throughput run

bench::Report report("transport");

std::vector<uint8_t> prefaulted(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 4096) {
    v[i] = 1;
  }
  return v;
}

void addLatency(const std::string& prefix, std::vector<double>& us,
                const std::string& baselinePrefix) {
  std::sort(us.begin(), us.end());
  const double median = us[us.size() / 2];
  const double p99 = us[us.size() * 99 / 100];
  report.add({prefix + "_rtt_8B_median", median, "us",
              baselinePrefix.empty() ? "" : baselinePrefix + "_rtt_8B_median"});
  report.add({prefix + "_rtt_8B_p99", p99, "us",
              baselinePrefix.empty() ? "" : baselinePrefix + "_rtt_8B_p99"});
}

// ---- raw socket baselines ----------------------------------------------

using bench::loopbackTcpPair;
using bench::recvAll;
using bench::sendAll;

std::vector<double> socketPingPong(int c, int s) {
  std::thread echo([s] {
    uint8_t b[8];
    for (int i = 0; i < kPingWarmup + kPings; ++i) {
      recvAll(s, b, 8);
      sendAll(s, b, 8);
    }
  });
  std::vector<double> us;
  uint8_t b[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int i = 0; i < kPingWarmup + kPings; ++i) {
    const auto t0 = Clock::now();
    sendAll(c, b, 8);
    recvAll(c, b, 8);
    if (i >= kPingWarmup) {
      us.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  echo.join();
  return us;
}

double socketThroughput(int c, int s, size_t size) {
  const size_t count = std::max<size_t>(kBytesPerSize / size, 4);
  auto src = prefaulted(size);
  auto dst = prefaulted(size);
  std::thread rx([&] {
    for (size_t i = 0; i < count; ++i) {
      recvAll(s, dst.data(), size);
    }
    uint8_t ack = 1;
    sendAll(s, &ack, 1);
  });
  const auto t0 = Clock::now();
  for (size_t i = 0; i < count; ++i) {
    sendAll(c, src.data(), size);
  }
  uint8_t ack;
  recvAll(c, &ack, 1);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  rx.join();
  return static_cast<double>(count * size) / secs / 1e9;
}

void rawBaselines() {
  auto [c, s] = loopbackTcpPair();
  auto us = socketPingPong(c, s);
  addLatency("tcp", us, "");
  for (size_t size : kSizes) {
    report.add({"tcp_throughput_" + std::to_string(size / kMiB) + "MiB",
                socketThroughput(c, s, size), "GB/s", ""});
  }
  ::close(c);
  ::close(s);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    std::perror("socketpair");
    std::exit(1);
  }
  auto uus = socketPingPong(sv[0], sv[1]);
  addLatency("unix", uus, "");
  ::close(sv[0]);
  ::close(sv[1]);
}

void memcpyBaseline() {
  const size_t n = 64 * kMiB;
  auto a = prefaulted(n);
  auto b = prefaulted(n);
  const int reps = 32;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) {
    std::memcpy(b.data(), a.data(), n);
    a[i] = b[n - 1 - i];  // keep the copies observable
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  report.add({"memcpy_64MiB", reps * n / secs / 1e9, "GB/s", ""});
}

// ---- Trellis pipes -------------------------------------------------------

struct PipeBench {
  std::shared_ptr<Context> server;
  std::shared_ptr<Context> client;
  std::shared_ptr<Listener> listener;
  std::shared_ptr<Pipe> c;
  std::shared_ptr<Pipe> s;

  // `setup` runs on both contexts before they listen or connect.
  // `transports` restricts both contexts (empty: all).
  explicit PipeBench(const std::string& address,
                     const std::function<void(Context&)>& setup = nullptr,
                     std::vector<std::string> transports = {}) {
    ContextOptions o;
    o.tokenFromEnvironment = false;
    o.transports = std::move(transports);
    o.name = "bench-server";
    server = Context::create(o);
    o.name = "bench-client";
    client = Context::create(o);
    if (setup) {
      setup(*server);
      setup(*client);
    }
    listener = server->listen({address});
    c = client->connect(listener->addresses().begin()->second);
    Promise<std::shared_ptr<Pipe>> p;
    listener->accept([p](const Error& e, std::shared_ptr<Pipe> pipe) mutable {
      e.ok() ? p.setValue(pipe) : p.setError(e);
    });
    s = p.getFuture().wait(std::chrono::seconds(30));
  }
};

// Ping-pong driven from callbacks on the loop threads, as an RPC layer
// would: no extra thread hop per message.
std::vector<double> pipePingPong(PipeBench& b) {
  uint8_t serverBuf[8];
  uint8_t clientBuf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t clientIn[8];
  Promise<void> served;
  std::function<void()> serve = [&] {
    b.s->readDescriptor([&](const Error& e, Descriptor d) {
      if (!e.ok()) {
        Promise<void>(served).setError(e);
        return;
      }
      const bool stop = d.descriptor == "stop";
      b.s->read(Allocation{{{serverBuf, 8}}, {}}, [&, stop](const Error& e) {
        if (!e.ok() || stop) {
          e.ok() ? Promise<void>(served).setValue()
                 : Promise<void>(served).setError(e);
          return;
        }
        Message m;
        m.payloads.push_back({serverBuf, 8});
        b.s->write(std::move(m), [](const Error&) {});
        serve();
      });
    });
  };
  serve();
  std::vector<double> us;
  us.reserve(kPings);
  Promise<void> done;
  int i = 0;
  Clock::time_point t0;
  std::function<void()> ping = [&] {
    t0 = Clock::now();
    Message m;
    m.payloads.push_back({clientBuf, 8});
    b.c->write(std::move(m), [](const Error&) {});
    b.c->readDescriptor([&](const Error& e, Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      b.c->read(Allocation{{{clientIn, 8}}, {}}, [&](const Error& e) {
        if (!e.ok()) {
          Promise<void>(done).setError(e);
          return;
        }
        if (i++ >= kPingWarmup) {
          us.push_back(
              std::chrono::duration<double, std::micro>(Clock::now() - t0)
                  .count());
        }
        if (i == kPingWarmup + kPings) {
          Promise<void>(done).setValue();
        } else {
          ping();
        }
      });
    });
  };
  ping();
  done.getFuture().wait(std::chrono::seconds(120));
  Message stop;
  stop.descriptor = "stop";
  stop.payloads.push_back({clientBuf, 8});
  b.c->write(std::move(stop), [](const Error&) {});
  served.getFuture().wait(std::chrono::seconds(30));
  return us;
}

// One-way throughput; `asTensor` sends the bytes as one CPU tensor (which a
// cma pipe moves out of band) instead of a payload.
double pipeThroughput(PipeBench& b, size_t size, bool asTensor = false,
                      size_t total = kBytesPerSize) {
  const size_t count = std::max<size_t>(total / size, 4);
  auto src = prefaulted(size);
  auto dst = prefaulted(size);
  Promise<void> done;
  size_t received = 0;
  std::function<void()> readNext = [&] {
    b.s->readDescriptor([&](const Error& e, Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      Allocation a;
      (asTensor ? a.tensors : a.payloads).push_back({dst.data(), size});
      b.s->read(std::move(a), [&](const Error& e) {
        if (!e.ok()) {
          Promise<void>(done).setError(e);
        } else if (++received == count) {
          Promise<void>(done).setValue();
        } else {
          readNext();
        }
      });
    });
  };
  readNext();
  const auto t0 = Clock::now();
  for (size_t i = 0; i < count; ++i) {
    Message m;
    if (asTensor) {
      m.tensors.push_back({src.data(), size, Device{}});
    } else {
      m.payloads.push_back({src.data(), size});
    }
    b.c->write(std::move(m), [](const Error&) {});
  }
  done.getFuture().wait(std::chrono::seconds(120));
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(count * size) / secs / 1e9;
}

void trellisUv() {
  {
    // Unrestricted, a pipe connected over uv in one host moves to shm (the
    // same-host upgrade): this row shows it.
    PipeBench b("uv://127.0.0.1:0");
    auto us = pipePingPong(b);
    addLatency("uv_upgraded", us, "tcp");
  }
  PipeBench b("uv://127.0.0.1:0", nullptr, {"uv"});
  auto us = pipePingPong(b);
  addLatency("uv", us, "tcp");
  for (size_t size : kSizes) {
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add({"uv_throughput_" + n, pipeThroughput(b, size), "GB/s",
                "tcp_throughput_" + n});
  }
}

// shm with its default spinning, then with spinning off (every message
// then waits for an eventfd wake-up), to show what the spin buys.
void trellisShm() {
  {
    PipeBench b("shm://");
    auto us = pipePingPong(b);
    addLatency("shm", us, "tcp");
    for (size_t size : kSizes) {
      const std::string n = std::to_string(size / kMiB) + "MiB";
      report.add({"shm_throughput_" + n, pipeThroughput(b, size), "GB/s",
                  "tcp_throughput_" + n});
    }
  }
  PipeBench b("shm://", [](Context& c) {
    shm::Options o;
    o.spin = std::chrono::microseconds(0);
    c.registerTransport(200, shm::create(o));
  });
  auto us = pipePingPong(b);
  addLatency("shm_nospin", us, "tcp");
}

// CPU tensors over shm + cma (process_vm_readv straight into the reader's
// buffer: one copy) against shm + basic (through the ring: two copies), the
// large sizes against memcpy. Both contexts are in this process; cma reads
// from its own pid, the same kernel path as from a sibling. The small sizes
// show where cma starts to pay, which sets its default threshold.
void trellisCma() {
  auto only = [](const std::string& channel) {
    return [channel](Context& c) {
      if (channel == "cma") {
        c.registerChannel(150, cma::create({0}));
      } else {
        c.registerChannel(150, basic::create());
        c.registerChannel(100, cma::create({~size_t{0}}));
      }
    };
  };
  PipeBench cmaPipe("shm://", only("cma"));
  PipeBench basicPipe("shm://", only("basic"));
  for (size_t size : {size_t{64} << 10, size_t{256} << 10, size_t{1} << 20}) {
    const std::string n = std::to_string(size >> 10) + "KiB";
    report.add({"shm_basic_tensor_" + n,
                pipeThroughput(basicPipe, size, true, 256 * kMiB), "GB/s", ""});
    report.add({"cma_tensor_" + n,
                pipeThroughput(cmaPipe, size, true, 256 * kMiB), "GB/s",
                "shm_basic_tensor_" + n});
  }
  for (size_t size : kSizes) {
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add({"cma_throughput_" + n, pipeThroughput(cmaPipe, size, true),
                "GB/s", "memcpy_64MiB"});
  }
}

#ifdef TRELLIS_BENCH_TENSORPIPE
// TensorPipe's uv transport + basic channel, measured the same way: ping-pong
// from callbacks on its loop, one-way throughput into a reused buffer.
void tensorpipeUv() {
  auto server = std::make_shared<tensorpipe::Context>();
  auto client = std::make_shared<tensorpipe::Context>();
  for (auto& ctx : {server, client}) {
    ctx->registerTransport(0, "uv", tensorpipe::transport::uv::create());
    ctx->registerChannel(0, "basic", tensorpipe::channel::basic::create());
  }
  auto listener = server->listen({"uv://127.0.0.1:0"});
  Promise<std::shared_ptr<tensorpipe::Pipe>> accepted;
  listener->accept([accepted](const tensorpipe::Error& e,
                              std::shared_ptr<tensorpipe::Pipe> p) mutable {
    e ? accepted.setError(Error::connection(e.what())) : accepted.setValue(p);
  });
  auto c = client->connect(listener->url("uv"));
  auto s = accepted.getFuture().wait(std::chrono::seconds(30));

  uint8_t serverBuf[8];
  uint8_t clientBuf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t clientIn[8];
  Promise<void> served;
  std::function<void()> serve = [&] {
    s->readDescriptor(
        [&](const tensorpipe::Error& e, tensorpipe::Descriptor d) {
          if (e) {
            Promise<void>(served).setError(Error::connection(e.what()));
            return;
          }
          const bool stop = d.metadata == "stop";
          tensorpipe::Allocation a;
          a.payloads.push_back({serverBuf});
          s->read(a, [&, stop](const tensorpipe::Error& e) {
            if (e || stop) {
              e ? Promise<void>(served).setError(Error::connection(e.what()))
                : Promise<void>(served).setValue();
              return;
            }
            tensorpipe::Message m;
            m.payloads.push_back({serverBuf, 8});
            s->write(std::move(m), [](const tensorpipe::Error&) {});
            serve();
          });
        });
  };
  serve();
  std::vector<double> us;
  Promise<void> done;
  int i = 0;
  Clock::time_point t0;
  std::function<void()> ping = [&] {
    t0 = Clock::now();
    tensorpipe::Message m;
    m.payloads.push_back({clientBuf, 8});
    c->write(std::move(m), [](const tensorpipe::Error&) {});
    c->readDescriptor([&](const tensorpipe::Error& e, tensorpipe::Descriptor) {
      if (e) {
        Promise<void>(done).setError(Error::connection(e.what()));
        return;
      }
      tensorpipe::Allocation a;
      a.payloads.push_back({clientIn});
      c->read(a, [&](const tensorpipe::Error& e) {
        if (e) {
          Promise<void>(done).setError(Error::connection(e.what()));
          return;
        }
        if (i++ >= kPingWarmup) {
          us.push_back(
              std::chrono::duration<double, std::micro>(Clock::now() - t0)
                  .count());
        }
        if (i == kPingWarmup + kPings) {
          Promise<void>(done).setValue();
        } else {
          ping();
        }
      });
    });
  };
  ping();
  done.getFuture().wait(std::chrono::seconds(120));
  {
    tensorpipe::Message m;
    m.metadata = "stop";
    m.payloads.push_back({clientBuf, 8});
    c->write(std::move(m), [](const tensorpipe::Error&) {});
    served.getFuture().wait(std::chrono::seconds(30));
  }
  addLatency("tensorpipe_uv", us, "tcp");

  for (size_t size : kSizes) {
    const size_t count = std::max<size_t>(kBytesPerSize / size, 4);
    auto src = prefaulted(size);
    auto dst = prefaulted(size);
    Promise<void> all;
    size_t received = 0;
    std::function<void()> readNext = [&] {
      s->readDescriptor(
          [&](const tensorpipe::Error& e, tensorpipe::Descriptor) {
            if (e) {
              Promise<void>(all).setError(Error::connection(e.what()));
              return;
            }
            tensorpipe::Allocation a;
            a.payloads.push_back({dst.data()});
            s->read(a, [&](const tensorpipe::Error& e) {
              if (e) {
                Promise<void>(all).setError(Error::connection(e.what()));
              } else if (++received == count) {
                Promise<void>(all).setValue();
              } else {
                readNext();
              }
            });
          });
    };
    readNext();
    const auto start = Clock::now();
    for (size_t k = 0; k < count; ++k) {
      tensorpipe::Message m;
      m.payloads.push_back({src.data(), size});
      c->write(std::move(m), [](const tensorpipe::Error&) {});
    }
    all.getFuture().wait(std::chrono::seconds(120));
    const double secs =
        std::chrono::duration<double>(Clock::now() - start).count();
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add({"tensorpipe_uv_throughput_" + n,
                static_cast<double>(count * size) / secs / 1e9, "GB/s",
                "tcp_throughput_" + n});
  }
  c->close();
  s->close();
  client->close();
  server->close();
  client->join();
  server->join();
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else {
      std::fprintf(stderr, "usage: %s [--json]\n", argv[0]);
      return 2;
    }
  }
  rawBaselines();
  memcpyBaseline();
  trellisUv();
  trellisShm();
  trellisCma();
#ifdef TRELLIS_BENCH_TENSORPIPE
  tensorpipeUv();
#endif
  report.print(json);
  return 0;
}
