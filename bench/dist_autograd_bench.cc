// Distributed-autograd benchmark: one training iteration (forward, backward,
// optimizer step) split over two processes by RPC, against the same model
// trained in one process with torch autograd and torch::optim, measured in
// the same run. `--json` prints one JSON object per line (DESIGN.md,
// "Benchmarks").
//
// The program re-executes itself as the server (`--role ps`, so no thread
// state is inherited); both rendezvous through a TCPStore the trainer
// serves. The ps owns a sum-mode EmbeddingBag (sparse gradients) and a dense
// layer (Linear + ReLU) behind an RRef; the trainer owns a Linear head. A
// distributed iteration is
//
//   Context ctx;
//   h = ps.rpcSync<&BenchPs::forward>(ids, offsets);   // table + dense on ps
//   loss = bce(head(h), labels);                         // local
//   ctx.backward({loss});                                // both workers
//   opt.step(ctx);                                  // both workers
//   ~Context                                             // release
//
// and the local one is the same model in one process: forward, backward()
// into .grad, torch::optim::Adagrad step. A third process (--role floor)
// runs the ps's half behind a bare UNIX socket (FloorRun): the cost of the
// split on this machine without Trellis, once with the ps's step riding on
// the gradient and once with the DistributedOptimizer's shape (the step
// after the backward, `*_floor_step_after_*`). A fourth (--floor-handoff)
// runs that shape with a thread on each side that reads the socket and
// hands each message to the computing thread (HandoffReader), as an RPC
// agent's loop does: `*_floor_handoff_*`, the floor under any RPC system
// that runs functions off its I/O thread. All use one intra-op thread and
// one OpenMP/MKL/OpenBLAS thread (oneMathThreadPerProcess) and
// keep freed memory (see keepMemory). Three model sizes: "tiny" (a few
// numbers per tensor: the fixed cost of a distributed iteration), "ps" (the
// shapes of examples/parameter_server.cc) and "large". Besides times, the
// trainer's context switches per iteration, and the forward call alone
// outside any context and in a context of its own, say where the time goes
// (docs/benchmarks.md, "Distributed autograd").

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <malloc.h>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <spawn.h>
#include <stdexcept>
#include <string>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <torch/torch.h>

#include "bench_util.h"
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/profiler.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>

extern char** environ;

using namespace std::chrono_literals;
using namespace trellis;
using Clock = std::chrono::steady_clock;
namespace rpc = trellis::rpc;
namespace da = trellis::dist_autograd;

// ---- the server's half of the model (registered in both processes) ---------

class BenchPs {
 public:
  BenchPs(int64_t rows, int64_t dim, int64_t hidden, int64_t seed)
      : table_(nullptr), dense_(nullptr) {
    torch::manual_seed(static_cast<uint64_t>(seed));
    table_ = torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(rows, dim)
                                         .mode(torch::kSum)
                                         .sparse(true));
    dense_ = torch::nn::Linear(dim, hidden);
  }

  // relu(dense(sum of each bag's rows)): [bags, hidden].
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& offsets) {
    return torch::relu(dense_(table_(ids, offsets)));
  }

  std::vector<at::Tensor> parameterTensors() {
    std::vector<at::Tensor> out = {table_->weight};
    for (const auto& p : dense_->parameters()) {
      out.push_back(p);
    }
    return out;
  }

  // RRefs to this worker's parameters, for a DistributedOptimizer.
  std::vector<rpc::RRef<at::Tensor>> parameters() {
    return da::localParameters(parameterTensors());
  }

  // From now on this worker steps its parameters inside each backward
  // pass that reaches them (Adagrad at `lr`), not through a
  // DistributedOptimizer.
  void stepInBackward(double lr) {
    inBackward_ = std::make_unique<da::OptimizerInBackward>(
        da::Adagrad{.lr = lr}, parameterTensors());
  }

 private:
  torch::nn::EmbeddingBag table_;
  torch::nn::Linear dense_;
  std::unique_ptr<da::OptimizerInBackward> inBackward_;
};

std::shared_ptr<BenchPs> makeBenchPs(int64_t rows, int64_t dim, int64_t hidden,
                                     int64_t seed) {
  return std::make_shared<BenchPs>(rows, dim, hidden, seed);
}

// The same, stepping its parameters inside the backward at `lr`.
std::shared_ptr<BenchPs> makeSteppingBenchPs(int64_t rows, int64_t dim,
                                             int64_t hidden, int64_t seed,
                                             double lr) {
  auto ps = std::make_shared<BenchPs>(rows, dim, hidden, seed);
  ps->stepInBackward(lr);
  return ps;
}

void benchNoop() {}

TRELLIS_REMOTE_FUNCTION(makeBenchPs);
TRELLIS_REMOTE_FUNCTION(makeSteppingBenchPs);
TRELLIS_REMOTE_FUNCTION(benchNoop);
TRELLIS_REMOTE_METHODS(BenchPs, forward, parameters);

