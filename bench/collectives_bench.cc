// Collectives benchmark (issue 16): bus bandwidth of allreduce, allgather
// (allgatherIntoTensor), broadcast and reduceScatter (reduceScatterTensor)
// over the cpu backend at 2 and 4 ranks, float32 from 4 KiB to 256 MiB,
// and the 8-byte allreduce latency, next to Gloo (TCP transport on
// 127.0.0.1) measured the same way in the same run. `--json` prints one
// JSON object per line; notes (`# ...`) go to stderr; `--quick` runs fewer
// iterations.
//
// Every rank is a process of its own: the program hosts a TCPStoreServer on
// port 0 and re-executes itself once per rank and phase (`--role worker`),
// so that every phase starts from fresh processes with its own environment
// (the forced-ring phase sets TRELLIS_COLLECTIVES_ALGO and
// TRELLIS_TRANSPORTS, the others clear them). Rank 0 of a phase leaves its
// figures in the store under the phase's prefix; the program reads them.
//
// Bus bandwidth as nccl-tests defines it, with S the size of the whole
// buffer (allgather's output, reduceScatter's input): algbw = S / time;
// busbw = algbw * 2(n-1)/n for allreduce, * (n-1)/n for allgather and
// reduceScatter, = algbw for broadcast. The time is rank 0's for a run of
// back-to-back ops closed by a barrier, after a warm-up. Each op and size is
// checked once against known values before it is timed; a wrong result is
// printed as a note and its row is left out.
//
// Baselines: Gloo's allreduce (default algorithm, what torch's gloo group
// calls), AllgatherRing, BroadcastOneToAll and ReduceScatterHalvingDoubling;
// one-thread memcpy of 64 MiB; and the uv transport's own one-way 64 MiB
// throughput (two contexts restricted to uv in this process, as
// transport_bench measures it), against which the allreduce forced onto
// the ring over uv is quoted ("forced cross-host ring"); and what the ring
// can reach at most on this machine, the uv transport both ways at once:
// between two contexts of this process (uv_both_ways_64MiB) and between
// the ring phase's own two processes (uv_both_ways_2proc_64MiB), each
// timed from the first write to the last read of either direction.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/broadcast_one_to_all.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <map>
#include <memory>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "pipe_bench_util.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/future.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/transport/context.h>

extern char** environ;

using namespace trellis;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
const std::vector<size_t> kSizes = {4 * kKiB,  64 * kKiB, 1 * kMiB,
                                    16 * kMiB, 64 * kMiB, 256 * kMiB};
const std::vector<std::string> kOps = {"allreduce", "allgather", "broadcast",
                                       "reducescatter"};

struct Flags {
  bool json = false;
  bool quick = false;
  bool verbose = false;
  std::string only;  // ",phase,phase," or empty: all
  bool worker = false;
  int rank = 0;
  int world = 0;
  uint16_t storePort = 0;
  std::string phase;
} flags;

std::string sizeName(size_t bytes) {
  return bytes >= kMiB ? std::to_string(bytes / kMiB) + "MiB"
                       : std::to_string(bytes / kKiB) + "KiB";
}

// Timed ops per size: about the same bytes per figure, within bounds.
int itersFor(size_t bytes) {
  const size_t budget = flags.quick ? 32 * kMiB : 512 * kMiB;
  const size_t lo = flags.quick ? 2 : 3;
  const size_t hi = flags.quick ? 200 : 1000;
  return static_cast<int>(std::clamp(budget / bytes, lo, hi));
}

double busFactor(const std::string& op, int n) {
  if (op.rfind("allreduce", 0) == 0) {
    return 2.0 * (n - 1) / n;
  }
  if (op == "broadcast") {
    return 1.0;
  }
  return static_cast<double>(n - 1) / n;
}

// ---- what a worker measures, for either library ---------------------------

// One op at one size: `fill` sets the inputs to known values, `run` runs the
// op once, `check` says whether the outputs hold the expected values.
struct OpCase {
  std::function<void()> fill;
  std::function<void()> run;
  std::function<bool()> check;
};

