// RPC benchmark: round trips, calls in flight, tensor echo and remote() +
// toHere() between two processes, next to baselines measured in the same
// run: the transport's own ping-pong and echo (same transport, Context and
// Pipe used directly), raw TCP and a gRPC unary echo. `--json` prints one
// JSON object per line (DESIGN.md, "Benchmarks").
//
// The program re-executes itself as the callee (`--role callee`, so no
// thread state is inherited); both rendezvous through a TCPStore the caller
// serves. Phases run in a fixed order on both sides: transport over
// uv, transport upgraded to shm, RPC over uv, RPC upgraded to shm, gRPC.
//
// "Echo throughput" is bytes echoed per second: size / round trip.
//
// Every timed figure, the baselines' included, is the best of kBlocks
// blocks of its calls (bestBlock): on the 2-core VM the same figure moves
// 2-4x between blocks a second apart, so one block's median compares the
// machine's moods more than the two stacks. remote + toHere, whose target
// is a ratio to the no-op, alternates blocks of each instead (rpcCaller).
// `--pin` runs each process on half of the CPUs (pinTo, below), which takes
// the VM's scheduling state out of the figures.

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sched.h>
#include <semaphore>
#include <string>
#include <string_view>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "bench_util.h"
#include "pipe_bench_util.h"
#include "rpc_bench_echo.grpc.pb.h"
#include <trellis/core/future.h>
#include <trellis/core/text.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/transport/context.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

extern char** environ;

using namespace std::chrono_literals;
using namespace trellis;
using Clock = std::chrono::steady_clock;
namespace rpc = trellis::rpc;
namespace tp = trellis::transport;

// ---- functions the caller runs on the callee --------------------------------

void noop() {}
// The same, registered with TRELLIS_REMOTE_INLINE: run on the callee's
// transport loop instead of its worker pool.
void noopInline() {}
at::Tensor echoInline(const at::Tensor& t) { return t; }
at::Tensor addTensors(const at::Tensor& a, const at::Tensor& b) {
  return a.add(b);
}
at::Tensor echoTensor(const at::Tensor& t) { return t; }
int64_t answer() { return 42; }
// remote() + toHere() of a value that does not ride on remote()'s reply
// (a number does: docs/rref.md), so toHere() fetches it.
at::Tensor oneTensor() { return at::ones({1}); }
int64_t sleepMs(int64_t ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

TRELLIS_REMOTE_FUNCTION(noop);
TRELLIS_REMOTE_FUNCTION(addTensors);
TRELLIS_REMOTE_FUNCTION(echoTensor);
TRELLIS_REMOTE_FUNCTION(answer);
TRELLIS_REMOTE_FUNCTION(oneTensor);
TRELLIS_REMOTE_FUNCTION(sleepMs);
TRELLIS_REMOTE_FUNCTION(noopInline);
TRELLIS_REMOTE_INLINE(noopInline);
TRELLIS_REMOTE_FUNCTION(echoInline);
TRELLIS_REMOTE_INLINE(echoInline);

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
const std::vector<size_t> kEchoSizes = {kKiB, 64 * kKiB, kMiB, 16 * kMiB,
                                        64 * kMiB};
constexpr int kInFlight = 64;
constexpr auto kWait = std::chrono::seconds(120);

struct Flags {
  bool json = false;
  int iters = 3000;               // round trips per latency metric
  size_t echoBytes = 128 * kMiB;  // bytes echoed per size (at least 3 calls)
  bool callee = false;
  uint16_t storePort = 0;
  bool pin = false;       // --pin: one half of the CPUs for each process
  std::vector<int> cpus;  // the callee's half (the caller passes --cpus)
};
Flags flags;

bench::Report report("rpc");

struct Phase {
  std::string tag;                      // "uv" or "shm"
  std::vector<std::string> transports;  // empty: all (same-host upgrade)
};
const std::vector<Phase> kPhases = {{"uv", {"uv"}}, {"shm", {}}};

std::string sizeName(size_t n) {
  return n >= kMiB ? std::to_string(n / kMiB) + "MiB"
                   : std::to_string(n / kKiB) + "KiB";
}

int echoReps(size_t size) {
  return static_cast<int>(
      std::clamp<size_t>(flags.echoBytes / size, 3, size_t(flags.iters)));
}

constexpr int kBlocks = 3;
enum class Best { kMedian, kMean };

// Runs `block(n)` kBlocks times, n = reps / kBlocks (one block of all reps
// when that leaves fewer than 10 each), and returns the samples (µs) of the
// block with the lowest median or mean, whichever the figure reports.
std::vector<double> bestBlock(
    int reps, Best by, const std::function<std::vector<double>(int)>& block) {
  const int blocks = reps / kBlocks >= 10 ? kBlocks : 1;
  std::vector<double> best;
  double bestScore = 0;
  for (int b = 0; b < blocks; ++b) {
    auto us = block(reps / blocks);
    const double score =
        by == Best::kMedian ? bench::percentile(us, 0.5) : bench::mean(us);
    if (best.empty() || score < bestScore) {
      best = std::move(us);
      bestScore = score;
    }
  }
  return best;
}

// Bytes per second (GB/s) of echoes of `size` bytes taking `us` each.
double echoRate(size_t size, const std::vector<double>& us) {
  return static_cast<double>(size) / bench::mean(us) / 1e3;
}

// Diagnostics go to stderr, so that stdout stays one JSON object per line.
using bench::note;
using bench::prefaulted;

// A receive buffer on the pages the RPC agent's receive pool uses: huge
// pages from 2 MiB up (rpc/agent.cc), 4 KiB below. The transport echo reads
// into these, so that it and the RPC echo move the same kind of memory (the
// page size sets the speed of cma's process_vm_readv; docs/benchmarks.md).
bench::Buffer receiveBuffer(size_t n) {
  return bench::Buffer(n, n >= bench::kHugePage);
}

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

void addLatency(const std::string& metric, const std::vector<double>& us,
                const std::string& baseline) {
  report.add(metric + "_median", bench::percentile(us, 0.5), "us",
             baseline.empty() ? "" : baseline + "_median");
  report.add(metric + "_p99", bench::percentile(us, 0.99), "us",
             baseline.empty() ? "" : baseline + "_p99");
}

// Context switches of this whole process so far (voluntary + involuntary):
// each one is a thread that slept and had to be woken, which costs about
// 20 µs here (DESIGN.md), so switches per call explain round trips.
double contextSwitches() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_nvcsw + u.ru_nivcsw);
}

