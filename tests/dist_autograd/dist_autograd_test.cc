// Distributed autograd with three agents in one process ("w0", "w1", "w2",
// each with its own transport context and threads, rendezvousing through a
// shared HashStore; pipes between them are real). Every gradient is
// checked against the same computation done in one process with plain
// libtorch autograd. The test with real processes and a SIGKILLed worker
// is dist_autograd_process_test.cc.

#include <ATen/ATen.h>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "../rpc/agent_group.h"
#include <trellis/core/error.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
#include <trellis/store/hash_store.h>

using namespace std::chrono_literals;
using trellis::Duration;
namespace rpc = trellis::rpc;
namespace dist = trellis::dist_autograd;

namespace {

// The name of the worker running the calling user function.
std::string self() { return rpc::getWorkerInfo().name; }

// Parameters by name ("w1", "vec.w2", ...): leaves that require grad, made
// once with deterministic values. All agents share this process, so a key
// carries the worker that uses it; the same tensor object (one TensorImpl)
// is handed out every time, which is what GradientMap keys on.
at::Tensor param(const std::string& key) {
  static std::mutex mu;
  static std::map<std::string, at::Tensor> params;
  std::lock_guard<std::mutex> lock(mu);
  auto it = params.find(key);
  if (it == params.end()) {
    const double seed =
        static_cast<double>(std::hash<std::string>{}(key) % 1000) / 1000.0;
    const bool vector =
        key.rfind("vec.", 0) == 0 || key.rfind("scale.", 0) == 0;
    at::Tensor t = vector
                       ? at::linspace(-0.7 + seed, 0.9 - seed, 3, at::kDouble)
                       : at::linspace(-0.8 + seed, 0.6 + seed, 9, at::kDouble)
                             .reshape({3, 3});
    t.requires_grad_(true);
    it = params.emplace(key, t).first;
  }
  return it->second;
}

// A leaf input of shape [2, 3] that differs with `k`.
at::Tensor input(double k) {
  return (at::arange(6, at::kDouble).reshape({2, 3}) * 0.1 - 0.25 + k)
      .requires_grad_(true);
}

// A copy of `t` that is a fresh leaf, for the local reference computation.
at::Tensor leafCopy(const at::Tensor& t) {
  return t.detach().clone().requires_grad_(true);
}

// The math of each remote stage, shared by the remote functions and the
// local reference so that both compute exactly the same thing.
at::Tensor stage2Math(const at::Tensor& u, const at::Tensor& w2) {
  return at::sin(u.mm(w2));
}
at::Tensor stage1PreMath(const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& w1) {
  return at::sigmoid(a.mm(w1)) + b * 0.5;
}
at::Tensor hopMath(const at::Tensor& a, const at::Tensor& w) {
  return at::tanh(a.mm(w));
}

// Forward: 2x; backward: throws. Used on w2 only.
struct BoomOnBackward : torch::autograd::Function<BoomOnBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx,
                            const at::Tensor& x) {
    return x * 2;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    throw std::runtime_error("boom on w2");
  }
};

}  // namespace

// ---- functions the tests call ----------------------------------------------

// w2 in the chain: uses its own parameter.
at::Tensor stage2(at::Tensor u) { return stage2Math(u, param(self())); }

// w1 in the chain: uses its parameter, then calls w2 from inside the user
// function (a nested RPC in the same context) and also keeps using `u`
// locally (a branch on w1).
at::Tensor stage1(at::Tensor a, at::Tensor b) {
  at::Tensor u = stage1PreMath(a, b, param(self()));
  at::Tensor v = rpc::rpcSync<stage2>("w2", u);
  return v * u;
}

// tanh(a @ P[self]); with a `next` worker, also runs hop there on the
// result and returns the product of both.
at::Tensor hop(at::Tensor a, std::string next) {
  at::Tensor out = hopMath(a, param(self()));
  if (!next.empty()) {
    out = rpc::rpcSync<hop>(next, out, std::string()) * out;
  }
  return out;
}

// A parameter of the callee, kept there as the value of an RRef.
at::Tensor ownedVector() { return param("vec." + self()); }

// A "module" that lives on its owner behind an RRef.
struct Scaler {
  at::Tensor weight;
  at::Tensor forward(at::Tensor x) { return x * weight; }
};
std::shared_ptr<Scaler> makeScaler() {
  return std::make_shared<Scaler>(Scaler{param("scale." + self())});
}