namespace {

// One thread per math library in this process and every process it
// starts: OpenMP's, MKL's and OpenBLAS's pools read their sizes from the
// environment when they load, before main() runs, so this sets the three
// variables to "1" where they are unset and re-executes the program once
// (argv unchanged). A value set by the caller is kept. What it avoids:
// torch::set_num_threads(1) sizes ATen's pool only, and Debian's libtorch
// calls the pthread build of OpenBLAS, whose own workers (one per core
// but one) share the larger sgemms and spin on sched_yield after each,
// taking the CPU that the process's other threads and its peers need on a
// 2-core machine (docs/benchmarks.md, "Distributed autograd"). elastic-run
// gives its workers OMP_NUM_THREADS=1 for the same reason, and OpenBLAS reads
// that too.
void oneMathThreadPerProcess(char** argv) {
  bool changed = false;
  for (const char* name :
       {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
    if (std::getenv(name) == nullptr) {
      ::setenv(name, "1", 1);
      changed = true;
    }
  }
  if (changed) {
    ::execv("/proc/self/exe", argv);
    std::perror("oneMathThreadPerProcess: execv /proc/self/exe");
    std::exit(1);
  }
}

constexpr auto kWait = std::chrono::seconds(120);
constexpr int kBatches = 32;  // pre-drawn, used round robin
constexpr double kLr = 0.05;

struct Flags {
  bool json = false;
  bool defaultMalloc = false;
  int iters = 2000;              // tiny model; the others run a fraction of it
  std::string role = "trainer";  // --role: trainer, ps or floor
  int floorFd = -1;              // --role floor: the socket to the trainer
  bool floorHandoff = false;     // --role floor: read through a HandoffReader
  uint16_t storePort = 0;
  std::string trace;  // --trace DIR: traces of a few iterations
};
Flags flags;

bench::Report report("dist_autograd");

// The trainer's ends of the sockets to the --role floor processes: the
// plain one and the one with hand-offs (--floor-handoff).
int gFloorFd = -1;
int gHandoffFloorFd = -1;

// Sends the parts as one message: one sendmsg() where the socket takes it
// all, as the RPC layer writes a message at once (the rest, if any, after).
void sendParts(int fd,
               std::initializer_list<std::pair<const void*, size_t>> parts) {
  std::vector<iovec> iov;
  for (const auto& [data, n] : parts) {
    iov.push_back({const_cast<void*>(data), n});
  }
  msghdr mh{};
  mh.msg_iov = iov.data();
  mh.msg_iovlen = iov.size();
  ssize_t sent = ::sendmsg(fd, &mh, MSG_NOSIGNAL);
  if (sent < 0) {
    std::perror("sendmsg");
    std::exit(1);
  }
  for (const auto& [data, n] : parts) {
    const size_t skip = std::min(static_cast<size_t>(sent), n);
    bench::sendAll(fd, static_cast<const char*>(data) + skip, n - skip);
    sent -= static_cast<ssize_t>(skip);
  }
}

// Reads a socket on a thread of its own and hands the bytes to the thread
// that asks for them (a mutex and a condition variable): one thread wake-up
// more per message on the receiving side, as an RPC agent's loop thread
// adds between the connection and the thread that runs the function or
// waits for the reply. The floor with hand-offs has one on each side, and
// so passes each message through two threads there as RPC does (the
// reader blocks in recv() and never polls).
class HandoffReader {
 public:
  explicit HandoffReader(int fd) : fd_(fd), thread_([this] { run(); }) {}
  HandoffReader(const HandoffReader&) = delete;
  HandoffReader& operator=(const HandoffReader&) = delete;
  // Shuts the socket's read side, which ends the reading thread.
  ~HandoffReader() {
    ::shutdown(fd_, SHUT_RD);
    thread_.join();
  }

  // The next `n` bytes into `data`, as recv(MSG_WAITALL) reads them: all
  // of them, or what came before the stream ended (0 at its end). Woken
  // once, when all of them are here.
  size_t read(void* data, size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    want_ = n;
    cv_.wait(lock, [&] { return buffered() >= n || eof_; });
    want_ = 0;
    const size_t got = std::min(n, buffered());
    std::memcpy(data, buf_.data() + head_, got);
    head_ += got;
    if (head_ == buf_.size()) {
      buf_.clear();
      head_ = 0;
    }
    return got;
  }

  void readAll(void* data, size_t n) {
    if (read(data, n) != n) {
      std::fprintf(stderr, "dist_autograd_bench: the floor's socket closed\n");
      std::exit(1);
    }
  }

 private:
  size_t buffered() const { return buf_.size() - head_; }

  void run() {
    std::vector<char> chunk(size_t{1} << 16);
    for (;;) {
      const ssize_t r = ::recv(fd_, chunk.data(), chunk.size(), 0);
      bool wake = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (r <= 0) {
          eof_ = true;
          wake = true;
        } else {
          buf_.insert(buf_.end(), chunk.data(), chunk.data() + r);
          wake = want_ != 0 && buffered() >= want_;
        }
      }
      if (wake) {
        cv_.notify_one();  // outside the lock, as ThreadPool::post does
      }
      if (r <= 0) {
        return;
      }
    }
  }

  int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> buf_;  // guarded by mu_, from head_ on
  size_t head_ = 0;
  size_t want_ = 0;  // what the waiting reader needs (0: none waits)
  bool eof_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// The trainer's reader of gHandoffFloorFd.
std::unique_ptr<HandoffReader> gHandoffIn;

// `n` bytes from `fd`, through `in` when there is one (both ends of the
// floors read this way).
void recvFloor(int fd, HandoffReader* in, void* data, size_t n) {
  if (in != nullptr) {
    in->readAll(data, n);
  } else {
    bench::recvAll(fd, data, n);
  }
}

struct ModelSize {
  std::string name;
  int64_t rows, dim, hidden, bags, maxBag;
  int iters;  // timed iterations per variant
};

struct Batch {
  at::Tensor ids, offsets, labels;
};

std::vector<Batch> drawBatches(const ModelSize& m, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int64_t> row(0, m.rows - 1);
  std::uniform_int_distribution<int64_t> len(1, m.maxBag);
  std::bernoulli_distribution label(0.5);
  std::vector<Batch> out;
  for (int k = 0; k < kBatches; ++k) {
    std::vector<int64_t> ids, offsets;
    std::vector<float> labels;
    for (int64_t b = 0; b < m.bags; ++b) {
      offsets.push_back(static_cast<int64_t>(ids.size()));
      for (int64_t i = len(g); i > 0; --i) {
        ids.push_back(row(g));
      }
      labels.push_back(label(g) ? 1.0f : 0.0f);
    }
    out.push_back({torch::tensor(ids, torch::kInt64),
                   torch::tensor(offsets, torch::kInt64),
                   torch::tensor(labels, torch::kFloat32)});
  }
  return out;
}

double micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

// Context switches of this whole process so far. Voluntary ones are threads
// that slept and were woken (about 20 us each here, DESIGN.md); involuntary
// ones are threads preempted, by other processes when the machine is busy.
struct Switches {
  double voluntary = 0, involuntary = 0;
  static Switches now() {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return {static_cast<double>(u.ru_nvcsw), static_cast<double>(u.ru_nivcsw)};
  }
  void addSince(const Switches& start) {
    const Switches end = now();
    voluntary += end.voluntary - start.voluntary;
    involuntary += end.involuntary - start.involuntary;
  }
};

// Per-iteration times and the split of each iteration into its phases.
struct Samples {
  std::vector<double> iter, forward, backward, step, release;

  // An iteration whose forward ran in [t0, t1), backward in [t1, t2) and
  // optimizer step in [t2, t3).
  void addPhases(Clock::time_point t0, Clock::time_point t1,
                 Clock::time_point t2, Clock::time_point t3) {
    iter.push_back(micros(t3 - t0));
    forward.push_back(micros(t1 - t0));
    backward.push_back(micros(t2 - t1));
    step.push_back(micros(t3 - t2));
  }
  // Context switches of this process over all iterations.
  Switches switches;
};

void addSamples(const std::string& pre, const Samples& s,
                const std::string& basePre) {
  auto base = [&](const std::string& suffix) {
    return basePre.empty() ? std::string() : basePre + suffix;
  };
  report.add(pre + "_iter_median", bench::percentile(s.iter, 0.5), "us",
             base("_iter_median"));
  report.add(pre + "_iter_p99", bench::percentile(s.iter, 0.99), "us",
             base("_iter_p99"));
  report.add(pre + "_forward_median", bench::percentile(s.forward, 0.5), "us",
             base("_forward_median"));
  report.add(pre + "_backward_median", bench::percentile(s.backward, 0.5), "us",
             base("_backward_median"));
  report.add(pre + "_step_median", bench::percentile(s.step, 0.5), "us",
             base("_step_median"));
  if (!s.release.empty()) {
    report.add(pre + "_release_median", bench::percentile(s.release, 0.5),
               "us");
  }
  const auto n = static_cast<double>(s.iter.size());
  report.add(pre + "_wakeups_per_iter", s.switches.voluntary / n, "1");
  report.add(pre + "_preemptions_per_iter", s.switches.involuntary / n, "1");
}

torch::nn::Linear makeHead(int64_t hidden, int64_t seed) {
  torch::manual_seed(static_cast<uint64_t>(seed) + 1);
  return torch::nn::Linear(hidden, 1);
}

// The whole model in this process.
class LocalRun {
 public:
  explicit LocalRun(const ModelSize& m)
      : ps_(m.rows, m.dim, m.hidden, 7), head_(makeHead(m.hidden, 7)) {
    auto params = ps_.parameterTensors();
    for (const auto& p : head_->parameters()) {
      params.push_back(p);
    }
    params_ = params;
    optim_ = std::make_unique<torch::optim::Adagrad>(
        params, torch::optim::AdagradOptions(kLr));
  }

  void iteration(const Batch& b, Samples* s) {
    const auto t0 = Clock::now();
    auto h = ps_.forward(b.ids, b.offsets);
    auto loss =
        torch::binary_cross_entropy_with_logits(head_(h).squeeze(1), b.labels);
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    optim_->step();
    // Fresh gradients every iteration, as a distributed context has.
    for (auto& p : params_) {
      p.mutable_grad() = at::Tensor();
    }
    const auto t3 = Clock::now();
    if (s != nullptr) {
      s->addPhases(t0, t1, t2, t3);
    }
  }

 private:
  BenchPs ps_;
  torch::nn::Linear head_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::Adagrad> optim_;
};

// The floor under any two-process split of this model on this machine: the
// ps's half runs in another process (--role floor), with nothing between
// the two but a UNIX stream socket: the ids and offsets go there, the
// dense output comes back, its gradient goes there, and a byte says that
// the ps's backward and Adagrad step are done, while the trainer steps its
// head. Same work and the same four messages as a distributed iteration
// (the release aside), no RPC, RRef or distributed autograd.
//
// An iteration with `stepAfter` has the shape of the DistributedOptimizer
// program instead: a byte says that the ps's backward is done (ctx.backward()
// returns), then the trainer sends a byte that starts the ps's step and
// steps its head while waiting for the byte that ends it (step(ctx)). The
// same work, six messages: what any implementation of that program costs
// on this machine, Trellis's or not.
//
// With `in`, what comes back is read through a HandoffReader, and the
// other side is a --floor-handoff process: the floor with hand-offs. The
// first message goes in one sendmsg() (sendParts), as RPC writes one.
class FloorRun {
 public:
  FloorRun(const ModelSize& m, int fd, HandoffReader* in = nullptr)
      : fd_(fd), in_(in), hidden_(m.hidden), head_(makeHead(m.hidden, 7)) {
    // {rows, dim, hidden, seed}: the other side builds its half.
    const int64_t init[4] = {m.rows, m.dim, m.hidden, 7};
    bench::sendAll(fd_, init, sizeof init);
    char ready = 0;
    recv(&ready, 1);
    optim_ = std::make_unique<torch::optim::Adagrad>(
        head_->parameters(), torch::optim::AdagradOptions(kLr));
  }
  // Sizes {-1, -1, 0}: this model is done; the other side waits for the
  // next.
  ~FloorRun() {
    const int64_t end[3] = {-1, -1, 0};
    bench::sendAll(fd_, end, sizeof end);
  }
  FloorRun(const FloorRun&) = delete;
  FloorRun& operator=(const FloorRun&) = delete;

  void iteration(const Batch& b, bool stepAfter, Samples* s) {
    const auto t0 = Clock::now();
    const int64_t sizes[3] = {b.ids.numel(), b.offsets.numel(),
                              stepAfter ? 1 : 0};
    sendParts(fd_, {{sizes, sizeof sizes},
                    {b.ids.data_ptr<int64_t>(),
                     static_cast<size_t>(sizes[0]) * sizeof(int64_t)},
                    {b.offsets.data_ptr<int64_t>(),
                     static_cast<size_t>(sizes[1]) * sizeof(int64_t)}});
    auto h = torch::empty({sizes[1], hidden_}, torch::kFloat32);
    recv(h.data_ptr<float>(), h.nbytes());
    h.requires_grad_(true);
    auto loss =
        torch::binary_cross_entropy_with_logits(head_(h).squeeze(1), b.labels);
    const auto t1 = Clock::now();
    loss.backward();
    bench::sendAll(fd_, h.grad().data_ptr<float>(), h.grad().nbytes());
    char done = 0;
    if (stepAfter) {
      recv(&done, 1);  // the ps's backward is done
    }
    const auto t2 = Clock::now();
    if (stepAfter) {
      const char step = 1;
      bench::sendAll(fd_, &step, 1);
    }
    optim_->step();
    for (auto& p : head_->parameters()) {
      p.mutable_grad() = at::Tensor();
    }
    recv(&done, 1);
    const auto t3 = Clock::now();
    if (s != nullptr) {
      s->addPhases(t0, t1, t2, t3);
    }
  }

 private:
  void recv(void* data, size_t n) { recvFloor(fd_, in_, data, n); }

  int fd_;
  HandoffReader* in_;
  int64_t hidden_;
  torch::nn::Linear head_;
  std::unique_ptr<torch::optim::Adagrad> optim_;
};

// The same model with the table and dense layer on the ps. With
// `inBackward` the ps steps them inside the backward (OptimizerInBackward)
// and the DistributedOptimizer holds the head only.
class DistRun {
 public:
  DistRun(const ModelSize& m, bool inBackward)
      : ps_(inBackward ? rpc::remote<makeSteppingBenchPs>(
                             "ps", m.rows, m.dim, m.hidden, int64_t{7}, kLr)
                       : rpc::remote<makeBenchPs>("ps", m.rows, m.dim, m.hidden,
                                                  int64_t{7})),
        head_(makeHead(m.hidden, 7)) {
    std::vector<rpc::RRef<at::Tensor>> params;
    if (!inBackward) {
      params = ps_.rpcSync<&BenchPs::parameters>();
    }
    for (auto& r : da::localParameters(head_->parameters())) {
      params.push_back(std::move(r));
    }
    opt_ = std::make_unique<da::DistributedOptimizer>(da::Adagrad{.lr = kLr},
                                                      std::move(params), kWait);
  }

  // The forward call alone, outside any context: what the RPC costs
  // without distributed autograd's bookkeeping.
  double plainForward(const Batch& b) {
    const auto t0 = Clock::now();
    auto h = ps_.rpcSync<&BenchPs::forward>(b.ids, b.offsets);
    return micros(Clock::now() - t0);
  }

  // The forward call alone inside a fresh context (released after, with
  // no backward): the bookkeeping without the rest of an iteration.
  double contextForward(const Batch& b) {
    da::Context ctx;
    const auto t0 = Clock::now();
    auto h = ps_.rpcSync<&BenchPs::forward>(b.ids, b.offsets);
    return micros(Clock::now() - t0);
  }

  void iteration(const Batch& b, Samples* s) {
    const auto t0 = Clock::now();
    Clock::time_point t1, t2, t3;
    {
      da::Context ctx;
      auto h = ps_.rpcSync<&BenchPs::forward>(b.ids, b.offsets);
      auto loss = torch::binary_cross_entropy_with_logits(head_(h).squeeze(1),
                                                          b.labels);
      t1 = Clock::now();
      ctx.backward({loss});
      t2 = Clock::now();
      opt_->step(ctx);
      t3 = Clock::now();
    }
    const auto t4 = Clock::now();
    if (s != nullptr) {
      s->iter.push_back(micros(t4 - t0));
      s->forward.push_back(micros(t1 - t0));
      s->backward.push_back(micros(t2 - t1));
      s->step.push_back(micros(t3 - t2));
      s->release.push_back(micros(t4 - t3));
    }
  }

 private:
  rpc::RRef<BenchPs> ps_;
  torch::nn::Linear head_;
  std::unique_ptr<da::DistributedOptimizer> opt_;
};

// Alternates blocks of local and distributed iterations so that a change in
// the machine's load hits both about equally.
void runModel(const ModelSize& m) {
  const auto batches = drawBatches(m, 42);
  LocalRun local(m);
  DistRun dist(m, /*inBackward=*/false);
  DistRun stepping(m, /*inBackward=*/true);
  FloorRun floor(m, gFloorFd);
  FloorRun handoffFloor(m, gHandoffFloorFd, gHandoffIn.get());
  const int warmup = std::max(5, m.iters / 10);
  for (int i = 0; i < warmup; ++i) {
    local.iteration(batches[i % kBatches], nullptr);
    dist.iteration(batches[i % kBatches], nullptr);
    stepping.iteration(batches[i % kBatches], nullptr);
    floor.iteration(batches[i % kBatches], /*stepAfter=*/false, nullptr);
    floor.iteration(batches[i % kBatches], /*stepAfter=*/true, nullptr);
    handoffFloor.iteration(batches[i % kBatches], /*stepAfter=*/true, nullptr);
  }
  Samples ls, ds, is, fs, as, hs;
  std::map<std::string, double> distWakeups;  // per thread, all dist blocks
  std::vector<double> plain, inContext;
  constexpr int kBlocks = 4;
  int next = 0;
  for (int block = 0; block < kBlocks; ++block) {
    const int n = m.iters / kBlocks;
    // n iterations of `one(batch, samples)` into `s`, with the process's
    // context switches over them.
    auto timedBlock = [&](Samples& s, const auto& one) {
      const auto c0 = Switches::now();
      for (int i = 0; i < n; ++i) {
        one(batches[(next + i) % kBatches], &s);
      }
      s.switches.addSince(c0);
    };
    timedBlock(ls, [&](const Batch& b, Samples* s) { local.iteration(b, s); });
    const auto c0 = Switches::now();
    const auto byThread = bench::switchesByThread(/*voluntaryOnly=*/true);
    for (int i = 0; i < n; ++i) {
      dist.iteration(batches[(next + i) % kBatches], &ds);
    }
    ds.switches.addSince(c0);
    for (const auto& [name, count] :
         bench::switchesSince(byThread, /*voluntaryOnly=*/true)) {
      distWakeups[name] += count;
    }
    timedBlock(is,
               [&](const Batch& b, Samples* s) { stepping.iteration(b, s); });
    timedBlock(fs, [&](const Batch& b, Samples* s) {
      floor.iteration(b, /*stepAfter=*/false, s);
    });
    timedBlock(as, [&](const Batch& b, Samples* s) {
      floor.iteration(b, /*stepAfter=*/true, s);
    });
    timedBlock(hs, [&](const Batch& b, Samples* s) {
      handoffFloor.iteration(b, /*stepAfter=*/true, s);
    });
    for (int i = 0; i < n; ++i) {
      plain.push_back(dist.plainForward(batches[(next + i) % kBatches]));
    }
    for (int i = 0; i < n; ++i) {
      inContext.push_back(dist.contextForward(batches[(next + i) % kBatches]));
    }
    next += n;
  }
  bench::note(
      m.name + " dist: trainer wake-ups per iteration by thread:" +
      bench::perCallByThread(distWakeups, static_cast<double>(ds.iter.size())));
  addSamples(m.name + "_local", ls, "");
  addSamples(m.name + "_dist", ds, m.name + "_local");
  addSamples(m.name + "_dist_in_backward", is, m.name + "_local");
  addSamples(m.name + "_floor", fs, m.name + "_local");
  addSamples(m.name + "_floor_step_after", as, m.name + "_local");
  addSamples(m.name + "_floor_handoff", hs, m.name + "_local");
  // <m>_<run>_iter_median_vs_<floor>: a run's median over a floor's.
  auto overFloor = [&](const std::string& run, const std::string& floorName) {
    report.add(m.name + "_" + run + "_iter_median_vs_" + floorName,
               report.valueOf(m.name + "_" + run + "_iter_median"), "us",
               m.name + "_" + floorName + "_iter_median");
  };
  overFloor("dist_in_backward", "floor");
  overFloor("dist", "floor");
  overFloor("dist", "floor_step_after");
  overFloor("dist", "floor_handoff");
  report.add(m.name + "_rpc_forward_no_context_median",
             bench::percentile(plain, 0.5), "us",
             m.name + "_dist_forward_median");
  report.add(m.name + "_rpc_forward_own_context_median",
             bench::percentile(inContext, 0.5), "us",
             m.name + "_rpc_forward_no_context_median");
}

using bench::note;

// --trace DIR: 40 iterations of model `m` under an rpc::Profiler, written
// as a Chrome trace to DIR/<model>.json (both processes' sides of every call:
// the forward, the backward's gradient message, the optimizer step). stderr
// gets, per call, the medians of: the trainer's time before it (since the
// previous reply or the iteration's start), the request's way (send to the
// function's start on the ps), the function's run, and the reply's way back;
// and of the trainer's time after the last reply (the context's release).
void traceIterations(const ModelSize& m) {
  constexpr int kIters = 40;
  const auto batches = drawBatches(m, 43);
  DistRun dist(m, /*inBackward=*/false);
  for (int i = 0; i < 20; ++i) {
    dist.iteration(batches[i % kBatches], nullptr);
  }
  rpc::Profiler prof;
  std::vector<int64_t> starts;
  for (int i = 0; i < kIters; ++i) {
    starts.push_back(rpc::profilerNowUs());
    dist.iteration(batches[i % kBatches], nullptr);
  }
  starts.push_back(rpc::profilerNowUs());
  const std::string file = flags.trace + "/" + m.name + ".json";
  prof.exportChromeTrace(file);
  auto events = prof.events();
  std::sort(events.begin(), events.end(),
            [](const auto& a, const auto& b) { return a.startUs < b.startUs; });
  struct Stage {
    std::vector<double> before, request, run, reply;
  };
  std::map<std::string, Stage> stages;  // by the function's name
  std::vector<std::string> order;       // of the calls in an iteration
  std::vector<double> after;
  for (int i = 0; i < kIters; ++i) {
    int64_t last = starts[i];
    for (const auto& call : events) {
      if (call.worker != "trainer" || call.startUs < starts[i] ||
          call.startUs >= starts[i + 1] || call.name.rfind("rpc#", 0) != 0) {
        continue;
      }
      const int64_t callEnd = call.startUs + call.durationUs;
      // "rpc#<function> trainer -> ps" ran as "<function>" on the ps.
      const std::string fn = call.name.substr(4, call.name.find(' ') - 4);
      const auto run = std::find_if(events.begin(), events.end(), [&](auto& e) {
        return e.worker == "ps" && e.name == fn && e.startUs >= call.startUs &&
               e.startUs <= callEnd;
      });
      if (run == events.end()) {
        continue;
      }
      if (i == 0) {
        order.push_back(fn);
      }
      Stage& st = stages[fn];
      st.before.push_back(static_cast<double>(call.startUs - last));
      st.request.push_back(static_cast<double>(run->startUs - call.startUs));
      st.run.push_back(static_cast<double>(run->durationUs));
      st.reply.push_back(
          static_cast<double>(callEnd - run->startUs - run->durationUs));
      last = callEnd;
    }
    after.push_back(static_cast<double>(starts[i + 1] - last));
  }
  auto med = [](const std::vector<double>& v) {
    return std::to_string(std::lround(bench::percentile(v, 0.5)));
  };
  for (const auto& fn : order) {
    const Stage& st = stages[fn];
    note("trace " + m.name + ", medians of " + std::to_string(st.run.size()) +
         " calls of " + fn + ": trainer before it " + med(st.before) +
         " us, request " + med(st.request) + " us, run on the ps " +
         med(st.run) + " us, reply " + med(st.reply) + " us");
  }
  note("trace " + m.name + ": trainer after the last reply " + med(after) +
       " us; Chrome trace in " + file);
}

std::shared_ptr<store::Store> connectStore() {
  store::TCPStoreOptions o;
  o.port = flags.storePort;
  o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kWait);
  return std::make_shared<store::PrefixStore>(
      "dist-autograd-bench", std::make_shared<store::TCPStore>(o));
}

rpc::RpcOptions rpcOptions(std::shared_ptr<store::Store> st) {
  rpc::RpcOptions o;
  o.store = std::move(st);
  o.localAddress = "127.0.0.1";
  o.initTimeout = kWait;
  return o;
}

// Keeps freed memory in the process: glibc would otherwise return the
// large blocks of every iteration to the kernel and fault them in again at
// about 0.4 GB/s (DESIGN.md), which then dominates the local baseline.
// --default-malloc measures with glibc's defaults.
void keepMemory() {
  if (!flags.defaultMalloc) {
    ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
}

int runPs() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  keepMemory();
  torch::set_num_threads(1);
  auto st = connectStore();
  rpc::init("ps", 1, 2, rpcOptions(st));
  st->wait({"done"}, std::chrono::milliseconds(600'000));
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
  return 0;
}

// --role floor: the ps's half of FloorRun, one model per {rows, dim, hidden,
// seed} message, until the trainer closes the socket. With --floor-handoff
// a HandoffReader reads the socket and this thread computes.
int runFloor() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  keepMemory();
  torch::set_num_threads(1);
  const int fd = flags.floorFd;
  std::unique_ptr<HandoffReader> in;
  if (flags.floorHandoff) {
    in = std::make_unique<HandoffReader>(fd);
  }
  auto recvAll = [&](void* data, size_t n) {
    recvFloor(fd, in.get(), data, n);
  };
  constexpr int64_t kMaxElements = int64_t{1} << 28;
  for (;;) {
    int64_t init[4];
    const ssize_t r = in != nullptr
                          ? static_cast<ssize_t>(in->read(init, sizeof init))
                          : ::recv(fd, init, sizeof init, MSG_WAITALL);
    if (r == 0) {
      return 0;  // the trainer is done
    }
    if (r != static_cast<ssize_t>(sizeof init) || init[0] <= 0 ||
        init[1] <= 0 || init[2] <= 0 || init[0] > kMaxElements ||
        init[1] > kMaxElements || init[0] * init[1] > kMaxElements) {
      std::fprintf(stderr, "dist_autograd_bench (floor): bad model message\n");
      return 1;
    }
    BenchPs ps(init[0], init[1], init[2], init[3]);
    auto params = ps.parameterTensors();
    torch::optim::Adagrad optim(params, torch::optim::AdagradOptions(kLr));
    const char ready = 1;
    bench::sendAll(fd, &ready, 1);
    for (;;) {
      // {ids, offsets, stepAfter}
      int64_t sizes[3];
      recvAll(sizes, sizeof sizes);
      if (sizes[0] == -1 && sizes[1] == -1) {
        break;  // the next model, or the end
      }
      if (sizes[0] < 0 || sizes[1] <= 0 || sizes[0] > kMaxElements ||
          sizes[1] > kMaxElements || (sizes[2] != 0 && sizes[2] != 1)) {
        std::fprintf(stderr, "dist_autograd_bench (floor): bad sizes\n");
        return 1;
      }
      auto ids = torch::empty({sizes[0]}, torch::kInt64);
      auto offsets = torch::empty({sizes[1]}, torch::kInt64);
      recvAll(ids.data_ptr<int64_t>(), ids.nbytes());
      recvAll(offsets.data_ptr<int64_t>(), offsets.nbytes());
      auto h = ps.forward(ids, offsets);
      const auto out = h.detach().contiguous();
      bench::sendAll(fd, out.data_ptr<float>(), out.nbytes());
      auto grad = torch::empty_like(out);
      recvAll(grad.data_ptr<float>(), grad.nbytes());
      h.backward(grad);
      const char done = 1;
      if (sizes[2] == 1) {             // the DistributedOptimizer's shape
        bench::sendAll(fd, &done, 1);  // backward done
        char step = 0;
        recvAll(&step, 1);
      }
      optim.step();
      for (auto& p : params) {
        p.mutable_grad() = at::Tensor();
      }
      bench::sendAll(fd, &done, 1);
    }
  }
}

// Starts --role floor (with --floor-handoff when `handoff`) on one end of a
// UNIX socket pair (its fd 3); the other end goes to *fd.
pid_t spawnFloor(const char* self, int* fd, bool handoff) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("dist_autograd_bench: socketpair");
    std::exit(1);
  }
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, sv[1], 3);  // clears CLOEXEC
  const pid_t pid =
      bench::spawnSelf("dist_autograd_bench",
                       {self, "--role", "floor", "--floor-fd", "3",
                        handoff ? "--floor-handoff" : nullptr, nullptr},
                       &actions);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(sv[1]);
  *fd = sv[0];
  return pid;
}

