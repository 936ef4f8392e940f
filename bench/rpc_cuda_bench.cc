// GPU tensor echo through RPC between two processes of one host (the
// cuda_ipc channel), next to what the GPU itself takes for the same bytes,
// measured in the same run: two device-to-device copies and a device
// synchronize (an echo moves the bytes there and back), and the RPC no-op
// round trip (what any call costs), and the same echo through the transport
// alone (Context and Pipe, the cuda_ipc channel; driven from the loop's
// callbacks), which is what the RPC layer adds to, and that echo between two
// contexts of the caller's process. TRELLIS_CUDA_IPC_TRACE=1 logs where a
// cuda_ipc read's time goes (docs/transport.md). `--json` prints one JSON
// object per line (DESIGN.md, "Benchmarks"). Exits 0 with a note, measuring
// nothing, where no GPU is visible or libtorch has no CUDA.
//
// The program re-executes itself as the callee (`--role callee`); both meet
// through a TCPStore the caller serves. "Echo throughput" is bytes echoed
// per second: size / round trip. Each figure is the best of three blocks
// (mean of the block), as in rpc_bench.
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime_api.h>
#include <functional>
#include <string>
#include <sys/prctl.h>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "pipe_bench_util.h"
#include <trellis/core/future.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/transport/context.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

namespace rpc = trellis::rpc;
namespace store = trellis::store;
namespace bench = trellis::bench;
namespace tp = trellis::transport;
using trellis::Error;
using trellis::Promise;
using Clock = std::chrono::steady_clock;

at::Tensor echoTensor(const at::Tensor& t) { return t; }
void noop() {}
TRELLIS_REMOTE_FUNCTION(echoTensor);
TRELLIS_REMOTE_FUNCTION(noop);

namespace {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;
const std::vector<size_t> kSizes = {kKiB,      64 * kKiB, kMiB,
                                    16 * kMiB, 64 * kMiB, 256 * kMiB};
constexpr auto kWait = std::chrono::seconds(120);
constexpr auto kWaitMs = std::chrono::milliseconds(kWait);

struct Flags {
  bool json = false;
  int iters = 1000;  // calls per latency figure, and the cap per size
  size_t echoBytes = 1024 * kMiB;  // bytes echoed per size (at least 30 calls)
  size_t maxBytes = SIZE_MAX;      // sizes above are skipped
  bool callee = false;
  uint16_t storePort = 0;
};
Flags flags;
bench::Report report("rpc_cuda");

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

std::string sizeName(size_t n) {
  return n >= kMiB ? std::to_string(n / kMiB) + "MiB"
                   : std::to_string(n / kKiB) + "KiB";
}

// The sizes this run measures.
std::vector<size_t> sizes() {
  std::vector<size_t> out;
  for (size_t s : kSizes) {
    if (s <= flags.maxBytes) {
      out.push_back(s);
    }
  }
  return out;
}

int repsFor(size_t size) {
  return static_cast<int>(
      std::clamp<size_t>(flags.echoBytes / size, 30, size_t(flags.iters)));
}

// `n` timings (us) of `one`, one after another.
std::vector<double> timeCalls(int n, const std::function<void()>& one) {
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    one();
    us.push_back(micros(Clock::now() - t0));
  }
  return us;
}

// `reps` timings in three blocks of `block(reps / 3)`; the block of the
// lowest mean.
std::vector<double> bestBlock(
    int reps, const std::function<std::vector<double>(int)>& block) {
  std::vector<double> best;
  for (int b = 0; b < 3; ++b) {
    auto us = block(reps / 3);
    if (best.empty() || bench::mean(us) < bench::mean(best)) {
      best = std::move(us);
    }
  }
  return best;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "rpc_cuda_bench: %s: %s\n", what,
                 cudaGetErrorString(e));
    std::exit(1);
  }
}

std::shared_ptr<store::Store> connectStore() {
  store::TCPStoreOptions o;
  o.port = flags.storePort;
  o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kWait);
  return std::make_shared<store::PrefixStore>(
      "rpc-cuda", std::make_shared<store::TCPStore>(o));
}

rpc::RpcOptions options() {
  rpc::RpcOptions o;
  o.store = connectStore();
  o.localAddress = "127.0.0.1";
  o.initTimeout = kWait;
  o.defaultTimeout = kWait;
  return o;
}

// ---- the transport alone ----------------------------------------------------

std::shared_ptr<tp::Context> makeContext(const char* name) {
  tp::ContextOptions o;
  o.name = name;
  o.tokenFromEnvironment = false;
  return tp::Context::create(o);
}

const tp::Device kDevice0 = tp::Device::cuda(0);

