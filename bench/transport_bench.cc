// Transport benchmark: 8-byte ping-pong round trip and one-way throughput
// over Trellis pipes, next to baselines measured in the same run (raw TCP
// and UNIX sockets, memcpy). `--json` prints one JSON object per line;
// notes (`# ...`, e.g. a row skipped) go to stderr. `--only uv,shm` runs
// only those sections after the baselines.
//
// Buffers are allocated and touched once before timing: fresh pages fault
// at a fraction of copy bandwidth and would measure the kernel, not us.
//
// The `*_hugepages` rows repeat memcpy and cma with both buffers on 2 MiB
// transparent huge pages: process_vm_readv walks and pins the source page
// by page, so on 4 KiB pages it runs at a fraction of memcpy speed while on
// huge pages it comes close to it. They show what cma can reach when a
// user's tensors live on huge pages. `process_vm_readv_64MiB_2threads` is
// that system call alone, from and to 4 KiB pages on two threads as the
// channel copies: the kernel's ceiling for `cma_throughput_64MiB`, which
// `cma_throughput_64MiB_vs_readv` quotes against it.
//
// Built as transport_bench_tensorpipe (TRELLIS_BENCH_TENSORPIPE) it also
// measures TensorPipe in the same run, the same way: its uv and shm
// transports with the basic channel (`tensorpipe_uv_*`, `tensorpipe_shm_*`)
// and its cma channel over shm (`tensorpipe_cma_*`), so that each of our
// rows has its TensorPipe counterpart next to it.

#include <algorithm>
#include <arpa/inet.h>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <optional>
#include <stdexcept>
#include <string>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#ifdef TRELLIS_BENCH_TENSORPIPE
#include <tensorpipe/tensorpipe.h>
#endif

#include "bench_util.h"
#include "pipe_bench_util.h"
#include <trellis/core/future.h>
#include <trellis/transport/basic/factory.h>
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

using bench::kHugePage;
using bench::note;
using bench::prefaulted;

// Which pages a throughput run's buffers are on.
enum class Pages { kSmall, kHuge };

// A throughput run's source or destination. Where the kernel granted fewer
// huge pages than asked, a note says so: the row then measures a mix.
bench::Buffer runBuffer(size_t n, Pages pages, const std::string& row) {
  bench::Buffer b(n, pages == Pages::kHuge);
  if (pages == Pages::kHuge) {
    const double share = b.hugeShare();
    if (share < 0.99) {
      note(row + ": only " + std::to_string(share) +
           " of a buffer's mapping is on huge pages (-1: unknown)");
    }
  }
  return b;
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

// Times the round trips of one ping-pong run: start() as a ping goes out,
// finish() when its reply is in; finish() keeps the times past the warm-up
// and says whether that reply was the last of the run.
class PingClock {
 public:
  PingClock() { us_.reserve(kPings); }
  void start() { t0_ = Clock::now(); }
  bool finish() {
    if (count_++ >= kPingWarmup) {
      us_.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t0_)
              .count());
    }
    return count_ == kPingWarmup + kPings;
  }
  std::vector<double>& times() { return us_; }

 private:
  std::vector<double> us_;
  Clock::time_point t0_;
  int count_ = 0;
};

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
  PingClock clock;
  uint8_t b[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  do {
    clock.start();
    sendAll(c, b, 8);
    recvAll(c, b, 8);
  } while (!clock.finish());
  echo.join();
  return std::move(clock.times());
}

