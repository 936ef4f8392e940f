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

#include <ATen/ATen.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <trellis/core/error.h>
#include <trellis/dist_autograd/dist_autograd.h>
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
  static at::Tensor p = makeParam(
      std::atoi(std::getenv("RANK") != nullptr ? std::getenv("RANK") : "0"));
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
  rpc::shutdown(false);
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
      rpc::shutdown(false);
      return told ? 0 : 1;
    }
    default:
      // Serves until the test kills it.
      say("ready");
      std::this_thread::sleep_for(60s);
      return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "dist_autograd_worker: usage: SCENARIO\n");
    return 2;
  }
  const std::string scenario = argv[1];
  const char* r = std::getenv("RANK");
  const char* w = std::getenv("WORLD_SIZE");
  if (r == nullptr || w == nullptr) {
    std::fprintf(stderr, "dist_autograd_worker: RANK/WORLD_SIZE unset\n");
    return 2;
  }
  const int32_t rank = std::atoi(r);
  const int32_t world = std::atoi(w);
  try {
    rpc::RpcOptions o;
    o.localAddress = "127.0.0.1";
    o.initTimeout = 60s;
    o.defaultTimeout = 30s;
    rpc::init("w" + std::to_string(rank), rank, world, o);
    if (scenario == "kill") {
      return scenarioKill(rank);
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
