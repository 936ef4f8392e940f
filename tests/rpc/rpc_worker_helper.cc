// A worker process for rpc_process_test.cc. Reads RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT (and TRELLIS_JOB_TOKEN) like any Trellis worker;
// argv[1] picks the scenario. Results go to stdout as one line each, which
// the test reads with a bound; exit 0 means the scenario's own checks
// passed.
//
//   pairs   every worker calls every other one, then graceful shutdown
//   kill    rank 0 calls a sleeping rank 1, which the test SIGKILLs; rank 0
//           reports the error and then calls rank 2
//   rref    owner w0, creator w1, forked to w2; w1 reports w0's live count
//   many    init, one call to the next rank, graceful shutdown
//   serve   rank 0 prints its address and serves; rank 1 calls it once the
//           file argv[2] exists (the test's raw pipes are done by then)
//   leave   3 workers; w2 leaves without shutdown (argv[2] "return": it
//           returns from main, "abort": it aborts). w0 and w1 enter a
//           graceful shutdown with the default options, which must fail
//           at once naming w2 ("shutdown <type> <ms> <what>"; exit 3). w0
//           serves the store: it stays until the file argv[3] exists.
//   stop    3 workers. w0 calls w1 and w2 once ("warm"); once the file
//           argv[2] exists (the test has SIGSTOPped w1 by then) it calls
//           w1 with a 1 s timeout and, while that call is pending, calls
//           w2 again and again: "TimeoutError <what>", "timeout_ms <ms>",
//           "third ok <n> failed <m>". Once the file argv[3] exists (w1
//           has been SIGCONTed) it calls w1 again ("after <sum>") and
//           lets w1 and w2 finish.
//   cuda    2 workers; w0 echoes CUDA tensors through w1 (cuda_ipc between
//           processes) and fetches one by remote() + toHere: "cuda ok <n>",
//           or "cuda skip <why>" where there is no GPU or CUDA libtorch

#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>

namespace rpc = trellis::rpc;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string name(int32_t rank) { return "w" + std::to_string(rank); }

// Set by finish(): the driver's "you may shut down now".
std::promise<void> gFinish;
std::once_flag gFinishOnce;

std::atomic<int64_t> gLive{0};

}  // namespace