// What both libraries provide to the measuring loop.
struct Library {
  std::string name;  // "trellis", "gloo"
  std::function<void()> barrier;
  // The case for `op` with a whole-buffer size of `bytes` (see the header).
  std::function<OpCase(const std::string& op, size_t bytes)> make;
  // More ops measured at 64 MiB and 8 B only, for orientation.
  std::vector<std::string> extraOps;
};

// Lines "metric value unit", and "! note" for a wrong result.
std::string measure(Library& lib, bool only64MiBAllreduce,
                    const std::string& suffix) {
  const int n = flags.world;
  std::ostringstream out;
  auto timeRun = [&](OpCase& c, int iters) {
    lib.barrier();
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      c.run();
    }
    lib.barrier();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  auto figure = [&](const std::string& op, size_t bytes) {
    const std::string metric = lib.name + suffix + "_" + op + "_" +
                               sizeName(bytes) + "_busbw_" + std::to_string(n) +
                               "r";
    OpCase c = lib.make(op, bytes);
    c.fill();
    // Gloo's older algorithms write straight into a peer's registered
    // buffer: no rank may run before every rank has filled its own.
    lib.barrier();
    c.run();
    if (!c.check()) {
      out << "! " << metric << ": wrong result on rank " << flags.rank << "\n";
      // The other ranks time it anyway; keep in step with them.
    }
    const int iters = itersFor(bytes);
    timeRun(c, std::max(1, iters / 10));
    const double secs = timeRun(c, iters);
    const double algbw = static_cast<double>(bytes) * iters / secs / 1e9;
    out << metric << " " << algbw * busFactor(op, n) << " GB/s\n";
    if (flags.verbose && flags.rank == 0) {
      bench::note(metric + ": " + std::to_string(algbw * busFactor(op, n)) +
                  " GB/s, " + std::to_string(iters) + " ops in " +
                  std::to_string(secs) + " s");
    }
  };
  // 8-byte latency: every op timed alone on rank 0.
  auto latency = [&](const std::string& op) {
    OpCase c = lib.make(op, 8);
    c.fill();
    lib.barrier();
    c.run();
    if (!c.check()) {
      out << "! " << lib.name << "_" << op << "_8B: wrong result on rank "
          << flags.rank << "\n";
    }
    const int warm = flags.quick ? 50 : 300;
    const int iters = flags.quick ? 300 : 3000;
    std::vector<double> us;
    us.reserve(static_cast<size_t>(iters));
    lib.barrier();
    for (int i = 0; i < warm + iters; ++i) {
      const auto t0 = Clock::now();
      c.run();
      if (i >= warm) {
        us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - t0)
                .count());
      }
    }
    lib.barrier();
    const std::string prefix = lib.name + "_" + op + "_8B_";
    const std::string r = "_" + std::to_string(n) + "r";
    out << prefix << "median" << r << " " << bench::percentile(us, 0.5)
        << " us\n";
    out << prefix << "p99" << r << " " << bench::percentile(us, 0.99)
        << " us\n";
  };
  if (only64MiBAllreduce) {
    figure("allreduce", 64 * kMiB);
    return out.str();
  }
  for (const auto& op : kOps) {
    for (size_t bytes : kSizes) {
      figure(op, bytes);
    }
  }
  latency("allreduce");
  for (const auto& op : lib.extraOps) {
    figure(op, 64 * kMiB);
    latency(op);
  }
  return out.str();
}

bool allEqual(const float* p, size_t count, float v) {
  for (size_t i = 0; i < count; ++i) {
    if (p[i] != v) {
      if (flags.verbose) {
        bench::note("element " + std::to_string(i) + " of " +
                    std::to_string(count) + " is " + std::to_string(p[i]) +
                    ", expected " + std::to_string(v));
      }
      return false;
    }
  }
  return true;
}