std::shared_ptr<store::Store> connectStore(const std::string& prefix) {
  store::TCPStoreOptions o;
  o.port = flags.storePort;
  o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kWait);
  auto s = std::make_shared<store::TCPStore>(o);
  if (prefix.empty()) {
    return s;
  }
  return std::make_shared<store::PrefixStore>(prefix, s);
}

// ---- raw TCP (threads of this process; bench_util.h) ------------------------

void tcpBaseline() {
  auto [c, s] = bench::loopbackTcpPair();
  const int warmup = flags.iters / 10;
  std::thread echo([s = s, n = warmup + flags.iters] {
    uint8_t b[8];
    for (int i = 0; i < n; ++i) {
      bench::recvAll(s, b, 8);
      bench::sendAll(s, b, 8);
    }
  });
  std::vector<double> us;
  uint8_t b[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (int i = 0; i < warmup + flags.iters; ++i) {
    const auto t0 = Clock::now();
    bench::sendAll(c, b, 8);
    bench::recvAll(c, b, 8);
    if (i >= warmup) {
      us.push_back(micros(Clock::now() - t0));
    }
  }
  echo.join();
  ::close(c);
  ::close(s);
  addLatency("tcp_rtt_8B", us, "");
}

// What a receive into a fresh buffer costs: at::empty + first touch of
// 64 MiB (the page faults), against copying into memory already mapped.
void memoryBaselines() {
  constexpr size_t n = 64 * kMiB;
  const int reps = 4;
  auto src = prefaulted(n);
  auto dst = prefaulted(n);
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) {
    std::memcpy(dst.data(), src.data(), n);
    src[i] = dst[n - 1 - i];
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  report.add("memcpy_64MiB", reps * n / secs / 1e9, "GB/s");
  t0 = Clock::now();
  for (int i = 0; i < reps; ++i) {
    at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
    std::memcpy(t.data_ptr(), src.data(), n);
  }
  secs = std::chrono::duration<double>(Clock::now() - t0).count();
  report.add("fresh_alloc_copy_64MiB", reps * n / secs / 1e9, "GB/s",
             "memcpy_64MiB");
}

// ---- transport echo (Context and Pipe directly) -----------------------------

std::shared_ptr<tp::Context> makeContext(const Phase& p, const char* name) {
  tp::ContextOptions o;
  o.name = name;
  o.tokenFromEnvironment = false;
  o.transports = p.transports;
  return tp::Context::create(o);
}

// One thread of its own, woken through a condition variable for each task:
// the least a hand-off to another thread costs (no pool, no policy).
class HandoffThread {
 public:
  HandoffThread() : thread_([this] { serve(); }) {}
  HandoffThread(const HandoffThread&) = delete;
  HandoffThread& operator=(const HandoffThread&) = delete;
  ~HandoffThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) {
        return;
      }
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// Writes `m` the way the RPC layer sends (rpc/connections.cc): straight
// into the connection from this thread where the transport can, else
// through the loop.
void sendLikeRpc(tp::Pipe& pipe, tp::Message m) {
  if (!pipe.tryWriteNow(m)) {
    pipe.write(std::move(m), [](const Error&) {});
  }
}

// Callee: echoes every message back with the same shape, reading into
// buffers it keeps (as a tuned server would), until a "stop" descriptor.
// A message whose descriptor is "handoff" is answered from a thread of
// its own (HandoffThread), as an RPC function that runs on a worker pool
// is.
class EchoServer {
 public:
  explicit EchoServer(std::shared_ptr<tp::Pipe> pipe)
      : pipe_(std::move(pipe)) {}

  Future<void> run() {
    next();
    return done_.getFuture();
  }

 private:
  void next() {
    pipe_->readDescriptor([this](const Error& e, tp::Descriptor d) {
      if (!e.ok()) {
        done_.setError(e);
        return;
      }
      onDescriptor(std::move(d));
    });
  }

  void onDescriptor(tp::Descriptor d) {
    const bool stop = d.descriptor == "stop";
    const bool handoff = d.descriptor == "handoff";
    payloads_.resize(std::max(payloads_.size(), d.payloadLengths.size()));
    tensors_.resize(std::max(tensors_.size(), d.tensors.size()));
    tp::Allocation a;
    auto reply = std::make_shared<tp::Message>();
    reply->descriptor = d.descriptor;
    for (size_t i = 0; i < d.payloadLengths.size(); ++i) {
      auto& buf = payloads_[i];
      if (buf.size() < d.payloadLengths[i]) {
        buf = prefaulted(d.payloadLengths[i]);
      }
      a.payloads.push_back({buf.data(), d.payloadLengths[i]});
      reply->payloads.push_back({buf.data(), d.payloadLengths[i]});
    }
    for (size_t i = 0; i < d.tensors.size(); ++i) {
      auto& buf = tensors_[i];
      if (buf == nullptr || buf->size() < d.tensors[i].length) {
        buf =
            std::make_unique<bench::Buffer>(receiveBuffer(d.tensors[i].length));
      }
      a.tensors.push_back({buf->data(), d.tensors[i].length});
      reply->tensors.push_back({buf->data(), d.tensors[i].length, {}});
    }
    // The caller sends its next message only after this echo arrived, so
    // the buffers are free again by the next read.
    pipe_->read(std::move(a), [this, stop, handoff, reply](const Error& e) {
      if (!e.ok() || stop) {
        e.ok() ? done_.setValue() : done_.setError(e);
        return;
      }
      if (handoff) {
        worker_.post([this, reply] { sendLikeRpc(*pipe_, std::move(*reply)); });
      } else {
        pipe_->write(std::move(*reply), [](const Error&) {});
      }
      next();
    });
  }

  std::shared_ptr<tp::Pipe> pipe_;
  std::vector<std::vector<uint8_t>> payloads_;
  std::vector<std::unique_ptr<bench::Buffer>> tensors_;
  Promise<void> done_;
  HandoffThread worker_;  // joined first, before the buffers it reads go
};

void transportCallee(const Phase& p, store::Store& st) {
  auto ctx = makeContext(p, "bench-callee");
  auto listener = ctx->listen({"uv://127.0.0.1:0"});
  st.set("transport/addr", listener->address("uv"));
  auto pipe = bench::acceptOne(
      *listener, std::chrono::duration_cast<std::chrono::milliseconds>(kWait));
  EchoServer server(pipe);
  server.run().wait(std::chrono::seconds(600));
  pipe->close();
  ctx->close();
  ctx->join();
}

// The echoes' message, and the allocation their reply is read into: `size`
// bytes at `data` as one tensor, or as one payload.
tp::Message echoMessage(uint8_t* data, size_t size, bool tensor) {
  tp::Message m;
  if (tensor) {
    m.tensors.push_back({data, size, {}});
  } else {
    m.payloads.push_back({data, size});
  }
  return m;
}

tp::Allocation echoAllocation(uint8_t* data, size_t size, bool tensor) {
  tp::Allocation a;
  (tensor ? a.tensors : a.payloads).push_back({data, size});
  return a;
}

// Caller: `reps` sequential echoes of one message (a payload or a tensor
// of `size` bytes), driven from callbacks on the loop thread as an RPC
// layer would be; returns each round trip in µs. The source is on 4 KiB
// pages, like a tensor from libtorch's allocator; the destination on the
// pages the RPC agent would receive into.
std::vector<double> transportEcho(tp::Pipe& pipe, size_t size, bool tensor,
                                  int reps) {
  auto src = prefaulted(size);
  auto dst = receiveBuffer(size);
  std::vector<double> us;
  us.reserve(reps);
  Promise<void> done;
  int i = 0;
  Clock::time_point t0;
  std::function<void()> ping = [&] {
    t0 = Clock::now();
    pipe.write(echoMessage(src.data(), size, tensor), [](const Error&) {});
    pipe.readDescriptor([&](const Error& e, tp::Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      pipe.read(echoAllocation(dst.data(), size, tensor), [&](const Error& e) {
        if (!e.ok()) {
          Promise<void>(done).setError(e);
          return;
        }
        us.push_back(micros(Clock::now() - t0));
        if (++i == reps) {
          Promise<void>(done).setValue();
        } else {
          ping();
        }
      });
    });
  };
  ping();
  done.getFuture().wait(std::chrono::seconds(600));
  return us;
}

// The same echo moved the way an RPC whose function runs on a worker pool
// moves it: this thread writes the request (sendLikeRpc) and sleeps until
// the loop has read the reply and woken it; the callee answers from a
// thread of its own (EchoServer, "handoff"). Two thread wake-ups per round
// trip, and no RPC code: the machine's floor under a pool-run rpcSync().
std::vector<double> handoffEcho(tp::Pipe& pipe, size_t size, bool tensor,
                                int reps) {
  auto src = prefaulted(size);
  auto dst = receiveBuffer(size);
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;  // guarded by mu
  Error error;      // guarded by mu
  auto signal = [&](const Error& e) {
    std::lock_guard<std::mutex> lock(mu);
    ++arrived;
    if (!e.ok() && error.ok()) {
      error = e;
    }
    cv.notify_one();
  };
  // Armed on the loop for the next reply as soon as one is read, as the
  // RPC layer keeps a read armed: no loop hand-off to wait for a reply.
  int armed = 0;  // loop thread only, after the first arm()
  std::function<void()> arm = [&] {
    ++armed;
    pipe.readDescriptor([&](const Error& e, tp::Descriptor) {
      if (!e.ok()) {
        signal(e);
        return;
      }
      pipe.read(echoAllocation(dst.data(), size, tensor), [&](const Error& e) {
        if (e.ok() && armed < reps) {
          arm();
        }
        signal(e);
      });
    });
  };
  arm();
  std::vector<double> us;
  us.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    tp::Message m = echoMessage(src.data(), size, tensor);
    m.descriptor = "handoff";
    sendLikeRpc(pipe, std::move(m));
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, kWait, [&] { return arrived > i; }) || !error.ok()) {
      std::fprintf(stderr, "rpc_bench: hand-off echo failed: %s\n",
                   error.ok() ? "no reply in time" : error.what().c_str());
      std::exit(1);
    }
    us.push_back(micros(Clock::now() - t0));
  }
  return us;
}