at::Tensor boomOnBackward(at::Tensor a) {
  return BoomOnBackward::apply(a.mm(param(self())));
}
// Relays to boomOnBackward on w2, so the failure crosses two hops.
at::Tensor relayToBoom(at::Tensor a) {
  return rpc::rpcSync<boomOnBackward>("w2", hopMath(a, param(self())));
}

at::Tensor scaleBy(at::Tensor a, double s) { return a * s; }

// The distributed-autograd context the callee's user function runs in.
uint64_t contextHere() { return dist::currentContextId(); }
uint64_t contextVia(std::string next) {
  return rpc::rpcSync<contextHere>(next);
}

TRELLIS_REMOTE_FUNCTION(stage2);
TRELLIS_REMOTE_FUNCTION(stage1);
TRELLIS_REMOTE_FUNCTION(hop);
TRELLIS_REMOTE_FUNCTION(ownedVector);
TRELLIS_REMOTE_FUNCTION(makeScaler);
TRELLIS_REMOTE_FUNCTION(boomOnBackward);
TRELLIS_REMOTE_FUNCTION(relayToBoom);
TRELLIS_REMOTE_FUNCTION(scaleBy);
TRELLIS_REMOTE_FUNCTION(contextHere);
TRELLIS_REMOTE_FUNCTION(contextVia);
TRELLIS_REMOTE_METHODS(Scaler, forward);

namespace {

// Agents "w0".."w<n-1>" in this process; every call (backward's messages
// included) bounded at 30 s.
struct Group : rpc::testing::AgentGroup {
  explicit Group(int n) : AgentGroup(n, rpc::testing::callsBoundedBy(30s)) {}
};
using rpc::testing::waitUntil;

// The gradients `agent` holds for context `id`.
dist::GradientMap gradientsOn(rpc::Agent& agent, uint64_t id) {
  rpc::CurrentAgentScope scope(&agent);
  return dist::getGradients(id);
}

bool allReleased(Group& g) {
  for (int i = 0; i < g.size(); ++i) {
    if (dist::liveContextCount(g[i]) != 0) {
      return false;
    }
  }
  return true;
}

std::string liveCounts(Group& g) {
  std::string s;
  for (int i = 0; i < g.size(); ++i) {
    s += " w" + std::to_string(i) + "=" +
         std::to_string(dist::liveContextCount(g[i]));
  }
  return s;
}

constexpr double kTolerance = 1e-9;  // the issue asks for 1e-6

// Checks that `map` holds a gradient for `leaf` equal to `want`.
void expectGrad(const dist::GradientMap& map, const at::Tensor& leaf,
                const at::Tensor& want, const std::string& what) {
  const at::Tensor got = map.find(leaf);
  ASSERT_TRUE(got.defined()) << "no gradient for " << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got - want).abs().max().item<double>();
  EXPECT_LE(diff, kTolerance) << what << ": got\n" << got << "\nwant\n" << want;
}

// ---- 1, 2: a chain across three workers --------------------------------

struct ChainResult {
  at::Tensor x, w0;
  dist::GradientMap g0, g1, g2;
};

// The chain of test 1. On w0: h = tanh(x @ W0); h is used locally (a
// branch), sent to w1 twice in one call (stage1(h, h), which calls w2
// itself), sent to w2 in a second RPC (stage2), multiplied by w2's
// RRef-held vector fetched with toHere(), and passed to a method of an
// RRef'd module on w2.
ChainResult runChain(Group& g, double k) {
  rpc::CurrentAgentScope scope(&g[0]);
  auto vec = rpc::remote<ownedVector>("w2");
  auto scaler = rpc::remote<makeScaler>("w2");
  vec.waitConfirmed(10s);
  scaler.waitConfirmed(10s);
  ChainResult out;
  out.x = input(k);
  out.w0 = param("w0");
  dist::Context ctx(g[0]);
  EXPECT_EQ(dist::currentContextId(), ctx.id());
  at::Tensor h = hopMath(out.x, out.w0);
  at::Tensor r1 = rpc::rpcSync<stage1>("w1", h, h);
  at::Tensor r2 = rpc::rpcSync<stage2>("w2", h);
  at::Tensor p = vec.toHere();
  at::Tensor m = scaler.rpcSync<&Scaler::forward>(h);
  // What came back is attached to the remote graphs.
  for (const at::Tensor* t : {&r1, &r2, &p, &m}) {
    EXPECT_TRUE(t->requires_grad());
    EXPECT_FALSE(t->is_leaf());
  }
  at::Tensor loss = (h * h).sum() + r1.sum() + (r2 * 2).sum() + (h * p).sum() +
                    m.pow(2).sum();
  ctx.backward({loss});
  out.g0 = ctx.gradients();
  out.g1 = gradientsOn(g[1], ctx.id());
  out.g2 = gradientsOn(g[2], ctx.id());
  return out;
}

