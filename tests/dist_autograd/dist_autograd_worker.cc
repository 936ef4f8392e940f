// A worker process for dist_autograd_process_test.cc. Reads RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and TRELLIS_JOB_TOKEN) like any
// Trellis worker; argv[1] picks the scenario. Results go to stdout, one
// line each, which the test reads with a bound; exit 0 means the
// scenario's own checks passed.
//
//   kill   3 workers. w0 runs a context through w1 (relay) to w2, whose
//          backward function blocks ("blocking") until the test SIGKILLs
//          w2. w0 reports backward's error ("error <type> <what>", then
//          "failed_at_ns"), that its context was released on w0 and w1
//          ("released"), and that w0 and w1 still run a new context and
//          backward between themselves ("second ok").
//   stopped  2 workers, argv[2] "now", "graceful" or "exit", argv[3] a
//          file. w1
//          builds an RRef, a DistributedOptimizer and two contexts whose
//          forward ran through w0, prints "ready", and once the file
//          exists (the test has SIGSTOPped w0 by then) runs rpcSync,
//          rpcAsync, toHere (of text, and of a number made by a remote()
//          sent then), backward and step against w0 at once; each
//          must fail with TimeoutError within the 1 s call timeout
//          ("op <name> <type> <ms> <what>"). It also leaves a call with
//          a 30 s timeout pending, having given up waiting for it after
//          200 ms. It then shuts down (shutdown({.graceful = false}), or
//          graceful bounded by 1 s: "shutdown <type> <what>"), or returns from
//          main with the call still pending and the agent still up ("exit");
//          either way it exits 0, leaving w0 stopped.

#include <ATen/ATen.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/rpc.h>

namespace rpc = trellis::rpc;
namespace dist = trellis::dist_autograd;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
}

// This worker's parameter: a leaf made once, the same values in every
// process (rank 0 recomputes w1's part locally as the reference).
at::Tensor makeParam(int rank) {
  return (at::linspace(-0.6, 0.8, 9, at::kDouble).reshape({3, 3}) + 0.1 * rank)
      .requires_grad_(true);
}
at::Tensor& param() {
  static at::Tensor p = makeParam(trellis::WorkerEnv::fromEnvironment().rank);
  return p;
}

at::Tensor input(double k) {
  return (at::arange(6, at::kDouble).reshape({2, 3}) * 0.1 - 0.25 + k)
      .requires_grad_(true);
}

// Identity forward; backward blocks (bounded) so that the test can kill
// this process while its part of the backward pass runs.
struct BlockInBackward : torch::autograd::Function<BlockInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    say("blocking");
    const auto end = Clock::now() + 60s;
    while (Clock::now() < end) {
      std::this_thread::sleep_for(10ms);
    }
    return grads;
  }
};

std::promise<void> gFinish;
std::once_flag gFinishOnce;

}  // namespace

// On w2: its part blocks in backward.
at::Tensor blockingStage(at::Tensor a) {
  return BlockInBackward::apply(a.mm(param()));
}
// On w1: its own parameter, then w2 (nested call in the same context).
at::Tensor relay(at::Tensor a) {
  at::Tensor u = at::tanh(a.mm(param()));
  return rpc::rpcSync<blockingStage>("w2", u) * u;
}
// On w1: the second context, w0 and w1 only.
at::Tensor hopHere(at::Tensor a) { return at::tanh(a.mm(param())); }
// On w1: its parameter's gradient in a context.
at::Tensor paramGrad(uint64_t contextId) {
  return dist::getGradients(contextId).at(param());
}
int64_t liveContexts() {
  return static_cast<int64_t>(dist::liveContextCount());
}
void finish() {
  std::call_once(gFinishOnce, [] { gFinish.set_value(); });
}

int64_t addInts(int64_t a, int64_t b) { return a + b; }
// Text, which toHere() fetches from the owner (a number would come with the
// remote()'s reply, and toHere() would need w0 no more).
std::string makeValue() { return "value"; }
// On w0: RRefs to its parameter, for w1's DistributedOptimizer.
std::vector<rpc::RRef<at::Tensor>> paramRRefs() {
  return dist::localParameters({param()});
}

TRELLIS_REMOTE_FUNCTION(addInts);
TRELLIS_REMOTE_FUNCTION(makeValue);
TRELLIS_REMOTE_FUNCTION(paramRRefs);
TRELLIS_REMOTE_FUNCTION(blockingStage);
TRELLIS_REMOTE_FUNCTION(relay);
TRELLIS_REMOTE_FUNCTION(hopHere);
TRELLIS_REMOTE_FUNCTION(paramGrad);
TRELLIS_REMOTE_FUNCTION(liveContexts);
TRELLIS_REMOTE_FUNCTION(finish);