void transportCaller(const Phase& p, store::Store& st) {
  auto ctx = makeContext(p, "bench-caller");
  auto pipe = ctx->connect(st.getString("transport/addr"));
  const std::string pre = "transport_" + p.tag;
  const int warmup = flags.iters / 10;
  transportEcho(*pipe, 8, false, warmup);
  const double csw0 = contextSwitches();
  auto us = bestBlock(flags.iters, Best::kMedian,
                      [&](int n) { return transportEcho(*pipe, 8, false, n); });
  report.add(pre + "_csw_per_rtt", (contextSwitches() - csw0) / flags.iters,
             "1");
  note(pre + ": transport " + pipe->transportName() + ", channel " +
       pipe->channelName());
  addLatency(pre + "_rtt_8B", us, "tcp_rtt_8B");
  for (size_t size : kEchoSizes) {
    transportEcho(*pipe, size, true, 2);  // first touch, channel set-up
    auto e = bestBlock(echoReps(size), Best::kMean, [&](int n) {
      return transportEcho(*pipe, size, true, n);
    });
    if (size == kKiB) {
      addLatency(pre + "_echo_1KiB_rtt", e, "");
    }
    report.add(pre + "_echo_" + sizeName(size), echoRate(size, e), "GB/s");
  }
  // The hand-off floor (handoffEcho): the no-op's and the small echoes'.
  handoffEcho(*pipe, 8, false, warmup);
  us = bestBlock(flags.iters, Best::kMedian,
                 [&](int n) { return handoffEcho(*pipe, 8, false, n); });
  addLatency(pre + "_handoff_rtt_8B", us, pre + "_rtt_8B");
  for (size_t size : {kKiB, 64 * kKiB}) {
    handoffEcho(*pipe, size, true, 2);
    auto e = bestBlock(echoReps(size), Best::kMean, [&](int n) {
      return handoffEcho(*pipe, size, true, n);
    });
    report.add(pre + "_handoff_echo_" + sizeName(size), echoRate(size, e),
               "GB/s", pre + "_echo_" + sizeName(size));
  }
  tp::Message stop;
  stop.descriptor = "stop";
  pipe->write(std::move(stop), [](const Error&) {});
  // Let the stop frame leave before the pipe closes.
  std::this_thread::sleep_for(100ms);
  pipe->close();
  ctx->close();
  ctx->join();
}