// runChain in one process with libtorch: gradients of x, W0, W1, W2, the
// RRef'd vector and the module weight, in that order.
std::vector<at::Tensor> referenceChain(const at::Tensor& xIn) {
  const at::Tensor x = leafCopy(xIn);
  const at::Tensor w0 = leafCopy(param("w0"));
  const at::Tensor w1 = leafCopy(param("w1"));
  const at::Tensor w2 = leafCopy(param("w2"));
  const at::Tensor vec = leafCopy(param("vec.w2"));
  const at::Tensor scale = leafCopy(param("scale.w2"));
  at::Tensor h = hopMath(x, w0);
  at::Tensor u = stage1PreMath(h, h, w1);
  at::Tensor r1 = stage2Math(u, w2) * u;
  at::Tensor r2 = stage2Math(h, w2);
  at::Tensor m = h * scale;
  at::Tensor loss = (h * h).sum() + r1.sum() + (r2 * 2).sum() +
                    (h * vec).sum() + m.pow(2).sum();
  return torch::autograd::grad({loss}, {x, w0, w1, w2, vec, scale});
}

void expectChainGradients(const ChainResult& r, double scale = 1.0) {
  const auto want = referenceChain(r.x);
  expectGrad(r.g0, r.x, want[0] * scale, "x on w0");
  expectGrad(r.g0, r.w0, want[1] * scale, "W0 on w0");
  expectGrad(r.g1, param("w1"), want[2] * scale, "W1 on w1");
  expectGrad(r.g2, param("w2"), want[3] * scale, "W2 on w2");
  expectGrad(r.g2, param("vec.w2"), want[4] * scale, "RRef'd vector on w2");
  expectGrad(r.g2, param("scale.w2"), want[5] * scale,
             "RRef'd module's weight on w2");
  // Only leaves get gradients; received tensors are not leaves.
  EXPECT_EQ(r.g0.size(), 2u);
  EXPECT_EQ(r.g1.size(), 1u);
  EXPECT_EQ(r.g2.size(), 3u);
}

TEST(DistAutograd, ChainAcrossThreeWorkersMatchesLocalAutograd) {
  Group g(3);
  for (double k : {0.0, 0.37}) {
    SCOPED_TRACE("k=" + std::to_string(k));
    expectChainGradients(runChain(g, k));
  }
  EXPECT_TRUE(waitUntil([&] { return allReleased(g); })) << liveCounts(g);
}

TEST(DistAutograd, NeverWritesDotGrad) {
  Group g(3);
  const ChainResult r = runChain(g, 0.1);
  ASSERT_EQ(r.g0.size(), 2u);
  EXPECT_FALSE(r.x.grad().defined());
  for (const char* key : {"w0", "w1", "w2", "vec.w2", "scale.w2"}) {
    EXPECT_FALSE(param(key).grad().defined()) << key;
  }
  // The gradient map holds the leaves themselves (identity), not copies.
  for (const auto& [impl, e] : r.g0) {
    EXPECT_TRUE(e.tensor.is_same(r.x) || e.tensor.is_same(r.w0));
    EXPECT_FALSE(e.tensor.grad().defined());
  }
}