pid_t spawnPs(const char* self) {
  const std::string port = std::to_string(flags.storePort);
  return bench::spawnSelf(
      "dist_autograd_bench",
      {self, "--role", "ps", "--store-port", port.c_str(), nullptr});
}

// What one hop to a sleeping thread of another process costs on this
// machine, the unit the trace's request and reply ways are made of: a child
// blocks in read() on a pipe; every 200 us (both sides idle meanwhile) this
// process writes the steady-clock time into it, and the child answers with
// how long after that it woke up. Forked before this process starts any
// thread of its own; the child only reads, writes and exits.
double pipeWakeMedianUs() {
  int toChild[2], toParent[2];
  if (::pipe(toChild) != 0 || ::pipe(toParent) != 0) {
    throw std::runtime_error("pipe failed");
  }
  auto nowNs = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               Clock::now().time_since_epoch())
        .count();
  };
  const pid_t child = ::fork();
  if (child < 0) {
    throw std::runtime_error("fork failed");
  }
  if (child == 0) {
    ::close(toChild[1]);
    ::close(toParent[0]);
    int64_t sent = 0;
    while (::read(toChild[0], &sent, sizeof sent) == sizeof sent) {
      const int64_t woke = nowNs() - sent;
      if (::write(toParent[1], &woke, sizeof woke) != sizeof woke) {
        break;
      }
    }
    ::_exit(0);
  }
  ::close(toChild[0]);
  ::close(toParent[1]);
  std::vector<double> us;
  for (int i = 0; i < 500; ++i) {
    std::this_thread::sleep_for(200us);
    const int64_t sent = nowNs();
    int64_t woke = 0;
    if (::write(toChild[1], &sent, sizeof sent) != sizeof sent ||
        ::read(toParent[0], &woke, sizeof woke) != sizeof woke) {
      break;
    }
    us.push_back(static_cast<double>(woke) / 1000.0);
  }
  ::close(toChild[1]);
  ::close(toParent[0]);
  ::waitpid(child, nullptr, 0);
  if (us.empty()) {
    throw std::runtime_error("the pipe wake-up child did not answer");
  }
  return bench::percentile(us, 0.5);
}