// Expected values (small integers: exact in float32): allreduce and
// allgather inputs are rank + 1, broadcast's root holds 7, reduceScatter's
// block b on rank r is (r + 1) * (b + 1).
float triangle(int n) { return static_cast<float>(n * (n + 1) / 2); }

// ---- Trellis ---------------------------------------------------------------

// The uv transport both ways at once between this phase's two processes:
// each rank writes `count` 64 MiB messages to the other while it reads as
// many, over one pipe of its own contexts (uv only, as the forced ring).
// Per direction, rank 0's figure: what loopback carries between two
// processes that both send and receive, the most a two-rank ring can move.
// `pg` (the phase's group) starts the ranks together and gathers their
// clocks.
std::string twoProcessBothWays(store::Store& st,
                               collectives::ProcessGroup& pg) {
  using namespace trellis::transport;
  ContextOptions o;
  o.tokenFromEnvironment = false;
  o.transports = {"uv"};
  o.name = "rank" + std::to_string(flags.rank);
  auto ctx = Context::create(o);
  std::shared_ptr<Listener> listener;
  std::shared_ptr<Pipe> pipe;
  if (flags.rank == 0) {
    listener = ctx->listen({"uv://127.0.0.1:0"});
    st.set("both_ways/address",
           std::string_view(listener->addresses().begin()->second));
    pipe = bench::acceptOne(*listener, std::chrono::seconds(30));
  } else {
    st.wait({"both_ways/address"});
    pipe = ctx->connect(st.getString("both_ways/address"));
  }
  const size_t size = 64 * kMiB;
  auto src = bench::prefaulted(size);
  auto dst = bench::prefaulted(size);
  // Timed from the first rank's first write to the last rank's last read
  // (steady_clock is one clock for every process of the host), so that
  // neither rank's figure gains from the other starting early.
  auto run = [&](size_t count) {
    pg.barrier().wait();  // both ranks start together
    const auto t0 = Clock::now();
    bench::oneWayThroughput(pipe, dst.data(), size, count, false, [&](size_t) {
      Message m;
      m.payloads.push_back({src.data(), size});
      pipe->write(std::move(m), [](const Error&) {});
    });
    const auto t1 = Clock::now();
    // Once every rank has given its clocks, every rank has read everything,
    // so every write of either has ended.
    const auto mine =
        at::tensor({static_cast<int64_t>(t0.time_since_epoch().count()),
                    static_cast<int64_t>(t1.time_since_epoch().count())},
                   at::kLong);
    auto all = at::empty({2 * flags.world}, at::kLong);
    pg.allgatherIntoTensor(all, mine).wait();
    const auto clocks = all.view({flags.world, 2});
    const int64_t first = clocks.select(1, 0).min().item<int64_t>();
    const int64_t last = clocks.select(1, 1).max().item<int64_t>();
    const double secs =
        std::chrono::duration<double>(Clock::duration(last - first)).count();
    return static_cast<double>(count * size) / secs / 1e9;
  };
  run(2);  // warm-up
  const double rate = run(flags.quick ? 4 : 8);
  pipe->close();
  return "uv_both_ways_2proc_64MiB " + std::to_string(rate) + " GB/s\n";
}