// The smallest graph where a worker runs its part in two pieces: w1
// receives x, computes u from it, sends u on to w2 and also uses u in its
// result. Gradients reach w1 twice (from w0 for the result, from w2 for u),
// and each piece sends a partial gradient for x back to w0, so w0's send
// function for x receives two gradient messages in one backward.
TEST(DistAutograd, SendFunctionReceivesPartialGradientsTwice) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor x = input(0.15);
  dist::Context ctx(g[0]);
  at::Tensor y = rpc::rpcSync<hop>("w1", x, std::string("w2"));
  ctx.backward({y.sum()});
  const at::Tensor xr = leafCopy(x);
  const at::Tensor p1 = leafCopy(param("w1"));
  const at::Tensor p2 = leafCopy(param("w2"));
  at::Tensor first = hopMath(xr, p1);
  auto want =
      torch::autograd::grad({(hopMath(first, p2) * first).sum()}, {xr, p1, p2});
  expectGrad(ctx.gradients(), x, want[0], "x on w0");
  expectGrad(gradientsOn(g[1], ctx.id()), param("w1"), want[1], "W1 on w1");
  expectGrad(gradientsOn(g[2], ctx.id()), param("w2"), want[2], "W2 on w2");
}

// ---- 3: concurrent contexts ---------------------------------------------