int64_t addInts(int64_t a, int64_t b) { return a + b; }
std::string whoAmI() { return rpc::getWorkerInfo().name; }
int64_t sleepMs(int64_t ms) {
  say("sleeping");
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
void finish() {
  std::call_once(gFinishOnce, [] { gFinish.set_value(); });
}

struct Tracked {
  Tracked() { ++gLive; }
  ~Tracked() { --gLive; }
  Tracked(const Tracked&) = delete;
  Tracked& operator=(const Tracked&) = delete;
  int64_t get() const { return 7; }
};
std::shared_ptr<Tracked> makeTracked() { return std::make_shared<Tracked>(); }
int64_t liveCount() { return gLive.load(); }

std::mutex gHeldMu;
std::vector<rpc::RRef<Tracked>> gHeld;
int64_t holdAndRead(rpc::RRef<Tracked> r) {
  const int64_t v = r.rpcSync<&Tracked::get>();
  std::lock_guard<std::mutex> lock(gHeldMu);
  gHeld.push_back(std::move(r));
  return v;
}
void dropHeld() {
  std::vector<rpc::RRef<Tracked>> drop;
  {
    std::lock_guard<std::mutex> lock(gHeldMu);
    drop.swap(gHeld);
  }
}

at::Tensor echo(const at::Tensor& t) { return t; }
at::Tensor makeOnDevice(int64_t n) {
  return at::arange(n, at::TensorOptions().device(at::kCUDA, 0)).to(at::kFloat);
}

std::atomic<int> gCalls{0};
void countCall() { ++gCalls; }

TRELLIS_REMOTE_FUNCTION(addInts);
TRELLIS_REMOTE_FUNCTION(echo);
TRELLIS_REMOTE_FUNCTION(makeOnDevice);
TRELLIS_REMOTE_FUNCTION(countCall);
TRELLIS_REMOTE_FUNCTION(whoAmI);
TRELLIS_REMOTE_FUNCTION(sleepMs);
TRELLIS_REMOTE_FUNCTION(finish);
TRELLIS_REMOTE_FUNCTION(makeTracked);
TRELLIS_REMOTE_FUNCTION(liveCount);
TRELLIS_REMOTE_FUNCTION(holdAndRead);
TRELLIS_REMOTE_FUNCTION(dropHeld);
TRELLIS_REMOTE_METHODS(Tracked, get);

namespace {

bool waitFinish(std::chrono::seconds limit) {
  return gFinish.get_future().wait_for(limit) == std::future_status::ready;
}

// Waits (bounded) until the test creates `path`.
bool waitForFile(const std::string& path, std::chrono::seconds limit) {
  const auto start = Clock::now();
  while (!std::filesystem::exists(path)) {
    if (Clock::now() - start > limit) {
      return false;
    }
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

int scenarioPairs(int32_t rank, int32_t world) {
  for (int32_t to = 0; to < world; ++to) {
    if (rpc::rpcSync<whoAmI>(to) != name(to) ||
        rpc::rpcSync<addInts>(name(to), rank, to) != rank + to) {
      say("bad reply from " + name(to));
      return 1;
    }
  }
  say("pairs ok");
  rpc::shutdown({.drainTimeout = 30s});
  return 0;
}

int scenarioKill(int32_t rank) {
  if (rank == 1) {
    // Serves (and sleeps in sleepMs) until the test kills it.
    say("ready");
    std::this_thread::sleep_for(60s);
    return 1;
  }
  if (rank == 2) {
    say("ready");
    const bool told = waitFinish(30s);
    // Gives the reply to finish() time to leave before the pipes close.
    std::this_thread::sleep_for(200ms);
    rpc::shutdown({.graceful = false});
    return told ? 0 : 1;
  }
  auto f = rpc::rpcAsync<sleepMs>("w1", int64_t{30000});
  say("calling");
  // The test SIGKILLs w1 once it printed "sleeping".
  try {
    f.wait(20s);
    say("no error");
    return 1;
  } catch (const trellis::ConnectionError& e) {
    const auto failedAt = Clock::now();
    say(std::string("ConnectionError ") + e.what());
    std::printf("failed_at_ns %lld\n",
                static_cast<long long>(
                    std::chrono::duration_cast<std::chrono::nanoseconds>(
                        failedAt.time_since_epoch())
                        .count()));
    std::fflush(stdout);
  } catch (const std::exception& e) {
    say(std::string("other error ") + e.what());
    return 1;
  }
  const int64_t v = rpc::rpcSync<addInts>({"w2", 5s}, 20, 22);
  say("third " + std::to_string(v));
  rpc::rpcSync<finish>({"w2", 5s});
  rpc::shutdown({.graceful = false});
  return v == 42 ? 0 : 1;
}

// A worker dies while the group is in graceful shutdown: w0 has a call in
// flight to w2 (so the group cannot go idle), everybody enters shutdown, the
// test SIGKILLs w2. The others' shutdown must fail within shutdownDrainTimeout
// (or shutdownArrivalTimeout, should w2 die before it arrived) naming w2,
// not hang. w0 hosts the store, so it stays until the test has read w1's
// result (`goFile`).
int scenarioShutdownDies(int32_t rank, const std::string& goFile) {
  std::optional<trellis::Future<int64_t>> pending;
  if (rank == 0) {
    pending = rpc::rpcAsync<sleepMs>("w2", int64_t{60000});
    // w2 is serving it once it answers a second call.
    rpc::rpcSync<addInts>("w2", 1, 2);
  }
  say("entering-shutdown");
  const auto t0 = Clock::now();
  try {
    rpc::shutdown();
    say("shutdown ok");
    return 1;
  } catch (const trellis::TimeoutError& e) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0)
            .count();
    say("TimeoutError after " + std::to_string(ms) + " ms: " + e.what());
  }
  if (rank == 0 && !waitForFile(goFile, 60s)) {
    say("no go file");
  }
  rpc::shutdown({.graceful = false});
  return 0;
}

int scenarioRRef(int32_t rank) {
  if (rank != 1) {
    const bool told = waitFinish(60s);
    rpc::shutdown({.drainTimeout = 30s});
    return told ? 0 : 1;
  }
  auto live = [] { return rpc::rpcSync<liveCount>("w0"); };
  // Waits (bounded) until w0's count reaches `want`; returns the wait.
  auto waitLive = [&](int64_t want) -> int64_t {
    const auto start = Clock::now();
    while (Clock::now() - start < 10s) {
      if (live() == want) {
        return std::chrono::duration_cast<std::chrono::milliseconds>(
                   Clock::now() - start)
            .count();
      }
      std::this_thread::sleep_for(2ms);
    }
    return -1;
  };
  for (const char* order : {"creator-first", "fork-first"}) {
    {
      auto r = rpc::remote<makeTracked>("w0");
      r.waitConfirmed(10s);
      say(std::string(order) + " created live=" + std::to_string(live()));
      const int64_t got = rpc::rpcSync<holdAndRead>("w2", r);
      say(std::string(order) + " forked read=" + std::to_string(got) +
          " live=" + std::to_string(live()));
      if (std::string(order) == "fork-first") {
        rpc::rpcSync<dropHeld>("w2");
        std::this_thread::sleep_for(300ms);
        say(std::string(order) + " one-dropped live=" + std::to_string(live()));
      }
    }  // the creator's handle goes here
    if (std::string(order) == "creator-first") {
      std::this_thread::sleep_for(300ms);
      say(std::string(order) + " one-dropped live=" + std::to_string(live()));
      rpc::rpcSync<dropHeld>("w2");
    }
    const int64_t ms = waitLive(0);
    say(std::string(order) + " both-dropped freed_after_ms=" +
        std::to_string(ms) + " live=" + std::to_string(live()));
  }
  rpc::rpcSync<finish>("w0");
  rpc::rpcSync<finish>("w2");
  rpc::shutdown({.drainTimeout = 30s});
  return 0;
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// Prints the init time, then (after shutdown) the steady-clock stamps of
// init's start and shutdown's end, so the test can time the group's whole
// life apart from process start-up.
int scenarioMany(int32_t rank, int32_t world, Clock::time_point initStart,
                 Clock::duration initTook) {
  const int32_t next = (rank + 1) % world;
  const bool ok = rpc::rpcSync<addInts>(next, rank, 1) == rank + 1;
  rpc::shutdown({.drainTimeout = 60s});
  say("init_ms " +
      std::to_string(
          std::chrono::duration_cast<std::chrono::milliseconds>(initTook)
              .count()) +
      " start_ns " +
      std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(
                         initStart.time_since_epoch())
                         .count()) +
      " end_ns " + std::to_string(nowNs()) + (ok ? " call ok" : " call bad"));
  return ok ? 0 : 1;
}

int scenarioLeave(int32_t rank, const std::string& how,
                  const std::string& goFile) {
  // "<goFile>.called<rank>": that caller has its reply from w2.
  auto calledFile = [&](int32_t r) {
    return goFile + ".called" + std::to_string(r);
  };
  if (rank == 2) {
    // Leaves once w0 and w1 both have their replies (pipes exist, and no
    // reply of theirs is still on its way when it goes).
    if (!waitForFile(calledFile(0), 30s) || !waitForFile(calledFile(1), 30s)) {
      say("callers never called");
      return 1;
    }
    say("leaving");
    if (how == "abort") {
      std::abort();
    }
    return 0;  // no shutdown: the process agent closes at exit
  }
  rpc::rpcSync<countCall>("w2");
  std::ofstream(calledFile(rank)) << "called\n";
  const auto t0 = Clock::now();
  int rc = 1;
  try {
    rpc::shutdown();
    say("shutdown no-error");
  } catch (const trellis::Exception& e) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0)
            .count();
    const bool connection =
        dynamic_cast<const trellis::ConnectionError*>(&e) != nullptr;
    say(std::string("shutdown ") +
        (connection ? "ConnectionError " : "other-error ") +
        std::to_string(ms) + " " + e.what());
    rc = connection ? 3 : 1;
  }
  if (rank == 0 && !waitForFile(goFile, 60s)) {
    say("no go file");
  }
  return rc;
}