// Echoes each message's one CUDA tensor on `pipe` back from a device
// buffer it keeps, until a descriptor "stop".
void serveEcho(const std::shared_ptr<tp::Pipe>& pipe) {
  at::Tensor buffer;
  Promise<void> done;
  std::function<void()> next = [&] {
    pipe->readDescriptor([&](const Error& e, tp::Descriptor d) {
      if (!e.ok() || d.descriptor == "stop" || d.tensors.size() != 1) {
        e.ok() ? done.setValue() : done.setError(e);
        return;
      }
      const size_t n = d.tensors[0].length;
      if (!buffer.defined() || size_t(buffer.numel()) < n) {
        buffer = at::empty(
            {static_cast<int64_t>(n)},
            at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0));
      }
      tp::Allocation a;
      a.tensors.push_back({buffer.data_ptr(), n});
      pipe->read(std::move(a), [&, n](const Error& e) {
        if (!e.ok()) {
          done.setError(e);
          return;
        }
        tp::Message m;
        m.tensors.push_back({buffer.data_ptr(), n, kDevice0});
        // The caller sends its next message only after this echo arrived.
        pipe->write(std::move(m), [](const Error&) {});
        next();
      });
    });
  };
  next();
  done.getFuture().wait(std::chrono::seconds(600));
}

// The callee process's echo server.
void transportCallee(store::Store& st) {
  auto ctx = makeContext("bench-callee");
  auto listener = ctx->listen({"uv://127.0.0.1:0"});
  st.set("transport/addr", listener->address("uv"));
  auto pipe = bench::acceptOne(*listener, kWaitMs);
  serveEcho(pipe);
  pipe->close();
  ctx->close();
  ctx->join();
}