std::string runTrellis(std::shared_ptr<store::Store> st, bool ringOnly) {
  at::set_num_threads(1);
  collectives::ProcessGroupOptions o;
  o.name = "bench";
  auto pg =
      collectives::ProcessGroup::create("cpu", st, flags.rank, flags.world, o);
  const int n = flags.world;
  const int rank = flags.rank;
  Library lib;
  lib.name = ringOnly ? "trellis_ring_uv" : "trellis";
  lib.barrier = [&] { pg->barrier().wait(); };
  lib.make = [&](const std::string& op, size_t bytes) {
    const int64_t count = static_cast<int64_t>(bytes / sizeof(float));
    const int64_t block = count / n;
    OpCase c;
    if (op == "allreduce") {
      auto t = at::empty({count}, at::kFloat);
      c.fill = [t, rank]() mutable { t.fill_(rank + 1); };
      c.run = [t, &pg] { pg->allreduce(t).wait(); };
      c.check = [t, n] {
        return allEqual(t.data_ptr<float>(), t.numel(), triangle(n));
      };
    } else if (op == "allgather") {
      auto in = at::empty({block}, at::kFloat);
      auto out = at::empty({block * n}, at::kFloat);
      c.fill = [in, out, rank]() mutable {
        in.fill_(rank + 1);
        out.fill_(0);
      };
      c.run = [in, out, &pg] { pg->allgatherIntoTensor(out, in).wait(); };
      c.check = [out, block, n] {
        for (int r = 0; r < n; ++r) {
          if (!allEqual(out.data_ptr<float>() + r * block,
                        static_cast<size_t>(block), r + 1.0f)) {
            return false;
          }
        }
        return true;
      };
    } else if (op == "broadcast") {
      auto t = at::empty({count}, at::kFloat);
      c.fill = [t, rank]() mutable { t.fill_(rank == 0 ? 7 : 0); };
      c.run = [t, &pg] { pg->broadcast(t, 0).wait(); };
      c.check = [t] { return allEqual(t.data_ptr<float>(), t.numel(), 7); };
    } else {
      auto in = at::empty({block * n}, at::kFloat);
      auto out = at::empty({block}, at::kFloat);
      c.fill = [in, out, rank, block, n]() mutable {
        for (int b = 0; b < n; ++b) {
          in.narrow(0, b * block, block).fill_((rank + 1) * (b + 1));
        }
        out.fill_(0);
      };
      c.run = [in, out, &pg] { pg->reduceScatterTensor(out, in).wait(); };
      c.check = [out, block, rank, n] {
        return allEqual(out.data_ptr<float>(), static_cast<size_t>(block),
                        (rank + 1) * triangle(n));
      };
    }
    return c;
  };
  std::string result = measure(lib, ringOnly, "");
  pg->barrier().wait();
  if (ringOnly) {
    result += twoProcessBothWays(*st, *pg);
  }
  return result;
}

// ---- Gloo ------------------------------------------------------------------