namespace {

const char* typeName(const trellis::Exception& e) {
  if (dynamic_cast<const trellis::RemoteError*>(&e) != nullptr) {
    return "RemoteError";
  }
  if (dynamic_cast<const trellis::ConnectionError*>(&e) != nullptr) {
    return "ConnectionError";
  }
  if (dynamic_cast<const trellis::TimeoutError*>(&e) != nullptr) {
    return "TimeoutError";
  }
  return "Exception";
}

bool waitFinish(std::chrono::seconds limit) {
  return gFinish.get_future().wait_for(limit) == std::future_status::ready;
}

// Rank 0's part of "kill".
int driveKill() {
  {
    dist::Context ctx;
    const at::Tensor x = input(0.0);
    at::Tensor r = rpc::rpcSync<relay>("w1", x);
    say("backward");
    try {
      ctx.backward({r.sum()});
      say("no error");
      return 1;
    } catch (const trellis::Exception& e) {
      const int64_t at = nowNs();
      say(std::string("error ") + typeName(e) + " " + e.what());
      say("failed_at_ns " + std::to_string(at));
    }
  }
  // The failed context is gone here and on w1 (w2 is dead).
  const auto end = Clock::now() + 10s;
  int64_t here = -1, w1 = -1;
  while (Clock::now() < end) {
    here = static_cast<int64_t>(dist::liveContextCount());
    w1 = rpc::rpcSync<liveContexts>({"w1", 5s});
    if (here == 0 && w1 == 0) {
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  say("released w0=" + std::to_string(here) + " w1=" + std::to_string(w1));

  // w0 and w1 still work together.
  const at::Tensor x = input(0.3);
  at::Tensor gotX, gotW1;
  {
    dist::Context ctx;
    at::Tensor y = rpc::rpcSync<hopHere>({"w1", 10s}, x);
    ctx.backward({(y * y).sum()});
    gotX = ctx.gradients().find(x);
    gotW1 = rpc::rpcSync<paramGrad>({"w1", 10s}, ctx.id());
  }
  const at::Tensor xr = x.detach().clone().requires_grad_(true);
  const at::Tensor w1r = makeParam(1);
  at::Tensor y = at::tanh(xr.mm(w1r));
  auto want = torch::autograd::grad({(y * y).sum()}, {xr, w1r});
  const bool ok = gotX.defined() && gotW1.defined() &&
                  (gotX - want[0]).abs().max().item<double>() <= 1e-9 &&
                  (gotW1 - want[1]).abs().max().item<double>() <= 1e-9;
  say(ok ? "second ok" : "second bad");
  rpc::rpcSync<finish>({"w1", 10s});
  rpc::shutdown({.graceful = false});
  return ok && here == 0 && w1 == 0 ? 0 : 1;
}

int scenarioKill(int32_t rank) {
  switch (rank) {
    case 0:
      return driveKill();
    case 1: {
      const bool told = waitFinish(60s);
      // Gives the reply to finish() time to leave before the pipes close.
      std::this_thread::sleep_for(200ms);
      rpc::shutdown({.graceful = false});
      return told ? 0 : 1;
    }
    default:
      // Serves until the test kills it.
      say("ready");
      std::this_thread::sleep_for(60s);
      return 1;
  }
}

constexpr auto kStoppedTimeout = 1s;

bool waitForFile(const std::string& path, std::chrono::seconds limit) {
  const auto end = Clock::now() + limit;
  while (!std::filesystem::exists(path)) {
    if (Clock::now() >= end) {
      return false;
    }
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// w1's part of "stopped".
int driveStopped(const std::string& mode, const std::string& goFile) {
  // Everything each operation needs is built while w0 still runs: the
  // threads set up, report, and wait for the go.
  std::promise<void> go;
  std::shared_future<void> goSignal = go.get_future().share();
  std::mutex mu;
  std::vector<std::string> lines;
  std::atomic<int> prepared{0};
  auto report = [&](const std::string& op, const std::function<void()>& fn) {
    const auto start = Clock::now();
    std::string line;
    try {
      fn();
      line = "op " + op + " no-error";
    } catch (const trellis::Exception& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          Clock::now() - start)
                          .count();
      line = "op " + op + " " + typeName(e) + " " + std::to_string(ms) + " " +
             e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line);
  };
  // `setup` returns the operation; what it captures (a context) goes with
  // it on the same thread.
  auto opThread = [&](std::function<std::function<void()>()> setup,
                      std::string name) {
    return std::thread([&, setup = std::move(setup), name] {
      std::function<void()> op;
      try {
        op = setup();
      } catch (const std::exception& e) {
        say(std::string("setup failed: ") + e.what());
        return;
      }
      ++prepared;
      goSignal.wait();
      report(name, op);
      op = nullptr;
    });
  };
  // Open the pipe first with a generous timeout (slow under TSan): the
  // set-up below uses the 1 s default, meant for the stopped w0, and the
  // objects it makes keep that timeout for their own calls.
  rpc::rpcSync<addInts>({"w0", 30s}, 0, 0);
  auto rref = rpc::remote<makeValue>("w0");
  rref.waitConfirmed(10s);
  dist::DistributedOptimizer opt(dist::SGD{.lr = 0.1},
                                 rpc::rpcSync<paramRRefs>("w0"));
  std::vector<std::thread> threads;
  threads.push_back(opThread(
      [] { return [] { rpc::rpcSync<addInts>("w0", 1, 2); }; }, "rpcSync"));
  threads.push_back(
      opThread([] { return [] { rpc::rpcAsync<addInts>("w0", 1, 2).wait(); }; },
               "rpcAsync"));
  threads.push_back(
      opThread([&] { return [&] { (void)rref.toHere(); }; }, "toHere"));
  // A number comes with the remote()'s reply (docs/rref.md): its toHere()
  // sends nothing and waits for that reply, which the stopped w0 never
  // sends.
  threads.push_back(opThread(
      [] { return [] { (void)rpc::remote<addInts>("w0", 1, 2).toHere(); }; },
      "toHereNumber"));
  // A context belongs to the thread that made it.
  threads.push_back(opThread(
      [] {
        auto ctx = std::make_shared<dist::Context>();
        at::Tensor loss = rpc::rpcSync<hopHere>("w0", input(0.1)).sum();
        return [ctx, loss] { ctx->backward({loss}); };
      },
      "backward"));
  threads.push_back(opThread(
      [&] {
        auto ctx = std::make_shared<dist::Context>();
        ctx->backward({rpc::rpcSync<hopHere>("w0", input(0.2)).sum()});
        return [ctx, &opt] { opt.step(ctx->id()); };
      },
      "step"));
  const auto end = Clock::now() + 30s;
  while (prepared.load() < static_cast<int>(threads.size()) &&
         Clock::now() < end) {
    std::this_thread::sleep_for(5ms);
  }
  say(prepared.load() == static_cast<int>(threads.size()) ? "ready"
                                                          : "not ready");
  const bool told = waitForFile(goFile, 60s);
  go.set_value();
  // The caller gives up on this one long before its own timeout.
  auto abandoned = rpc::rpcAsync<addInts>({"w0", 30s}, 1, 2);
  report("abandoned", [&] { abandoned.wait(200ms); });
  for (auto& t : threads) {
    t.join();
  }
  for (const auto& line : lines) {
    say(line);
  }
  if (mode == "exit") {
    // The process agent's destructor closes it during static destruction.
    say("shutdown skipped");
    return told ? 0 : 1;
  }
  try {
    if (mode == "graceful") {
      rpc::shutdown({.drainTimeout = kStoppedTimeout});
      say("shutdown no-error");
    } else {
      rpc::shutdown({.graceful = false});
      say("shutdown ok");
    }
  } catch (const trellis::Exception& e) {
    say(std::string("shutdown ") + typeName(e) + " " + e.what());
  }
  return told ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "dist_autograd_worker: usage: SCENARIO\n");
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
    o.defaultTimeout = 30s;
    if (scenario == "stopped") {
      o.defaultTimeout = kStoppedTimeout;
      o.shutdownDrainTimeout = kStoppedTimeout;
    }
    rpc::init("w" + std::to_string(rank), rank, world, o);
    if (scenario == "kill") {
      return scenarioKill(rank);
    }
    if (scenario == "stopped" && argc >= 4) {
      if (rank == 0) {
        say("serving");
        std::this_thread::sleep_for(120s);  // the test stops and kills it
        return 1;
      }
      return driveStopped(argv[2], argv[3]);
    }
    std::fprintf(stderr, "dist_autograd_worker: unknown scenario %s\n",
                 scenario.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_autograd_worker %s rank %d: %s\n",
                 scenario.c_str(), rank, e.what());
    std::fflush(stderr);
    return 1;
  }
}