int scenarioServe(int32_t rank, const std::string& goFile) {
  if (rank == 0) {
    say("addr " + rpc::getWorkerInfo(0).address);
    const bool told = waitFinish(60s);
    rpc::shutdown({.drainTimeout = 30s});
    return told ? 0 : 1;
  }
  if (!waitForFile(goFile, 60s)) {
    say("no go file");
    return 1;
  }
  const int64_t v = rpc::rpcSync<addInts>({"w0", 10s}, 40, 2);
  say("after " + std::to_string(v));
  rpc::rpcSync<finish>("w0");
  rpc::shutdown({.drainTimeout = 30s});
  return v == 42 ? 0 : 1;
}

}  // namespace

int scenarioStop(int32_t rank, const std::string& stoppedFile,
                 const std::string& continuedFile) {
  if (rank != 0) {
    say("ready");
    const bool told = waitFinish(60s);
    rpc::shutdown({.graceful = false});
    return told ? 0 : 1;
  }
  say("ready");
  // Pipes to both exist before w1 stops: the common case of a peer that
  // hangs mid-job.
  if (rpc::rpcSync<addInts>("w1", 1, 1) != 2 ||
      rpc::rpcSync<addInts>("w2", 1, 1) != 2) {
    say("bad warm-up reply");
    return 1;
  }
  say("warm");
  if (!waitForFile(stoppedFile, 30s)) {
    say("never told w1 stopped");
    return 1;
  }
  const auto start = Clock::now();
  auto stopped = rpc::rpcAsync<addInts>({"w1", 1s}, int64_t{1}, int64_t{2});
  int ok = 0;
  int failed = 0;
  // At least one call to w2 while the call to w1 is pending (it cannot
  // complete before 1 s), and more until it fails; bounded.
  do {
    try {
      if (rpc::rpcSync<addInts>({"w2", 10s}, int64_t{ok}, int64_t{1}) ==
          ok + 1) {
        ++ok;
      } else {
        ++failed;
      }
    } catch (const std::exception& e) {
      ++failed;
      std::fprintf(stderr, "call to w2 failed: %s\n", e.what());
    }
  } while (!stopped.waitFor(0ms) && Clock::now() - start < 30s);
  try {
    stopped.wait(30s);
    say("no error");
    return 1;
  } catch (const trellis::TimeoutError& e) {
    const auto took = Clock::now() - start;
    say(std::string("TimeoutError ") + e.what());
    say("timeout_ms " +
        std::to_string(
            std::chrono::duration_cast<std::chrono::milliseconds>(took)
                .count()));
  } catch (const std::exception& e) {
    say(std::string("wrong error ") + e.what());
    return 1;
  }
  say("third ok " + std::to_string(ok) + " failed " + std::to_string(failed));
  if (!waitForFile(continuedFile, 30s)) {
    say("never told w1 continued");
    return 1;
  }
  say("after " + std::to_string(rpc::rpcSync<addInts>({"w1", 20s}, 1, 2)));
  for (const char* peer : {"w1", "w2"}) {
    try {
      rpc::rpcSync<finish>({peer, 20s});
    } catch (const trellis::ConnectionError&) {
      // It closed as soon as it was told, before its reply left.
    }
  }
  rpc::shutdown({.graceful = false});
  return 0;
}