// ---- RPC
// ---------------------------------------------------------------------

rpc::RpcOptions rpcOptions(const Phase& p) {
  rpc::RpcOptions o;
  o.store = connectStore("rpc-" + p.tag);
  o.localAddress = "127.0.0.1";
  o.transports = p.transports;
  o.initTimeout = kWait;
  return o;
}

template <typename F>
std::vector<double> timeCalls(int n, F&& call) {
  std::vector<double> us;
  us.reserve(n);
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    call();
    us.push_back(micros(Clock::now() - t0));
  }
  return us;
}

void rpcCaller(const Phase& p, store::Store& st) {
  rpc::init("caller", 0, 2, rpcOptions(p));
  const std::string pre = "rpc_" + p.tag;
  const std::string base = "transport_" + p.tag + "_rtt_8B";
  const int warmup = flags.iters / 10;

  timeCalls(warmup, [] { rpc::rpcSync<noop>("callee"); });
  const double csw0 = contextSwitches();
  const auto byThread = bench::switchesByThread();
  auto us = bestBlock(flags.iters, Best::kMedian, [](int n) {
    return timeCalls(n, [] { rpc::rpcSync<noop>("callee"); });
  });
  note(pre + " noop: caller context switches per call by thread:" +
       bench::switchesPerCall(byThread, flags.iters));
  report.add(pre + "_noop_csw_per_call",
             (contextSwitches() - csw0) / flags.iters, "1",
             "transport_" + p.tag + "_csw_per_rtt");
  addLatency(pre + "_noop_rtt", us, base);
  report.add(pre + "_noop_rtt_median_vs_grpc", bench::percentile(us, 0.5), "us",
             "grpc_unary_rtt_8B_median");

  timeCalls(warmup, [] { rpc::rpcSync<noopInline>("callee"); });
  us = bestBlock(flags.iters, Best::kMedian, [](int n) {
    return timeCalls(n, [] { rpc::rpcSync<noopInline>("callee"); });
  });
  addLatency(pre + "_noop_inline_rtt", us, base);

  // remote + toHere against the no-op, in alternating blocks of each, so
  // that every ratio compares two blocks a few milliseconds apart: apart
  // by seconds, as two best-of-three figures are, the ratio swung 0.9-3.5
  // between runs with the VM's moods. Reported: the block pair whose
  // ratio is the median of all pairs (its two medians; docs/benchmarks.md,
  // RPC). Before the calls in flight below, which leave small calls 2-4x
  // slower for seconds after them.
  // Two kinds of value: a number, which comes with remote()'s reply, and a
  // one-element tensor, which toHere() fetches (docs/rref.md). Beside the
  // tensor's pairs, rpcSync() of the same function: one round trip that
  // returns the same tensor, so that what the tensor costs and what the
  // RRef costs can be told apart.
  timeCalls(warmup, [] { rpc::remote<answer>("callee").toHere(); });
  timeCalls(warmup, [] { rpc::remote<oneTensor>("callee").toHere(); });
  const auto remoteByThread = bench::switchesByThread();
  {
    struct BlockPair {
      std::vector<double> noop, remote, call;  // call: tensors only
      double ratio = 0;
    };
    constexpr int kPairs = 10;
    const int n = std::max(flags.iters / kPairs, 10);
    std::vector<BlockPair> numbers(kPairs), tensors(kPairs);
    for (int i = 0; i < kPairs; ++i) {
      numbers[i].noop = timeCalls(n, [] { rpc::rpcSync<noop>("callee"); });
      numbers[i].remote =
          timeCalls(n, [] { rpc::remote<answer>("callee").toHere(); });
      tensors[i].noop = timeCalls(n, [] { rpc::rpcSync<noop>("callee"); });
      tensors[i].remote =
          timeCalls(n, [] { rpc::remote<oneTensor>("callee").toHere(); });
      tensors[i].call = timeCalls(n, [] { rpc::rpcSync<oneTensor>("callee"); });
    }
    note(pre + " remote + toHere: caller context switches per call (the " +
         "no-ops and rpcSync() calls beside them counted as calls) by " +
         "thread:" + bench::switchesPerCall(remoteByThread, 5 * n * kPairs));
    auto reportPairs = [&](std::vector<BlockPair>& pairs,
                           const std::string& what, const std::string& suffix) {
      for (auto& p : pairs) {
        p.ratio =
            bench::percentile(p.remote, 0.5) / bench::percentile(p.noop, 0.5);
      }
      std::sort(pairs.begin(), pairs.end(),
                [](const BlockPair& a, const BlockPair& b) {
                  return a.ratio < b.ratio;
                });
      note(
          pre + " remote + toHere (" + what + ") / no-op, block pairs: " + [&] {
            std::string r;
            for (const auto& p : pairs) {
              r +=
                  (r.empty() ? "" : " ") + std::to_string(p.ratio).substr(0, 4);
            }
            return r;
          }());
      const BlockPair& mid = pairs[kPairs / 2];
      addLatency(pre + "_noop_beside_remote" + suffix, mid.noop, "");
      addLatency(pre + "_remote_tohere" + suffix, mid.remote,
                 pre + "_noop_beside_remote" + suffix);
      if (!mid.call.empty()) {
        addLatency(pre + "_call" + suffix + "_beside_remote", mid.call,
                   pre + "_noop_beside_remote" + suffix);
        report.add(pre + "_remote_tohere" + suffix + "_median_vs_call",
                   bench::percentile(mid.remote, 0.5), "us",
                   pre + "_call" + suffix + "_beside_remote_median");
      }
    };
    reportPairs(numbers, "a number", "");
    reportPairs(tensors, "a tensor", "_tensor");
  }

  const at::Tensor one = at::ones({1});
  timeCalls(warmup, [&] { rpc::rpcSync<addTensors>("callee", one, one); });
  us = bestBlock(flags.iters, Best::kMedian, [&](int n) {
    return timeCalls(n, [&] { rpc::rpcSync<addTensors>("callee", one, one); });
  });
  addLatency(pre + "_add1_rtt", us, base);

  // Calls/s with kInFlight outstanding: a new call as soon as one ends.
  {
    std::counting_semaphore<kInFlight> slots(kInFlight);
    std::atomic<int> failed{0};
    const int n = flags.iters * 4;
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) {
      if (!slots.try_acquire_for(kWait)) {
        std::fprintf(stderr, "rpc_bench: a call did not finish in time\n");
        std::exit(1);
      }
      rpc::rpcAsync<noop>("callee").addDoneCallback([&](const Future<void>& f) {
        if (f.hasError()) {
          failed.fetch_add(1);
        }
        slots.release();
      });
    }
    for (int i = 0; i < kInFlight; ++i) {
      if (!slots.try_acquire_for(kWait)) {
        std::fprintf(stderr, "rpc_bench: a call did not finish in time\n");
        std::exit(1);
      }
    }
    const double secs =
        std::chrono::duration<double>(Clock::now() - t0).count();
    if (failed.load() != 0) {
      std::fprintf(stderr, "rpc_bench: %d calls failed\n", failed.load());
      std::exit(1);
    }
    report.add(pre + "_calls_per_s_64_in_flight", n / secs, "1/s");
  }

  for (size_t size : kEchoSizes) {
    const at::Tensor t = at::ones({static_cast<int64_t>(size)}, at::kByte);
    const int reps = echoReps(size);
    timeCalls(2, [&] { rpc::rpcSync<echoTensor>("callee", t); });
    const double csw0 = contextSwitches();
    auto e = bestBlock(reps, Best::kMean, [&](int n) {
      return timeCalls(n, [&] { rpc::rpcSync<echoTensor>("callee", t); });
    });
    if (size == kKiB) {
      report.add(pre + "_echo_1KiB_csw_per_call",
                 (contextSwitches() - csw0) / reps, "1",
                 pre + "_noop_csw_per_call");
      addLatency(pre + "_echo_1KiB_rtt", e,
                 "transport_" + p.tag + "_echo_1KiB_rtt");
    }
    const std::string n = sizeName(size);
    report.add(pre + "_echo_" + n, echoRate(size, e), "GB/s",
               "transport_" + p.tag + "_echo_" + n);
    if (size <= 64 * kKiB) {
      timeCalls(2, [&] { rpc::rpcSync<echoInline>("callee", t); });
      e = bestBlock(reps, Best::kMean, [&](int k) {
        return timeCalls(k, [&] { rpc::rpcSync<echoInline>("callee", t); });
      });
      report.add(pre + "_echo_inline_" + n, echoRate(size, e), "GB/s",
                 "transport_" + p.tag + "_echo_" + n);
    }
  }
  // Threads of the callee once its agent is up and idle (it counts them
  // before its first call arrives, less those its earlier phases left).
  report.add(pre + "_idle_worker_threads",
             std::stod(st.getString("rpc/" + p.tag + "/idle_threads")), "1");

  // How late a call's timeout fires past its deadline (the unit tests
  // only check it is not early, and not hung): a 10 ms timeout on a
  // function that sleeps 100 ms. Last, since the sleeps hold the callee's
  // worker threads for a while.
  {
    constexpr auto kTimeout = std::chrono::milliseconds(10);
    std::vector<double> late;
    for (int i = 0; i < 20; ++i) {
      const auto t0 = Clock::now();
      try {
        rpc::rpcSync<sleepMs>({"callee", kTimeout}, int64_t{100});
        std::fprintf(stderr, "rpc_bench: a call did not time out\n");
        std::exit(1);
      } catch (const TimeoutError&) {
        late.push_back(micros(Clock::now() - t0 - kTimeout));
      }
    }
    addLatency(pre + "_timeout_10ms_overshoot", late, "");
  }

  st.set("rpc/done", "1");
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
}