int runTrainer(const char* self) {
  const double pipeWakeUs = pipeWakeMedianUs();
  keepMemory();
  torch::set_num_threads(1);
  store::TCPStoreServer server;
  flags.storePort = server.port();
  const pid_t ps = spawnPs(self);
  const pid_t floorPid = spawnFloor(self, &gFloorFd, /*handoff=*/false);
  const pid_t handoffFloorPid =
      spawnFloor(self, &gHandoffFloorFd, /*handoff=*/true);
  gHandoffIn = std::make_unique<HandoffReader>(gHandoffFloorFd);
  auto st = connectStore();
  const auto t0 = Clock::now();
  rpc::init("trainer", 0, 2, rpcOptions(st));

  // The unit a distributed iteration is made of: one RPC round trip.
  const int rtts = std::max(200, flags.iters);
  for (int i = 0; i < rtts / 10; ++i) {
    rpc::rpcSync<benchNoop>("ps");
  }
  std::vector<double> us;
  Switches noopSwitches;
  const auto c0 = Switches::now();
  for (int i = 0; i < rtts; ++i) {
    const auto t = Clock::now();
    rpc::rpcSync<benchNoop>("ps");
    us.push_back(micros(Clock::now() - t));
  }
  noopSwitches.addSince(c0);
  report.add("pipe_wake_after_idle_median", pipeWakeUs, "us");
  report.add("rpc_noop_rtt_median", bench::percentile(us, 0.5), "us");
  report.add("rpc_noop_wakeups_per_call", noopSwitches.voluntary / rtts, "1");

  const std::vector<ModelSize> models = {
      {"tiny", 16, 4, 4, 2, 2, flags.iters},
      {"ps", 100000, 64, 32, 128, 20, std::max(40, flags.iters / 5)},
      {"large", 100000, 256, 256, 512, 20, std::max(20, flags.iters / 20)},
  };
  for (const auto& m : models) {
    const auto tm = Clock::now();
    runModel(m);
    note(m.name + ": " +
         std::to_string(
             std::chrono::duration<double>(Clock::now() - tm).count()) +
         " s");
    if (m.name == "tiny") {
      // The fixed cost in round trips.
      report.add("tiny_dist_iter_median_in_rtts",
                 report.valueOf("tiny_dist_iter_median"), "us",
                 "rpc_noop_rtt_median");
    }
  }
  if (!flags.trace.empty()) {
    std::filesystem::create_directories(flags.trace);
    traceIterations(models[0]);
    traceIterations(models[1]);
  }
  note("live contexts here after the run: " +
       std::to_string(da::liveContextCount()));
  st->set("done", "1");
  rpc::shutdown({.drainTimeout = std::chrono::seconds(60)});
  const int rc = bench::reapChild("dist_autograd_bench", ps);
  ::close(gFloorFd);  // the floor processes exit on EOF
  gHandoffIn.reset();
  ::close(gHandoffFloorFd);
  const int floorRc = bench::reapChild("dist_autograd_bench", floorPid);
  const int handoffFloorRc =
      bench::reapChild("dist_autograd_bench", handoffFloorPid);
  note(
      "total " +
      std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) +
      " s");
  report.print(flags.json);
  if (rc != 0 || floorRc != 0 || handoffFloorRc != 0) {
    std::fprintf(stderr,
                 "dist_autograd_bench: ps exited with %d, floors with %d and "
                 "%d\n",
                 rc, floorRc, handoffFloorRc);
    return 1;
  }
  return 0;
}