TEST(DistAutograd, ConcurrentContextsOnSeveralInitiators) {
  Group g(3);
  constexpr int kIterations = 20;
  // Initiators: four threads on w0 (w0 -> w1 -> w2) and two on w1
  // (w1 -> w2 -> w0).
  const std::vector<int> initiators = {0, 0, 0, 0, 1, 1};
  std::atomic<int> checked{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < initiators.size(); ++t) {
    threads.emplace_back([&, t] {
      const int me = initiators[t];
      const std::string a = "w" + std::to_string((me + 1) % 3);
      const std::string b = "w" + std::to_string((me + 2) % 3);
      rpc::CurrentAgentScope scope(&g[me]);
      for (int i = 0; i < kIterations; ++i) {
        try {
          const double k = 0.01 * static_cast<double>(t * kIterations + i);
          const at::Tensor x = input(k);
          dist::GradientMap gx, ga, gb;
          {
            dist::Context ctx(g[me]);
            at::Tensor y = rpc::rpcSync<hop>(a, x, b);
            at::Tensor loss = (y * (1.0 + k)).sum();
            ctx.backward({loss});
            gx = ctx.gradients();
            ga = gradientsOn(g[(me + 1) % 3], ctx.id());
            gb = gradientsOn(g[(me + 2) % 3], ctx.id());
          }
          const at::Tensor xr = leafCopy(x);
          const at::Tensor pa = leafCopy(param(a));
          const at::Tensor pb = leafCopy(param(b));
          at::Tensor first = hopMath(xr, pa);
          at::Tensor y = hopMath(first, pb) * first;
          auto want =
              torch::autograd::grad({(y * (1.0 + k)).sum()}, {xr, pa, pb});
          const std::string where =
              "thread " + std::to_string(t) + " iteration " + std::to_string(i);
          expectGrad(gx, x, want[0], "x, " + where);
          expectGrad(ga, param(a), want[1], "P[" + a + "], " + where);
          expectGrad(gb, param(b), want[2], "P[" + b + "], " + where);
          EXPECT_EQ(gx.size(), 1u) << where;
          EXPECT_EQ(ga.size(), 1u) << where;
          EXPECT_EQ(gb.size(), 1u) << where;
          ++checked;
        } catch (const std::exception& e) {
          ADD_FAILURE() << "thread " << t << " iteration " << i << ": "
                        << e.what();
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(checked.load(), static_cast<int>(initiators.size()) * kIterations);
  EXPECT_TRUE(waitUntil([&] { return allReleased(g); })) << liveCounts(g);
}

// ---- 4: an exception in a remote backward function ----------------------

TEST(DistAutograd, RemoteBackwardExceptionNamesTheWorkerAndReleases) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  // Directly from w0 to w2, and relayed through w1.
  for (const bool relayed : {false, true}) {
    SCOPED_TRACE(relayed ? "w0 -> w1 -> w2" : "w0 -> w2");
    {
      dist::Context ctx(g[0]);
      const at::Tensor x = input(0.2);
      at::Tensor r = relayed ? rpc::rpcSync<relayToBoom>("w1", x)
                             : rpc::rpcSync<boomOnBackward>("w2", x);
      at::Tensor loss = (r * r).sum();
      try {
        ctx.backward({loss});
        ADD_FAILURE() << "backward did not throw";
      } catch (const trellis::Exception& e) {
        const std::string what = e.what();
        std::printf("backward threw %s: %s\n",
                    dynamic_cast<const trellis::RemoteError*>(&e) != nullptr
                        ? "RemoteError"
                        : "another trellis::Exception",
                    what.c_str());
        EXPECT_NE(dynamic_cast<const trellis::RemoteError*>(&e), nullptr)
            << what;
        EXPECT_NE(what.find("w2"), std::string::npos) << what;
        EXPECT_NE(what.find("boom"), std::string::npos) << what;
      }
      // Nothing reached x.
      EXPECT_FALSE(x.grad().defined());
    }
    EXPECT_TRUE(waitUntil([&] { return allReleased(g); }, 5s)) << liveCounts(g);
  }
  // The workers go on: a new context works.
  expectChainGradients(runChain(g, 0.5));
}

// ---- 5: cleanup ----------------------------------------------------------

TEST(DistAutograd, DestroyedContextsAreReleasedOnEveryWorker) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  constexpr size_t kContexts = 6;
  {
    // One context that never leaves w0, and inside it (contexts nest on a
    // thread) kContexts that reach w1 and w2.
    dist::Context local(g[0]);
    std::vector<std::unique_ptr<dist::Context>> contexts;
    for (size_t i = 0; i < kContexts; ++i) {
      contexts.push_back(std::make_unique<dist::Context>(g[0]));
      EXPECT_EQ(dist::currentContextId(), contexts.back()->id());
      const at::Tensor x = input(0.1 * static_cast<double>(i));
      at::Tensor y = rpc::rpcSync<hop>("w1", x, std::string("w2"));
      if (i % 2 == 0) {  // half of them run backward, half do not
        contexts.back()->backward({y.sum()});
      }
    }
    EXPECT_EQ(dist::liveContextCount(g[0]), kContexts + 1);
    EXPECT_EQ(dist::liveContextCount(), kContexts + 1);  // current agent
    EXPECT_EQ(dist::liveContextCount(g[1]), kContexts);
    EXPECT_EQ(dist::liveContextCount(g[2]), kContexts);
    while (!contexts.empty()) {  // innermost first
      contexts.pop_back();
    }
    EXPECT_EQ(dist::currentContextId(), local.id());
    EXPECT_TRUE(waitUntil([&] {
      return dist::liveContextCount(g[0]) == 1 &&
             dist::liveContextCount(g[1]) == 0 &&
             dist::liveContextCount(g[2]) == 0;
    })) << liveCounts(g);
  }
  EXPECT_EQ(dist::currentContextId(), 0u);
  EXPECT_TRUE(waitUntil([&] { return allReleased(g); }, 5s)) << liveCounts(g);
}

// ---- 6: retainGraph ------------------------------------------------------

TEST(DistAutograd, RetainGraphAccumulatesAndSecondBackwardWithoutItFails) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor x = input(0.3);
  const at::Tensor xr = leafCopy(x);
  const at::Tensor p1 = leafCopy(param("w1"));
  const at::Tensor p2 = leafCopy(param("w2"));
  at::Tensor first = hopMath(xr, p1);
  auto want =
      torch::autograd::grad({(hopMath(first, p2) * first).sum()}, {xr, p1, p2});
  {
    dist::Context ctx(g[0]);
    at::Tensor loss = rpc::rpcSync<hop>("w1", x, std::string("w2")).sum();
    ctx.backward({loss}, /*retainGraph=*/true);
    ctx.backward({loss}, /*retainGraph=*/true);
    expectGrad(ctx.gradients(), x, want[0] * 2, "x, twice");
    expectGrad(gradientsOn(g[1], ctx.id()), param("w1"), want[1] * 2,
               "W1, twice");
    expectGrad(gradientsOn(g[2], ctx.id()), param("w2"), want[2] * 2,
               "W2, twice");
  }
  {
    dist::Context ctx(g[0]);
    at::Tensor loss = rpc::rpcSync<hop>("w1", x, std::string("w2")).sum();
    ctx.backward({loss});
    expectGrad(ctx.gradients(), x, want[0], "x, once");
    EXPECT_THROW(ctx.backward({loss}), trellis::FailedPreconditionError);
  }
  EXPECT_TRUE(waitUntil([&] { return allReleased(g); }, 5s)) << liveCounts(g);
}

// ---- 7: tensors that do not require grad ---------------------------------

TEST(DistAutograd, TensorsWithoutRequiresGradRecordNothing) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor x = input(0.4);
  dist::Context ctx(g[0]);
  const at::Tensor plain = at::ones({2, 3}, at::kDouble);
  at::Tensor r = rpc::rpcSync<scaleBy>("w1", plain, 3.0);
  EXPECT_TRUE(r.equal(plain * 3));
  EXPECT_FALSE(r.requires_grad());
  // A root that does not require grad is a bad root.
  EXPECT_THROW(ctx.backward({r.sum()}), trellis::InvalidArgumentError);
  at::Tensor loss = (x * r).sum();
  ctx.backward({loss});
  const auto g0 = ctx.gradients();
  EXPECT_EQ(g0.size(), 1u);
  expectGrad(g0, x, r, "x");
  EXPECT_FALSE(g0.contains(r));
  EXPECT_FALSE(g0.contains(plain));
  // The callee knows the context (the call carried it) but recorded no
  // gradient.
  EXPECT_TRUE(gradientsOn(g[1], ctx.id()).empty());
}

// ---- 8: ids, unknown contexts, threads -----------------------------------

TEST(DistAutograd, UnknownContextAndContextIsPerThread) {
  Group g(3);
  {
    rpc::CurrentAgentScope scope(&g[0]);
    EXPECT_EQ(dist::currentContextId(), 0u);
    EXPECT_THROW(dist::getGradients(0xdeadbeefULL), trellis::NotFoundError);
    EXPECT_EQ(rpc::rpcSync<contextHere>("w1"), 0u);
  }
  for (int rank = 0; rank < 3; ++rank) {
    rpc::CurrentAgentScope scope(&g[rank]);
    uint64_t id = 0;
    {
      dist::Context ctx(g[rank]);
      id = ctx.id();
      // The creator's rank is in the top 16 bits.
      EXPECT_EQ(id >> 48, static_cast<uint64_t>(rank));
      EXPECT_EQ(dist::currentContextId(), id);
      const std::string other = "w" + std::to_string((rank + 1) % 3);
      const std::string third = "w" + std::to_string((rank + 2) % 3);
      // The callee's user function runs inside the context, and so do the
      // calls it makes itself.
      EXPECT_EQ(rpc::rpcSync<contextHere>(other), id);
      EXPECT_EQ(rpc::rpcSync<contextVia>(other, third), id);
      // Another thread on the same agent is not in it, nor are its calls.
      std::thread([&] {
        rpc::CurrentAgentScope s(&g[rank]);
        EXPECT_EQ(dist::currentContextId(), 0u);
        EXPECT_EQ(rpc::rpcSync<contextHere>(other), 0u);
      }).join();
      EXPECT_NO_THROW(dist::getGradients(id));
    }
    EXPECT_EQ(dist::currentContextId(), 0u);
    // Released here at once (elsewhere asynchronously).
    EXPECT_THROW(dist::getGradients(id), trellis::NotFoundError);
  }
  EXPECT_TRUE(waitUntil([&] { return allReleased(g); }, 5s)) << liveCounts(g);
}

}  // namespace