size_t threadCount() {
  return static_cast<size_t>(
      std::distance(std::filesystem::directory_iterator("/proc/self/task"),
                    std::filesystem::directory_iterator{}));
}

void rpcCallee(const Phase& p, store::Store& st) {
  const size_t before = threadCount();
  rpc::init("callee", 1, 2, rpcOptions(p));
  // The agent's threads plus the main thread: what an RPC worker process
  // has while it waits for calls.
  st.set("rpc/" + p.tag + "/idle_threads",
         std::to_string(threadCount() - before + 1));
  st.wait({"rpc/done"}, std::chrono::milliseconds(600'000));
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
}

// ---- gRPC unary echo
// -----------------------------------------------------------

class EchoService final : public trellis::bench::Echo::CallbackService {
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx,
                                 const trellis::bench::EchoBytes* request,
                                 trellis::bench::EchoBytes* reply) override {
    *reply = *request;
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

constexpr int kGrpcMaxMessage = 128 << 20;

void grpcCallee(store::Store& st) {
  EchoService service;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(kGrpcMaxMessage);
  b.SetMaxSendMessageSize(kGrpcMaxMessage);
  b.RegisterService(&service);
  auto server = b.BuildAndStart();
  st.set("grpc/port", std::to_string(port));
  st.wait({"grpc/done"}, std::chrono::milliseconds(600'000));
  server->Shutdown(std::chrono::system_clock::now() + 5s);
}

void grpcCaller(store::Store& st) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kGrpcMaxMessage);
  args.SetMaxSendMessageSize(kGrpcMaxMessage);
  auto channel =
      grpc::CreateCustomChannel("127.0.0.1:" + st.getString("grpc/port"),
                                grpc::InsecureChannelCredentials(), args);
  auto stub = trellis::bench::Echo::NewStub(channel);
  auto echo = [&](const trellis::bench::EchoBytes& req) {
    trellis::bench::EchoBytes reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kWait);
    const grpc::Status s = stub->Echo(&ctx, req, &reply);
    if (!s.ok()) {
      std::fprintf(stderr, "rpc_bench: gRPC echo failed: %s\n",
                   s.error_message().c_str());
      std::exit(1);
    }
  };
  trellis::bench::EchoBytes small;
  small.set_data(std::string(8, 'x'));
  timeCalls(flags.iters / 10, [&] { echo(small); });
  addLatency(
      "grpc_unary_rtt_8B",
      bestBlock(flags.iters, Best::kMedian,
                [&](int n) { return timeCalls(n, [&] { echo(small); }); }),
      "tcp_rtt_8B");
  trellis::bench::EchoBytes big;
  big.set_data(std::string(64 * kMiB, 'x'));
  echo(big);
  report.add(
      "grpc_echo_64MiB",
      echoRate(64 * kMiB, timeCalls(echoReps(64 * kMiB), [&] { echo(big); })),
      "GB/s");
  st.set("grpc/done", "1");
}

// ---- the two processes
// -----------------------------------------------------------

// --pin. On the 2-core VM, two processes whose threads may run on either
// vCPU flip, for seconds at a time and with the same context switches per
// call, into a state where small calls take 3-4x longer; with each process
// on a vCPU of its own they never did (docs/benchmarks.md, RPC). Both the
// baselines and the RPC rows of a --pin run are measured that way.

// The CPUs this process may run on, in order.
std::vector<int> allowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) {
        cpus.push_back(c);
      }
    }
  }
  return cpus;
}