// Both workers see the same machine, so both skip or neither does.
int scenarioCuda(int32_t rank) {
  if (!at::hasCUDA()) {
    if (rank == 0) {
      say("cuda skip no GPU visible, or a libtorch without CUDA");
    }
    rpc::shutdown({.graceful = true});
    return 0;
  }
  if (rank == 0) {
    const auto on = at::TensorOptions().device(at::kCUDA, 0);
    std::vector<at::Tensor> sent = {at::arange(0, on.dtype(at::kFloat)),
                                    at::arange(1000, on.dtype(at::kHalf)),
                                    at::arange(1 << 20, on.dtype(at::kLong)),
                                    at::arange(64 * 64, on.dtype(at::kFloat))
                                        .view({64, 64})
                                        .narrow(0, 8, 16)};
    // One allocation sent again and again: the reader's cached handle.
    for (int i = 0; i < 20; ++i) {
      sent.push_back(sent[2]);
    }
    // Fresh allocations, freed as soon as echoed: addresses reused by the
    // caching allocator, each a new buffer to the reader.
    for (int i = 0; i < 20; ++i) {
      sent.push_back(at::full({1 << 16}, float(i), on));
    }
    int ok = 0;
    for (const auto& t : sent) {
      const at::Tensor back = rpc::rpcSync<echo>("w1", t);
      if (!back.is_cuda() || !back.cpu().equal(t.cpu())) {
        say("cuda mismatch at " + std::to_string(ok));
        return 3;
      }
      ++ok;
    }
    const at::Tensor fetched =
        rpc::remote<makeOnDevice>("w1", int64_t{100000}).toHere();
    if (!fetched.is_cuda() ||
        !fetched.cpu().equal(at::arange(100000).to(at::kFloat))) {
      say("cuda toHere mismatch");
      return 3;
    }
    say("cuda ok " + std::to_string(ok + 1));
  }
  rpc::shutdown({.graceful = true});
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: rpc_worker_helper SCENARIO [ARG]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const auto env = trellis::WorkerEnv::fromEnvironment();
  const int32_t rank = env.rank;
  const int32_t world = env.worldSize;
  try {
    rpc::RpcOptions o;
    o.localAddress = "127.0.0.1";
    o.initTimeout = 60s;
    if (scenario == "shutdown-dies") {
      o.shutdownDrainTimeout = 4s;
      o.shutdownArrivalTimeout = 10s;
    }
    const auto t0 = Clock::now();
    rpc::init(name(rank), rank, world, o);
    const auto initTook = Clock::now() - t0;
    if (scenario == "pairs") {
      return scenarioPairs(rank, world);
    }
    if (scenario == "kill") {
      return scenarioKill(rank);
    }
    if (scenario == "rref") {
      return scenarioRRef(rank);
    }
    if (scenario == "shutdown-dies") {
      return scenarioShutdownDies(rank, argc > 2 ? argv[2] : "");
    }
    if (scenario == "many") {
      return scenarioMany(rank, world, t0, initTook);
    }
    if (scenario == "leave" && argc > 3) {
      return scenarioLeave(rank, argv[2], argv[3]);
    }
    if (scenario == "stop" && argc > 3) {
      return scenarioStop(rank, argv[2], argv[3]);
    }
    if (scenario == "cuda") {
      return scenarioCuda(rank);
    }
    if (scenario == "serve") {
      return scenarioServe(rank, argc > 2 ? argv[2] : "");
    }
    std::fprintf(stderr, "rpc_worker_helper: unknown scenario %s\n",
                 scenario.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_worker_helper %s rank %d: %s\n", scenario.c_str(),
                 rank, e.what());
    std::fflush(stderr);
    return 1;
  }
}