// ---- misuse: one graph over two contexts; backward on another worker ------

TEST(DistAutograd, GraphSpanningTwoContextsAndForeignBackwardAreRefused) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor x = input(0.6);
  dist::Context outer(g[0]);
  at::Tensor fromOuter = rpc::rpcSync<hop>("w1", x, std::string());
  {
    dist::Context inner(g[0]);
    at::Tensor fromInner = rpc::rpcSync<hop>("w2", x, std::string());
    // The loss reaches a tensor received in `outer`: its gradient would go
    // to a send function of another context.
    try {
      inner.backward({(fromInner * fromOuter).sum()});
      ADD_FAILURE() << "backward across two contexts did not throw";
    } catch (const trellis::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("two distributed-autograd"),
                std::string::npos)
          << e.what();
    }
    // A failed backward releases the context: its gradients are gone.
    EXPECT_THROW(inner.gradients(), trellis::NotFoundError);
  }
  // The outer context still works.
  outer.backward({fromOuter.sum()});
  EXPECT_TRUE(gradientsOn(g[1], outer.id()).contains(param("w1")));
  // Only the creator runs a context's backward.
  rpc::CurrentAgentScope onW1(&g[1]);
  EXPECT_THROW(dist::backward(outer.id(), {fromOuter.sum()}),
               trellis::InvalidArgumentError);
}