// Gloo's rendezvous over the Trellis store.
class GlooStore : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<store::Store> st) : st_(std::move(st)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    st_->set(key,
             std::span<const uint8_t>(
                 reinterpret_cast<const uint8_t*>(data.data()), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    const auto v = st_->get(key);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { st_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    st_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<store::Store> st_;
};

std::string runGloo(std::shared_ptr<store::Store> st) {
  GlooStore gs(std::move(st));
  gloo::transport::tcp::attr attr("127.0.0.1");
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  auto ctx =
      std::make_shared<gloo::rendezvous::Context>(flags.rank, flags.world);
  ctx->setTimeout(std::chrono::seconds(300));
  ctx->connectFullMesh(gs, dev);
  std::shared_ptr<gloo::Context> g = ctx;
  const int n = flags.world;
  const int rank = flags.rank;
  gloo::BarrierAllToAll barrier(g);
  Library lib;
  lib.name = "gloo";
  lib.extraOps = {"allreduce_api"};
  lib.barrier = [&] { barrier.run(); };
  lib.make = [&](const std::string& op, size_t bytes) {
    const size_t count = bytes / sizeof(float);
    const size_t block = count / static_cast<size_t>(n);
    OpCase c;
    // Shared so that the closures own the memory; touched by fill().
    auto buf = std::make_shared<std::vector<float>>(count);
    float* p = buf->data();
    if (op == "allreduce") {
      c.fill = [buf, rank] {
        std::fill(buf->begin(), buf->end(), rank + 1.0f);
      };
      // The pipelined ring. gloo::allreduce (allreduce_api below, what
      // torch's gloo group calls) is measured too: on this VM either one
      // can be the faster, by up to several times, from run to run.
      auto algo = std::make_shared<gloo::AllreduceRingChunked<float>>(
          g, std::vector<float*>{p}, static_cast<int>(count));
      c.run = [algo, buf] { algo->run(); };
      c.check = [buf, n] {
        return allEqual(buf->data(), buf->size(), triangle(n));
      };
    } else if (op == "allreduce_api") {
      c.fill = [buf, rank] {
        std::fill(buf->begin(), buf->end(), rank + 1.0f);
      };
      // As torch's gloo group calls it: options made per op, default
      // algorithm.
      c.run = [buf, g, count] {
        gloo::AllreduceOptions o(g);
        o.setOutput(buf->data(), count);
        o.setReduceFunction(
            static_cast<void (*)(void*, const void*, const void*, size_t)>(
                &gloo::sum<float>));
        o.setTag(1);
        gloo::allreduce(o);
      };
      c.check = [buf, n] {
        return allEqual(buf->data(), buf->size(), triangle(n));
      };
    } else if (op == "allgather") {
      auto in = std::make_shared<std::vector<float>>(block);
      auto algo = std::make_shared<gloo::AllgatherRing<float>>(
          g, std::vector<const float*>{in->data()}, p, static_cast<int>(block));
      c.fill = [in, buf, rank] {
        std::fill(in->begin(), in->end(), rank + 1.0f);
        std::fill(buf->begin(), buf->end(), 0.0f);
      };
      c.run = [algo, in, buf] { algo->run(); };
      c.check = [buf, block, n] {
        for (int r = 0; r < n; ++r) {
          if (!allEqual(buf->data() + r * block, block, r + 1.0f)) {
            return false;
          }
        }
        return true;
      };
    } else if (op == "broadcast") {
      auto algo = std::make_shared<gloo::BroadcastOneToAll<float>>(
          g, std::vector<float*>{p}, count, 0);
      c.fill = [buf, rank] {
        std::fill(buf->begin(), buf->end(), rank == 0 ? 7.0f : 0.0f);
      };
      c.run = [algo, buf] { algo->run(); };
      c.check = [buf] { return allEqual(buf->data(), buf->size(), 7); };
    } else {
      // In place: rank r's reduced block lands at the start of the buffer.
      auto algo = std::make_shared<gloo::ReduceScatterHalvingDoubling<float>>(
          g, std::vector<float*>{p}, static_cast<int>(count),
          std::vector<int>(static_cast<size_t>(n), static_cast<int>(block)));
      c.fill = [buf, rank, block, n] {
        for (int b = 0; b < n; ++b) {
          std::fill(buf->begin() + b * block, buf->begin() + (b + 1) * block,
                    (rank + 1.0f) * (b + 1));
        }
      };
      c.run = [algo, buf] { algo->run(); };
      c.check = [buf, block, rank, n] {
        return allEqual(buf->data(), block, (rank + 1) * triangle(n));
      };
    }
    return c;
  };
  std::string result = measure(lib, false, "");
  barrier.run();
  return result;
}

int runWorker() {
  store::TCPStoreOptions so;
  so.port = flags.storePort;
  auto base = std::make_shared<store::TCPStore>(so);
  auto st = std::make_shared<store::PrefixStore>(flags.phase, base);
  std::string result;
  if (flags.phase.rfind("gloo", 0) == 0) {
    result = runGloo(st);
  } else {
    result = runTrellis(st, flags.phase.find("ring_uv") != std::string::npos);
  }
  // Every rank's notes, rank 0's figures.
  std::string mine;
  std::istringstream lines(result);
  for (std::string line; std::getline(lines, line);) {
    if (flags.rank == 0 || line.rfind("!", 0) == 0) {
      mine += line + "\n";
    }
  }
  st->set("result/" + std::to_string(flags.rank), std::string_view(mine));
  return 0;
}

// ---- the program: baselines, phases, the table ----------------------------

bench::Report report("collectives");

// One-thread memcpy of 64 MiB between warm buffers.
void memcpyBaseline() {
  const size_t n = 64 * kMiB;
  auto a = bench::prefaulted(n);
  auto b = bench::prefaulted(n);
  const int reps = flags.quick ? 8 : 32;
  std::memcpy(b.data(), a.data(), n);
  const auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) {
    std::memcpy(b.data(), a.data(), n);
    a[static_cast<size_t>(i)] = b[n - 1 - static_cast<size_t>(i)];
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  report.add("memcpy_64MiB", reps * n / secs / 1e9, "GB/s");
}

// The uv transport's one-way throughput of 64 MiB payloads, two contexts
// restricted to uv in this process, messages back to back (transport_bench's
// uv_throughput_64MiB).
void uvBaseline() {
  using namespace trellis::transport;
  ContextOptions o;
  o.tokenFromEnvironment = false;
  o.transports = {"uv"};
  o.name = "bench-server";
  auto server = Context::create(o);
  o.name = "bench-client";
  auto client = Context::create(o);
  auto listener = server->listen({"uv://127.0.0.1:0"});
  auto c = client->connect(listener->addresses().begin()->second);
  auto s = bench::acceptOne(*listener, std::chrono::seconds(30));
  const size_t size = 64 * kMiB;
  auto src = bench::prefaulted(size);
  auto dst = bench::prefaulted(size);
  auto run = [&](size_t count) {
    return bench::oneWayThroughput(
        s, dst.data(), size, count, false, [&](size_t) {
          Message m;
          m.payloads.push_back({src.data(), size});
          c->write(std::move(m), [](const Error&) {});
        });
  };
  run(2);  // warm-up
  report.add("uv_throughput_64MiB", run(flags.quick ? 4 : 16), "GB/s");
  // Both ways at once, per direction: what a two-rank ring over uv can
  // reach at most, since each rank sends and receives at the same time and
  // loopback TCP spends a core's time on either side of every byte.
  // Timed from the first write to the last read of either direction: each
  // direction timed alone would gain from the other finishing early.
  auto src2 = bench::prefaulted(size);
  auto dst2 = bench::prefaulted(size);
  const size_t count = flags.quick ? 4 : 16;
  const auto t0 = Clock::now();
  std::thread reverse([&] {
    bench::oneWayThroughput(c, dst2.data(), size, count, false, [&](size_t) {
      Message m;
      m.payloads.push_back({src2.data(), size});
      s->write(std::move(m), [](const Error&) {});
    });
  });
  run(count);
  reverse.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  report.add("uv_both_ways_64MiB",
             static_cast<double>(count * size) / secs / 1e9, "GB/s");
}

struct Phase {
  std::string name;
  int world;
  // Variables set for the ranks; an empty value removes the variable.
  std::vector<std::pair<std::string, std::string>> env;
};

std::vector<std::string> phaseEnvironment(const Phase& p) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    const bool replaced =
        std::any_of(p.env.begin(), p.env.end(),
                    [&](const auto& v) { return v.first == key; });
    if (!replaced) {
      env.push_back(kv);
    }
  }
  for (const auto& [k, v] : p.env) {
    if (!v.empty()) {
      env.push_back(k + "=" + v);
    }
  }
  return env;
}

// Runs one phase's ranks to completion; "metric value unit" lines of rank 0
// and every rank's notes.
std::string runPhase(const Phase& p) {
  const auto envStrings = phaseEnvironment(p);
  std::vector<char*> envp;
  for (const auto& s : envStrings) {
    envp.push_back(const_cast<char*>(s.c_str()));
  }
  envp.push_back(nullptr);
  const std::string port = std::to_string(flags.storePort);
  const std::string world = std::to_string(p.world);
  std::vector<pid_t> pids;
  for (int r = 0; r < p.world; ++r) {
    const std::string rank = std::to_string(r);
    std::vector<const char*> argv = {
        "collectives_bench", "--role",  "worker",      "--rank",
        rank.c_str(),        "--world", world.c_str(), "--store-port",
        port.c_str(),        "--phase", p.name.c_str()};
    if (flags.quick) {
      argv.push_back("--quick");
    }
    if (flags.verbose) {
      argv.push_back("--verbose");
    }
    argv.push_back(nullptr);
    pid_t pid = -1;
    const int rc =
        ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr,
                      const_cast<char* const*>(argv.data()), envp.data());
    if (rc != 0) {
      std::fprintf(stderr, "collectives_bench: spawn: %s\n", std::strerror(rc));
      std::exit(1);
    }
    pids.push_back(pid);
  }
  // A rank that fails ends its group: the others fail too (the watchdog, or
  // Gloo's timeout), so waiting for all of them is bounded.
  bool failed = false;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed = failed || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (failed) {
    std::fprintf(stderr, "collectives_bench: a rank of phase %s failed\n",
                 p.name.c_str());
    std::exit(1);
  }
  store::TCPStoreOptions so;
  so.port = flags.storePort;
  store::PrefixStore st(p.name, std::make_shared<store::TCPStore>(so));
  std::string all;
  for (int r = 0; r < p.world; ++r) {
    all += st.getString("result/" + std::to_string(r));
  }
  return all;
}