[[noreturn]] void usage(const char* self) {
  std::fprintf(
      stderr,
      "usage: %s [--json] [--iters N] [--default-malloc] [--trace DIR]\n"
      "  --iters N  timed iterations of the tiny model (default "
      "2000); the ps model runs N/5, the large one N/20\n"
      "  --default-malloc  keep glibc's trimming of freed memory\n"
      "  --trace DIR  also run 40 iterations of the tiny and the ps model "
      "under rpc::Profiler: Chrome traces in DIR, per-call medians on "
      "stderr\n",
      self);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  oneMathThreadPerProcess(argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool hasValue = i + 1 < argc;
    if (a == "--json") {
      flags.json = true;
    } else if (a == "--iters" && hasValue) {
      flags.iters = static_cast<int>(bench::flagValue(
          "dist_autograd_bench", "--iters", argv[++i], 100, 10000000));
    } else if (a == "--trace" && hasValue) {
      flags.trace = argv[++i];
    } else if (a == "--floor-handoff") {
      flags.floorHandoff = true;
    } else if (a == "--default-malloc") {
      flags.defaultMalloc = true;
    } else if (a == "--role" && hasValue) {
      flags.role = argv[++i];
    } else if (a == "--floor-fd" && hasValue) {
      flags.floorFd = static_cast<int>(bench::flagValue(
          "dist_autograd_bench", "--floor-fd", argv[++i], 0, 1 << 20));
    } else if (a == "--store-port" && hasValue) {
      flags.storePort = static_cast<uint16_t>(bench::flagValue(
          "dist_autograd_bench", "--store-port", argv[++i], 1, 65535));
    } else {
      usage(argv[0]);
    }
  }
  try {
    if (flags.role == "floor") {
      return runFloor();
    }
    return flags.role == "ps" ? runPs() : runTrainer(argv[0]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_autograd_bench (%s): %s\n", flags.role.c_str(),
                 e.what());
    return 1;
  }
}