std::string cpuList(const std::vector<int>& cpus) {
  std::string out;
  for (int c : cpus) {
    out += (out.empty() ? "" : ",") + std::to_string(c);
  }
  return out;
}

// "0,1,3" -> {0, 1, 3}; empty on anything else (a flag is untrusted).
std::vector<int> parseCpuList(const std::string& text) {
  std::vector<int> cpus;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t comma = std::min(text.find(',', i), text.size());
    const std::optional<int64_t> cpu =
        parseDecimal(std::string_view(text).substr(i, comma - i));
    if (!cpu || *cpu < 0 || *cpu >= CPU_SETSIZE) {
      return {};
    }
    cpus.push_back(static_cast<int>(*cpu));
    i = comma + 1;
  }
  return cpus;
}

// Every thread of this process (and those it starts later) on `cpus`.
void pinTo(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    CPU_SET(c, &set);
  }
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    const pid_t tid = std::stoi(t.path().filename().string());
    if (::sched_setaffinity(tid, sizeof(set), &set) != 0) {
      std::fprintf(stderr, "rpc_bench: cannot pin thread %d to CPUs %s: %s\n",
                   tid, cpuList(cpus).c_str(), std::strerror(errno));
      std::exit(1);
    }
  }
}

int runCallee() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (const auto& p : kPhases) {
    auto st = connectStore("transport-" + p.tag);
    transportCallee(p, *st);
  }
  for (const auto& p : kPhases) {
    auto st = connectStore("phase-" + p.tag);
    rpcCallee(p, *st);
  }
  auto st = connectStore("grpc");
  grpcCallee(*st);
  return 0;
}