void addPhase(const Phase& p) {
  if (!flags.only.empty() &&
      flags.only.find("," + p.name + ",") == std::string::npos) {
    return;
  }
  const auto t0 = Clock::now();
  std::istringstream lines(runPhase(p));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("! ", 0) == 0) {
      bench::note(line.substr(2));
      continue;
    }
    std::istringstream f(line);
    std::string metric;
    std::string unit;
    double value = 0;
    if (!(f >> metric >> value >> unit)) {
      continue;
    }
    std::string baseline;
    if (metric.rfind("trellis_ring_uv_", 0) == 0) {
      baseline = "uv_throughput_64MiB";
    } else if (metric.rfind("trellis_", 0) == 0) {
      baseline = "gloo_" + metric.substr(8);
    }
    report.add(metric, value, unit, baseline);
  }
  bench::note(
      p.name + ": " +
      std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) +
      " s");
}

// A target of the issue, printed with its verdict; never fails the program.
void target(bool json, const std::string& what, double ratio, bool ok) {
  char line[256];
  std::snprintf(line, sizeof(line), "target %s: %.2f %s", what.c_str(), ratio,
                ratio > 0 ? (ok ? "✔" : "✘") : "(not measured)");
  if (json) {
    bench::note(line);
  } else {
    std::printf("%s\n", line);
  }
}