// Caller: `reps` sequential echoes of `src` into `dst`, each started from
// the callback that finished the last, on the loop thread; µs each.
std::vector<double> transportEcho(tp::Pipe& pipe, const at::Tensor& src,
                                  at::Tensor& dst, int reps) {
  const size_t n = src.nbytes();
  std::vector<double> us;
  Promise<void> done;
  int i = 0;
  Clock::time_point t0;
  std::function<void()> ping = [&] {
    t0 = Clock::now();
    tp::Message m;
    m.tensors.push_back({src.data_ptr(), n, kDevice0});
    pipe.write(std::move(m), [](const Error&) {});
    pipe.readDescriptor([&](const Error& e, tp::Descriptor) {
      if (!e.ok()) {
        Promise<void>(done).setError(e);
        return;
      }
      tp::Allocation a;
      a.tensors.push_back({dst.data_ptr(), n});
      pipe.read(std::move(a), [&](const Error& e) {
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

// The echo rows of `pipe` (`prefix` + size), then "stop" to its server.
void measureTransport(tp::Pipe& pipe, const std::string& prefix) {
  const auto on = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0);
  for (size_t size : sizes()) {
    const auto n = static_cast<int64_t>(size);
    const at::Tensor src = at::ones({n}, on);
    at::Tensor dst = at::empty({n}, on);
    transportEcho(pipe, src, dst, 2);
    const auto best = bestBlock(
        repsFor(size), [&](int n) { return transportEcho(pipe, src, dst, n); });
    const std::string name = sizeName(size);
    if (size == kKiB) {
      report.add(prefix + "1KiB_rtt_median", bench::percentile(best, 0.5),
                 "us");
    }
    report.add(prefix + name,
               static_cast<double>(size) / bench::mean(best) / 1e3, "GB/s",
               "cuda_copy_there_and_back_" + name);
  }
  tp::Message stop;
  stop.descriptor = "stop";
  Promise<void> sent;
  pipe.write(std::move(stop), [sent](const Error& e) mutable {
    e.ok() ? sent.setValue() : sent.setError(e);
  });
  sent.getFuture().wait(kWait);
}

// Between the two processes, and between two contexts of this process
// (one CUDA context: cuda_ipc then opens no handle and the GPU switches no
// context between the writer's work and the reader's, which tells how much
// of a cross-process echo is the driver's).
void transportCaller(store::Store& st) {
  {
    auto ctx = makeContext("bench-caller");
    st.wait({"transport/addr"}, std::chrono::milliseconds(120'000));
    auto pipe = ctx->connect(st.getString("transport/addr"));
    measureTransport(*pipe, "transport_cuda_echo_");
    pipe->close();
    ctx->close();
    ctx->join();
  }
  auto serverCtx = makeContext("bench-echo");
  auto listener = serverCtx->listen({"uv://127.0.0.1:0"});
  auto ctx = makeContext("bench-caller");
  auto pipe = ctx->connect(listener->address("uv"));
  std::thread server([&] {
    auto p = bench::acceptOne(*listener, kWaitMs);
    serveEcho(p);
    p->close();
  });
  measureTransport(*pipe, "transport_cuda_in_process_echo_");
  server.join();
  pipe->close();
  for (auto* c : {&ctx, &serverCtx}) {
    (*c)->close();
    (*c)->join();
  }
}

// ---- RPC
// ----------------------------------------------------------------------

void measure() {
  const auto on = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0);
  std::vector<double> us = bestBlock(flags.iters, [](int n) {
    return timeCalls(n, [] { rpc::rpcSync<noop>("callee"); });
  });
  report.add("rpc_cuda_noop_rtt_median", bench::percentile(us, 0.5), "us");
  for (size_t size : sizes()) {
    const auto n = static_cast<int64_t>(size);
    const at::Tensor src = at::ones({n}, on);
    at::Tensor mid = at::empty({n}, on);
    at::Tensor dst = at::empty({n}, on);
    const int reps = repsFor(size);
    // The GPU alone: there and back, then wait for it.
    auto copies = [&] {
      mid.copy_(src);
      dst.copy_(mid);
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    };
    copies();
    us = bestBlock(reps, [&](int k) { return timeCalls(k, copies); });
    const std::string name = sizeName(size);
    report.add("cuda_copy_there_and_back_" + name,
               static_cast<double>(size) / bench::mean(us) / 1e3, "GB/s");
    auto echo = [&] { rpc::rpcSync<echoTensor>("callee", src); };
    echo();
    echo();
    us = bestBlock(reps, [&](int k) { return timeCalls(k, echo); });
    if (size == kKiB) {
      report.add("rpc_cuda_echo_1KiB_rtt_median", bench::percentile(us, 0.5),
                 "us", "transport_cuda_echo_1KiB_rtt_median");
    }
    report.add("rpc_cuda_echo_" + name,
               static_cast<double>(size) / bench::mean(us) / 1e3, "GB/s",
               "transport_cuda_echo_" + name);
  }
}

int runCaller() {
  store::TCPStoreServer server;
  flags.storePort = server.port();
  const std::string port = std::to_string(flags.storePort);
  const pid_t callee = bench::spawnSelf(
      "rpc_cuda_bench", {"/proc/self/exe", "--role", "callee", "--store-port",
                         port.c_str(), nullptr});
  transportCaller(*connectStore());
  rpc::init("caller", 0, 2, options());
  measure();
  connectStore()->set("done", "1");
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
  const int rc = bench::reapChild("rpc_cuda_bench", callee);
  report.print(flags.json);
  return rc == 0 ? 0 : 1;
}

int runCallee() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  transportCallee(*connectStore());
  rpc::init("callee", 1, 2, options());
  connectStore()->wait({"done"}, std::chrono::milliseconds(600'000));
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
  return 0;
}

[[noreturn]] void usage(const char* self) {
  std::fprintf(stderr,
               "usage: %s [--json] [--iters N] [--echo-mib N] [--max-kib N]\n"
               "  --iters N     calls per latency figure, and at most per "
               "size (default 1000)\n"
               "  --echo-mib N  MiB echoed per size (default 1024)\n"
               "  --max-kib N   only the sizes up to N KiB (default all; 1 "
               "for the fixed cost alone)\n",
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
      flags.iters = static_cast<int>(bench::flagValue(
          "rpc_cuda_bench", "--iters", argv[++i], 30, 10'000'000));
    } else if (a == "--echo-mib" && hasValue) {
      flags.echoBytes =
          static_cast<size_t>(bench::flagValue("rpc_cuda_bench", "--echo-mib",
                                               argv[++i], 1, 1 << 20)) *
          kMiB;
    } else if (a == "--max-kib" && hasValue) {
      flags.maxBytes =
          static_cast<size_t>(bench::flagValue("rpc_cuda_bench", "--max-kib",
                                               argv[++i], 1, 1 << 30)) *
          kKiB;
    } else if (a == "--role" && hasValue) {
      flags.callee = std::strcmp(argv[++i], "callee") == 0;
    } else if (a == "--store-port" && hasValue) {
      flags.storePort = static_cast<uint16_t>(bench::flagValue(
          "rpc_cuda_bench", "--store-port", argv[++i], 1, 65535));
    } else {
      usage(argv[0]);
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      !at::hasCUDA()) {
    bench::note(
        "rpc_cuda_bench: no GPU visible, or a libtorch without CUDA: "
        "nothing measured");
    return 0;
  }
  try {
    return flags.callee ? runCallee() : runCaller();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_cuda_bench (%s): %s\n",
                 flags.callee ? "callee" : "caller", e.what());
    return 1;
  }
}