pid_t spawnCallee(const char* self) {
  const std::string port = std::to_string(flags.storePort);
  const std::string iters = std::to_string(flags.iters);
  const std::string cpus = cpuList(flags.cpus);
  std::vector<const char*> argv = {self,           "--role",     "callee",
                                   "--store-port", port.c_str(), "--iters",
                                   iters.c_str()};
  if (!cpus.empty()) {
    argv.push_back("--cpus");
    argv.push_back(cpus.c_str());
  }
  argv.push_back(nullptr);
  return bench::spawnSelf("rpc_bench", std::move(argv));
}

int runCaller(const char* self) {
  store::TCPStoreServer server;
  flags.storePort = server.port();
  const pid_t callee = spawnCallee(self);
  const auto t0 = Clock::now();
  tcpBaseline();
  memoryBaselines();
  for (const auto& p : kPhases) {
    auto st = connectStore("transport-" + p.tag);
    transportCaller(p, *st);
  }
  // gRPC runs last on the callee, but its RTT is the baseline of a ratio
  // printed with the RPC rows; the Report resolves baselines at print time.
  for (const auto& p : kPhases) {
    auto st = connectStore("phase-" + p.tag);
    rpcCaller(p, *st);
  }
  {
    auto st = connectStore("grpc");
    grpcCaller(*st);
  }
  const int rc =
      bench::reapChild("rpc_bench", callee, std::chrono::seconds(30));
  note(
      "total " +
      std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) +
      " s");
  report.print(flags.json);
  if (rc != 0) {
    std::fprintf(stderr, "rpc_bench: callee exited with %d\n", rc);
    return 1;
  }
  return 0;
}