double ratio(const std::string& a, const std::string& b) {
  const double vb = report.valueOf(b);
  return vb > 0 ? report.valueOf(a) / vb : 0;
}

int runMain() {
  const auto t0 = Clock::now();
  store::TCPStoreServer server;
  flags.storePort = server.port();
  memcpyBaseline();
  uvBaseline();
  // The default phases run with the defaults, whatever the caller's shell
  // says; the forced one sets both knobs.
  const std::vector<std::pair<std::string, std::string>> defaults = {
      {"TRELLIS_COLLECTIVES_ALGO", ""},
      {"TRELLIS_TRANSPORTS", ""},
      {"TRELLIS_CHANNELS", ""}};
  // Gloo first at each size, so that each Trellis row follows its baseline.
  for (int n : {2, 4}) {
    const std::string r = std::to_string(n) + "r";
    addPhase({"gloo_" + r, n, defaults});
    addPhase({"trellis_" + r, n, defaults});
  }
  addPhase({"trellis_ring_uv_2r",
            2,
            {{"TRELLIS_COLLECTIVES_ALGO", "ring"},
             {"TRELLIS_TRANSPORTS", "uv"},
             {"TRELLIS_CHANNELS", "basic"}}});
  // Which of Gloo's two allreduces is faster changes from run to run on
  // this VM: the targets are held to the better one of this run.
  for (int n : {2, 4}) {
    const std::string r = std::to_string(n) + "r";
    const std::string bw = "allreduce_64MiB_busbw_" + r;
    const std::string lat = "allreduce_8B_median_" + r;
    if (report.valueOf("trellis_" + bw) > 0) {
      report.add(
          "gloo_best_" + bw,
          std::max(report.valueOf("gloo_" + bw),
                   report.valueOf("gloo_allreduce_api_64MiB_busbw_" + r)),
          "GB/s");
      report.add("trellis_" + bw + "_vs_best", report.valueOf("trellis_" + bw),
                 "GB/s", "gloo_best_" + bw);
      report.add("gloo_best_" + lat,
                 std::min(report.valueOf("gloo_" + lat),
                          report.valueOf("gloo_allreduce_api_8B_median_" + r)),
                 "us");
      report.add("trellis_" + lat + "_vs_best",
                 report.valueOf("trellis_" + lat), "us", "gloo_best_" + lat);
    }
  }
  if (report.valueOf("trellis_ring_uv_allreduce_64MiB_busbw_2r") > 0) {
    // The ring against what loopback carries both ways at once: the limit
    // this machine puts on it (the target's one-way figure is not).
    report.add("trellis_ring_uv_allreduce_64MiB_busbw_2r_vs_both_ways",
               report.valueOf("trellis_ring_uv_allreduce_64MiB_busbw_2r"),
               "GB/s", "uv_both_ways_64MiB");
    report.add("trellis_ring_uv_allreduce_64MiB_busbw_2r_vs_2proc",
               report.valueOf("trellis_ring_uv_allreduce_64MiB_busbw_2r"),
               "GB/s", "uv_both_ways_2proc_64MiB");
  }
  report.print(flags.json);
  const double big = ratio("trellis_allreduce_64MiB_busbw_2r",
                           "gloo_best_allreduce_64MiB_busbw_2r");
  target(flags.json, "allreduce 64MiB busbw 2r / Gloo's best >= 3", big,
         big >= 3);
  const double lat = ratio("trellis_allreduce_8B_median_2r",
                           "gloo_best_allreduce_8B_median_2r");
  target(flags.json,
         "allreduce 8B median latency 2r / Gloo's best <= 0.5 (lower is "
         "better)",
         lat, lat <= 0.5);
  const double ring =
      ratio("trellis_ring_uv_allreduce_64MiB_busbw_2r", "uv_throughput_64MiB");
  target(flags.json, "forced ring over uv, allreduce 64MiB busbw / uv >= 0.9",
         ring, ring >= 0.9);
  bench::note(
      "total " +
      std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) +
      " s");
  return 0;
}