double socketThroughput(int c, int s, size_t size, size_t maxRead = 0) {
  const size_t count = std::max<size_t>(kBytesPerSize / size, 4);
  auto src = prefaulted(size);
  auto dst = prefaulted(size);
  std::thread rx([&] {
    for (size_t i = 0; i < count; ++i) {
      recvAll(s, dst.data(), size, maxRead);
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
  // Raw TCP read the way the uv transport reads (64 KiB per recv): faster
  // on loopback than one recv per message, and the baseline uv's
  // throughput is held to.
  for (size_t size : kSizes) {
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add({"tcp_64KiB_reads_throughput_" + n,
                socketThroughput(c, s, size, 64 << 10), "GB/s",
                "tcp_throughput_" + n});
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

// One-thread memcpy of n bytes from a to b, repeatedly; GB/s.
double memcpyRate(uint8_t* a, uint8_t* b, size_t n) {
  const int reps = 32;
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) {
    std::memcpy(b, a, n);
    a[i] = b[n - 1 - i];  // keep the copies observable
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return reps * n / secs / 1e9;
}

// process_vm_readv of n bytes of this process from a to b, split into
// `threads` page-aligned pieces copied at once, as the cma channel does;
// repeatedly; GB/s. The kernel's own rate with no pipe around it.
//
// The first read of pages is far slower than later ones on the 2-core VM
// (0.7 against 5-9 GB/s on one thread, for source and destination pages
// alike, though user code had written them all): `firstRead` gets the rate
// of the first rep, which runs on pages no process_vm_readv has touched
// yet, and the timed reps follow it.
double readvRate(uint8_t* a, uint8_t* b, size_t n, size_t threads,
                 double* firstRead) {
  const int reps = 8;
  const size_t step = (n / threads + 4095) / 4096 * 4096;
  std::atomic<int> failedErrno{0};  // errno is per thread: the copier's
  auto t0 = Clock::now();
  for (int i = -1; i < reps; ++i) {
    if (i == 0) {
      *firstRead =
          n / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
      t0 = Clock::now();
    }
    std::vector<std::thread> copiers;
    for (size_t off = 0; off < n; off += step) {
      copiers.emplace_back([&, off] {
        const size_t len = std::min(step, n - off);
        iovec local{b + off, len};
        iovec remote{a + off, len};
        const ssize_t got =
            process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
        if (got != static_cast<ssize_t>(len)) {
          failedErrno = got < 0 ? errno : EFAULT;  // EFAULT: a short read
        }
      });
    }
    for (auto& t : copiers) {
      t.join();
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (const int err = failedErrno.load(); err != 0) {
    throw std::runtime_error(std::string("process_vm_readv: ") +
                             std::strerror(err));
  }
  return reps * n / secs / 1e9;
}

// The same on huge pages is the baseline of the *_hugepages rows: it shows
// what the page size does to a plain copy (little) next to what it does to
// process_vm_readv (a lot).
void memcpyBaseline() {
  const size_t n = 64 * kMiB;
  auto a = prefaulted(n);
  auto b = prefaulted(n);
  report.add({"memcpy_64MiB", memcpyRate(a.data(), b.data(), n), "GB/s", ""});
  auto ha = runBuffer(n, Pages::kHuge, "memcpy_64MiB_hugepages");
  auto hb = runBuffer(n, Pages::kHuge, "memcpy_64MiB_hugepages");
  report.add({"memcpy_64MiB_hugepages", memcpyRate(ha.data(), hb.data(), n),
              "GB/s", ""});
  // What the kernel's cross-memory copy reaches from and to 4 KiB pages on
  // two threads (cma::Options::copyThreads), with no pipe: the ceiling of
  // cma_throughput_64MiB, which is also quoted against it.
  try {
    double first = 0;
    const double steady = readvRate(a.data(), b.data(), n, 2, &first);
    report.add({"process_vm_readv_64MiB_2threads_first_read", first, "GB/s",
                "memcpy_64MiB"});
    report.add(
        {"process_vm_readv_64MiB_2threads", steady, "GB/s", "memcpy_64MiB"});
  } catch (const std::exception& e) {
    note(std::string("process_vm_readv_64MiB_2threads skipped: ") + e.what());
  }
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
  PingClock clock;
  Promise<void> done;
  std::function<void()> ping = [&] {
    clock.start();
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
        if (clock.finish()) {
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
  return std::move(clock.times());
}

// One-way throughput; `asTensor` sends the bytes as one CPU tensor (which a
// cma pipe moves out of band) instead of a payload; `pages` picks the pages
// of the source and destination; `sources` distinct source buffers are
// used in turn: with as many as there are messages, every message is sent
// from memory no earlier message used (the "first read" rows: a fresh
// tensor per step).
double pipeThroughput(PipeBench& b, size_t size, bool asTensor = false,
                      size_t total = kBytesPerSize, Pages pages = Pages::kSmall,
                      size_t sources = 1) {
  const size_t count = std::max<size_t>(total / size, 4);
  std::vector<bench::Buffer> srcs;
  for (size_t i = 0; i < sources; ++i) {
    srcs.push_back(runBuffer(size, pages, "pipeThroughput"));
  }
  auto dst = runBuffer(size, pages, "pipeThroughput");
  return bench::oneWayThroughput(
      b.s, dst.data(), size, count, asTensor, [&](size_t i) {
        Message m;
        uint8_t* src = srcs[i % sources].data();
        if (asTensor) {
          m.tensors.push_back({src, size, Device{}});
        } else {
          m.payloads.push_back({src, size});
        }
        b.c->write(std::move(m), [](const Error&) {});
      });
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
                "tcp_64KiB_reads_throughput_" + n});
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
  if (const double cma64 = report.valueOf("cma_throughput_64MiB"); cma64 > 0) {
    report.add({"cma_throughput_64MiB_vs_readv", cma64, "GB/s",
                "process_vm_readv_64MiB_2threads"});
  }
  // The same 64 MiB tensor through the shm ring instead (two copies, one
  // per loop thread): what cma is up against at the top size.
  report.add({"shm_basic_tensor_64MiB",
              pipeThroughput(basicPipe, 64 * kMiB, true), "GB/s",
              "cma_throughput_64MiB"});
  // Both again with every message from a buffer no earlier message was sent
  // from (written by user code, never read by the kernel): a fresh tensor
  // per step, as a trainer sends.
  constexpr size_t kFresh = 6;
  report.add({"cma_throughput_64MiB_first_read",
              pipeThroughput(cmaPipe, 64 * kMiB, true, kFresh * 64 * kMiB,
                             Pages::kSmall, kFresh),
              "GB/s", "memcpy_64MiB"});
  report.add({"shm_basic_tensor_64MiB_first_read",
              pipeThroughput(basicPipe, 64 * kMiB, true, kFresh * 64 * kMiB,
                             Pages::kSmall, kFresh),
              "GB/s", "cma_throughput_64MiB_first_read"});
  for (size_t size : kSizes) {
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add(
        {"cma_throughput_" + n + "_hugepages",
         pipeThroughput(cmaPipe, size, true, kBytesPerSize, Pages::kHuge),
         "GB/s", "memcpy_64MiB_hugepages"});
  }
}

#ifdef TRELLIS_BENCH_TENSORPIPE
// ---- TensorPipe, measured the way our pipes are --------------------------

Error tpError(const tensorpipe::Error& e) {
  return Error::connection(e.what());
}

// PipeBench for TensorPipe: two contexts in this process, each with one
// transport and one channel, and a pipe between them. Throws when either is
// not viable here or the pipe cannot carry a first message, so that the
// caller can skip its rows with a note instead of hanging or aborting.
struct TpPipeBench {
  std::shared_ptr<tensorpipe::Context> server =
      std::make_shared<tensorpipe::Context>();
  std::shared_ptr<tensorpipe::Context> client =
      std::make_shared<tensorpipe::Context>();
  std::shared_ptr<tensorpipe::Listener> listener;
  std::shared_ptr<tensorpipe::Pipe> c;
  std::shared_ptr<tensorpipe::Pipe> s;

  TpPipeBench(const std::string& transport, const std::string& channel,
              const std::string& address) {
    for (auto& ctx : {server, client}) {
      std::shared_ptr<tensorpipe::transport::Context> t =
          transport == "shm" ? tensorpipe::transport::shm::create()
                             : tensorpipe::transport::uv::create();
      std::shared_ptr<tensorpipe::channel::Context> ch =
          channel == "cma" ? tensorpipe::channel::cma::create()
                           : tensorpipe::channel::basic::create();
      // Registering a context that is not viable is silently ignored, and
      // the pipe would then fail (or fall back) only on the first message.
      if (!t->isViable()) {
        throw std::runtime_error("TensorPipe transport " + transport +
                                 " is not viable here");
      }
      if (!ch->isViable()) {
        throw std::runtime_error("TensorPipe channel " + channel +
                                 " is not viable here");
      }
      ctx->registerTransport(0, transport, t);
      ctx->registerChannel(0, channel, ch);
    }
    listener = server->listen({address});
    Promise<std::shared_ptr<tensorpipe::Pipe>> accepted;
    listener->accept([accepted](const tensorpipe::Error& e,
                                std::shared_ptr<tensorpipe::Pipe> p) mutable {
      e ? accepted.setError(tpError(e)) : accepted.setValue(p);
    });
    c = client->connect(listener->url(transport));
    s = accepted.getFuture().wait(std::chrono::seconds(30));
    probe(channel == "cma");
  }

  ~TpPipeBench() {
    c->close();
    s->close();
    client->close();
    server->close();
    client->join();
    server->join();
  }

  // One 8-byte message of the kind the rows send. Its callbacks hold only
  // shared state, so a failure here leaves nothing dangling behind the
  // exception.
  void probe(bool asTensor) {
    auto bytes = std::make_shared<std::array<uint8_t, 16>>();
    Promise<void> got;
    tensorpipe::Message m;
    if (asTensor) {
      tensorpipe::Message::Tensor t;
      t.buffer = tensorpipe::CpuBuffer{bytes->data()};
      t.length = 8;
      m.tensors.push_back(std::move(t));
    } else {
      m.payloads.push_back({bytes->data(), 8, {}});
    }
    c->write(std::move(m), [bytes](const tensorpipe::Error&) {});
    s->readDescriptor(
        [got, bytes, asTensor, pipe = std::weak_ptr<tensorpipe::Pipe>(s)](
            const tensorpipe::Error& e, tensorpipe::Descriptor) mutable {
          auto reader = pipe.lock();
          if (e || !reader) {
            got.setError(e ? tpError(e) : Error::connection("pipe gone"));
            return;
          }
          tensorpipe::Allocation a;
          if (asTensor) {
            a.tensors.push_back({tensorpipe::CpuBuffer{bytes->data() + 8}});
          } else {
            a.payloads.push_back({bytes->data() + 8});
          }
          reader->read(std::move(a),
                       [got, bytes](const tensorpipe::Error& e) mutable {
                         e ? got.setError(tpError(e)) : got.setValue();
                       });
        });
    got.getFuture().wait(std::chrono::seconds(30));
  }
};

// A name of our own in the abstract socket namespace, for the shm listener.
std::string tpShmAddress(const std::string& tag) {
  return "shm://trellis-bench-" + std::to_string(::getpid()) + "-" + tag;
}

// Ping-pong from callbacks on TensorPipe's loop, as pipePingPong does ours.
std::vector<double> tpPingPong(TpPipeBench& b) {
  uint8_t serverBuf[8];
  uint8_t clientBuf[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t clientIn[8];
  Promise<void> served;
  std::function<void()> serve = [&] {
    b.s->readDescriptor(
        [&](const tensorpipe::Error& e, tensorpipe::Descriptor d) {
          if (e) {
            Promise<void>(served).setError(tpError(e));
            return;
          }
          const bool stop = d.metadata == "stop";
          tensorpipe::Allocation a;
          a.payloads.push_back({serverBuf});
          b.s->read(a, [&, stop](const tensorpipe::Error& e) {
            if (e || stop) {
              e ? Promise<void>(served).setError(tpError(e))
                : Promise<void>(served).setValue();
              return;
            }
            tensorpipe::Message m;
            m.payloads.push_back({serverBuf, 8});
            b.s->write(std::move(m), [](const tensorpipe::Error&) {});
            serve();
          });
        });
  };
  serve();
  PingClock clock;
  Promise<void> done;
  std::function<void()> ping = [&] {
    clock.start();
    tensorpipe::Message m;
    m.payloads.push_back({clientBuf, 8});
    b.c->write(std::move(m), [](const tensorpipe::Error&) {});
    b.c->readDescriptor(
        [&](const tensorpipe::Error& e, tensorpipe::Descriptor) {
          if (e) {
            Promise<void>(done).setError(tpError(e));
            return;
          }
          tensorpipe::Allocation a;
          a.payloads.push_back({clientIn});
          b.c->read(a, [&](const tensorpipe::Error& e) {
            if (e) {
              Promise<void>(done).setError(tpError(e));
              return;
            }
            if (clock.finish()) {
              Promise<void>(done).setValue();
            } else {
              ping();
            }
          });
        });
  };
  ping();
  done.getFuture().wait(std::chrono::seconds(120));
  tensorpipe::Message stop;
  stop.metadata = "stop";
  stop.payloads.push_back({clientBuf, 8});
  b.c->write(std::move(stop), [](const tensorpipe::Error&) {});
  served.getFuture().wait(std::chrono::seconds(30));
  return std::move(clock.times());
}

// One-way throughput into a reused buffer, as pipeThroughput measures ours;
// `asTensor` sends one CPU tensor (moved by the channel) instead of a
// payload (moved by the transport).
double tpThroughput(TpPipeBench& b, size_t size, bool asTensor = false,
                    size_t total = kBytesPerSize, Pages pages = Pages::kSmall) {
  const size_t count = std::max<size_t>(total / size, 4);
  auto src = runBuffer(size, pages, "tpThroughput");
  auto dst = runBuffer(size, pages, "tpThroughput");
  Promise<void> all;
  size_t received = 0;
  std::function<void()> readNext = [&] {
    b.s->readDescriptor(
        [&](const tensorpipe::Error& e, tensorpipe::Descriptor) {
          if (e) {
            Promise<void>(all).setError(tpError(e));
            return;
          }
          tensorpipe::Allocation a;
          if (asTensor) {
            a.tensors.push_back({tensorpipe::CpuBuffer{dst.data()}});
          } else {
            a.payloads.push_back({dst.data()});
          }
          b.s->read(std::move(a), [&](const tensorpipe::Error& e) {
            if (e) {
              Promise<void>(all).setError(tpError(e));
            } else if (++received == count) {
              Promise<void>(all).setValue();
            } else {
              readNext();
            }
          });
        });
  };
  readNext();
  const auto t0 = Clock::now();
  for (size_t k = 0; k < count; ++k) {
    tensorpipe::Message m;
    if (asTensor) {
      tensorpipe::Message::Tensor t;
      t.buffer = tensorpipe::CpuBuffer{src.data()};
      t.length = size;
      m.tensors.push_back(std::move(t));
    } else {
      m.payloads.push_back({src.data(), size});
    }
    b.c->write(std::move(m), [](const tensorpipe::Error&) {});
  }
  all.getFuture().wait(std::chrono::seconds(120));
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(count * size) / secs / 1e9;
}

// TensorPipe's uv transport + basic channel.
void tensorpipeUv() {
  TpPipeBench b("uv", "basic", "uv://127.0.0.1:0");
  auto us = tpPingPong(b);
  addLatency("tensorpipe_uv", us, "tcp");
  for (size_t size : kSizes) {
    const std::string n = std::to_string(size / kMiB) + "MiB";
    report.add({"tensorpipe_uv_throughput_" + n, tpThroughput(b, size), "GB/s",
                "tcp_64KiB_reads_throughput_" + n});
  }
}

// TensorPipe's shm transport + basic channel, next to our shm_* rows.
void tensorpipeShm() {
  try {
    TpPipeBench b("shm", "basic", tpShmAddress("shm"));
    auto us = tpPingPong(b);
    addLatency("tensorpipe_shm", us, "tcp");
    for (size_t size : kSizes) {
      const std::string n = std::to_string(size / kMiB) + "MiB";
      report.add({"tensorpipe_shm_throughput_" + n, tpThroughput(b, size),
                  "GB/s", "tcp_throughput_" + n});
    }
  } catch (const std::exception& e) {
    note(std::string("tensorpipe_shm_* skipped: ") + e.what());
  }
}

// TensorPipe's cma channel over its shm transport, one CPU tensor per
// message, next to our cma_throughput_* rows (same sizes and baselines).
// Both contexts are in this process, as for ours: cma reads its own pid.
void tensorpipeCma() {
  try {
    TpPipeBench b("shm", "cma", tpShmAddress("cma"));
    for (size_t size : kSizes) {
      const std::string n = std::to_string(size / kMiB) + "MiB";
      report.add({"tensorpipe_cma_throughput_" + n, tpThroughput(b, size, true),
                  "GB/s", "memcpy_64MiB"});
    }
    report.add({"tensorpipe_cma_throughput_64MiB_hugepages",
                tpThroughput(b, 64 * kMiB, true, kBytesPerSize, Pages::kHuge),
                "GB/s", "memcpy_64MiB_hugepages"});
  } catch (const std::exception& e) {
    note(std::string("tensorpipe_cma_* skipped: ") + e.what());
  }
}
#endif

// ---- payloads and the same-host channel, measured in turns ---------------

// The median of one row's rounds.
double median(const std::vector<double>& v) {
  return bench::percentile(v, 0.5);
}

// Rounds of the two sections below. Each round measures every row once, one
// after the other, so that the load of this shared machine falls on all of
// them alike; each row reports the median of its rounds.
constexpr int kRounds = 3;

// Payloads (Message::payloads, moved by the transport: what RPC requests
// and replies carry) over shm: ours with default options (`shm_payload_*`)
// and with spinning off (`shm_nospin_payload_*`, every wait an eventfd
// wake-up), against TensorPipe's shm + basic (`tensorpipe_shm_payload_*`)
// in the same rounds. The `shm_throughput_*` rows measure the same path
// once each; `shm_basic_tensor_*` is the tensor path through the ring.
void payloads() {
  constexpr size_t kBytes = size_t{1} << 30;
  PipeBench ours("shm://");
  PipeBench nospin("shm://", [](Context& c) {
    shm::Options o;
    o.spin = std::chrono::microseconds(0);
    c.registerTransport(200, shm::create(o));
  });
#ifdef TRELLIS_BENCH_TENSORPIPE
  bool tpViable = true;
  int tpPipes = 0;
#endif
  for (size_t size : {kMiB, 64 * kMiB}) {
    std::vector<double> o;
    std::vector<double> n;
    std::vector<double> t;
    for (int r = 0; r < kRounds; ++r) {
      o.push_back(pipeThroughput(ours, size, false, kBytes));
      n.push_back(pipeThroughput(nospin, size, false, kBytes));
#ifdef TRELLIS_BENCH_TENSORPIPE
      // TensorPipe's shm loop polls for as long as its context lives, so a
      // context kept across the rounds would take a core from ours: each
      // measurement gets its own, gone before the next row runs.
      try {
        if (tpViable) {
          TpPipeBench tp("shm", "basic",
                         tpShmAddress("payload" + std::to_string(tpPipes++)));
          t.push_back(tpThroughput(tp, size, false, kBytes));
        }
      } catch (const std::exception& e) {
        tpViable = false;
        note(std::string("tensorpipe_shm_payload_* skipped: ") + e.what());
      }
#endif
    }
    const std::string mib = std::to_string(size / kMiB) + "MiB";
    const std::string tpRow = "tensorpipe_shm_payload_" + mib;
    report.add({"shm_payload_" + mib, median(o), "GB/s", tpRow});
    report.add({"shm_nospin_payload_" + mib, median(n), "GB/s", tpRow});
    if (!t.empty()) {
      report.add({tpRow, median(t), "GB/s", ""});
    }
  }
}

// One-way throughput of one CPU tensor per message, as pipeThroughput,
// but with `freshDst` each message lands in memory mapped for it in the
// reader's readDescriptor callback and unmapped after its read: a tensor
// allocated per step (libtorch maps large allocations anew), whose pages
// fault as the copy first writes them.
double tensorThroughput(PipeBench& b, size_t size, size_t total,
                        bool freshDst) {
  const size_t count = std::max<size_t>(total / size, 4);
  auto src = runBuffer(size, Pages::kSmall, "tensorThroughput");
  std::optional<bench::Buffer> dst;
  if (!freshDst) {
    dst.emplace(runBuffer(size, Pages::kSmall, "tensorThroughput"));
  }
  auto take = [&]() -> uint8_t* {
    if (!freshDst) {
      return dst->data();
    }
    void* fresh = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) {
      std::fprintf(stderr, "transport_bench: mmap of %zu bytes: %s\n", size,
                   std::strerror(errno));
      std::exit(1);
    }
    return static_cast<uint8_t*>(fresh);
  };
  auto give = [&](uint8_t* p) {
    if (freshDst) {
      ::munmap(p, size);
    }
  };
  return bench::oneWayThroughput(
      b.s, size, count, /*asTensor=*/true,
      [&](size_t) {
        Message m;
        m.tensors.push_back({src.data(), size, Device{}});
        b.c->write(std::move(m), [](const Error&) {});
      },
      take, give);
}

// Which channel should carry a CPU tensor between two processes of one
// host: cma (`channel_cma_*`: process_vm_readv straight into the reader's
// buffer, one copy) against the shm ring (`channel_ring_*`: channel basic,
// the tensor inline, two copies on the two loop threads), 64 KiB to
// 64 MiB, into a reused destination and into a fresh one per message
// (`*_fresh_dst`). Ratio = cma / ring. docs/transport.md ("cma or the
// ring?") holds the table and the default threshold taken from it.
void channels() {
  PipeBench cmaPipe("shm://", [](Context& c) {
    cma::Options o;
    o.thresholdBytes = 0;
    c.registerChannel(150, cma::create(o));
  });
  PipeBench ringPipe("shm://", [](Context& c) {
    c.registerChannel(150, basic::create());
    cma::Options o;
    o.thresholdBytes = ~size_t{0};
    c.registerChannel(100, cma::create(o));
  });
  const std::vector<size_t> sizes = {size_t{64} << 10, size_t{256} << 10,
                                     size_t{1} << 20,  size_t{4} << 20,
                                     size_t{16} << 20, size_t{64} << 20};
  for (size_t size : sizes) {
    const std::string n = size >= kMiB ? std::to_string(size / kMiB) + "MiB"
                                       : std::to_string(size >> 10) + "KiB";
    for (bool fresh : {false, true}) {
      const size_t total =
          std::max(fresh ? size_t{128} << 20 : size_t{256} << 20, 4 * size);
      std::vector<double> ring;
      std::vector<double> cma;
      for (int r = 0; r < kRounds; ++r) {
        ring.push_back(tensorThroughput(ringPipe, size, total, fresh));
        cma.push_back(tensorThroughput(cmaPipe, size, total, fresh));
      }
      const std::string suffix = n + (fresh ? "_fresh_dst" : "");
      report.add({"channel_ring_" + suffix, median(ring), "GB/s", ""});
      report.add({"channel_cma_" + suffix, median(cma), "GB/s",
                  "channel_ring_" + suffix});
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::pair<const char*, void (*)()> sections[] = {
      {"uv", trellisUv},
      {"shm", trellisShm},
      {"cma", trellisCma},
#ifdef TRELLIS_BENCH_TENSORPIPE
      {"tensorpipe_uv", tensorpipeUv},
      {"tensorpipe_shm", tensorpipeShm},
      {"tensorpipe_cma", tensorpipeCma},
#endif
      {"payload", payloads},
      {"channels", channels},
  };
  bool json = false;
  // --only uv,shm,...: the sections to run after the baselines (for
  // profiling one of them); all by default.
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = "," + std::string(argv[++i]) + ",";
    } else {
      std::string names;
      for (const auto& [name, run] : sections) {
        names = names + " " + name;
      }
      std::fprintf(stderr,
                   "usage: %s [--json] [--only SECTION,...]\nsections:%s\n",
                   argv[0], names.c_str());
      return 2;
    }
  }
  rawBaselines();
  memcpyBaseline();
  for (const auto& [name, run] : sections) {
    if (only.empty() ||
        only.find("," + std::string(name) + ",") != std::string::npos) {
      run();
    }
  }
  report.print(json);
  return 0;
}