[[noreturn]] void usage(const char* self) {
  std::fprintf(stderr,
               "usage: %s [--json] [--iters N] [--echo-mib N] [--pin]\n"
               "  --iters N     round trips per latency metric (default 3000)\n"
               "  --echo-mib N  MiB echoed per tensor size (default 128)\n"
               "  --pin         caller on the first half of the CPUs this\n"
               "                process may use, callee on the rest\n",
               self);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool hasValue = i + 1 < argc;
    if (a == "--json") {
      flags.json = true;
    } else if (a == "--iters" && hasValue) {
      flags.iters = static_cast<int>(
          bench::flagValue("rpc_bench", "--iters", argv[++i], 100, 10000000));
    } else if (a == "--echo-mib" && hasValue) {
      flags.echoBytes = static_cast<size_t>(bench::flagValue(
                            "rpc_bench", "--echo-mib", argv[++i], 1, 1 << 20)) *
                        kMiB;
    } else if (a == "--role" && hasValue) {
      flags.callee = std::strcmp(argv[++i], "callee") == 0;
    } else if (a == "--store-port" && hasValue) {
      flags.storePort = static_cast<uint16_t>(
          bench::flagValue("rpc_bench", "--store-port", argv[++i], 1, 65535));
    } else if (a == "--pin") {
      flags.pin = true;
    } else if (a == "--cpus" && hasValue) {  // the callee's, from --pin
      flags.cpus = parseCpuList(argv[++i]);
      if (flags.cpus.empty()) {
        std::fprintf(stderr, "rpc_bench: --cpus wants a list like 1,2: '%s'\n",
                     argv[i]);
        return 2;
      }
    } else {
      usage(argv[0]);
    }
  }
  if (flags.callee && !flags.cpus.empty()) {
    pinTo(flags.cpus);
  } else if (!flags.callee && flags.pin) {
    const std::vector<int> all = allowedCpus();
    if (all.size() < 2) {
      std::fprintf(stderr,
                   "rpc_bench: --pin needs 2 CPUs; this process may use %zu\n",
                   all.size());
      return 2;
    }
    const auto half = all.begin() + static_cast<std::ptrdiff_t>(all.size() / 2);
    pinTo({all.begin(), half});
    flags.cpus.assign(half, all.end());
    note("pinned: caller on CPUs " + cpuList({all.begin(), half}) +
         ", callee on " + cpuList(flags.cpus));
  }
  try {
    return flags.callee ? runCallee() : runCaller(argv[0]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_bench (%s): %s\n",
                 flags.callee ? "callee" : "caller", e.what());
    return 1;
  }
}