[[noreturn]] void usage(const char* self) {
  std::fprintf(stderr,
               "usage: %s [--json] [--quick] [--verbose] [--only PHASE,...]\n"
               "  --quick    fewer iterations (a fast pass; noisier figures)\n"
               "  --verbose  each figure on stderr as it is measured\n"
               "  --only     some phases: gloo_2r trellis_2r gloo_4r "
               "trellis_4r\n"
               "             trellis_ring_uv_2r\n",
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
    } else if (a == "--quick") {
      flags.quick = true;
    } else if (a == "--verbose") {
      flags.verbose = true;
    } else if (a == "--only" && hasValue) {
      flags.only = "," + std::string(argv[++i]) + ",";
    } else if (a == "--role" && hasValue) {
      flags.worker = std::strcmp(argv[++i], "worker") == 0;
    } else if (a == "--rank" && hasValue) {
      flags.rank = static_cast<int>(bench::flagValue(
          "collectives_bench", "--rank", argv[++i], 0, 1 << 16));
    } else if (a == "--world" && hasValue) {
      flags.world = static_cast<int>(bench::flagValue(
          "collectives_bench", "--world", argv[++i], 1, 1 << 16));
    } else if (a == "--store-port" && hasValue) {
      flags.storePort = static_cast<uint16_t>(bench::flagValue(
          "collectives_bench", "--store-port", argv[++i], 1, 65535));
    } else if (a == "--phase" && hasValue) {
      flags.phase = argv[++i];
    } else {
      usage(argv[0]);
    }
  }
  try {
    return flags.worker ? runWorker() : runMain();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_bench (%s): %s\n",
                 flags.worker ? ("rank " + std::to_string(flags.rank) + " of " +
                                 flags.phase)
                                    .c_str()
                              : "main",
                 e.what());
    return 1;
  }
}
