// DistributedOptimizer with three agents in one process ("w0" trains, "w1"
// and "w2" own layers; w0 owns a parameter too), over an in-memory store and
// real transport pipes. Every update is checked against the same model
// trained in one process with torch::optim.

#include <ATen/ATen.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include "../rpc/agent_group.h"
#include <trellis/core/error.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
#include <trellis/store/hash_store.h>

using namespace std::chrono_literals;
using trellis::Duration;
namespace rpc = trellis::rpc;
namespace dist = trellis::dist_autograd;

// ---- objects and functions the tests call ----------------------------------

// y = tanh(x @ w + b), held by its owner. `unused` is a parameter that never
// takes part in the forward pass, so it never has a gradient.
struct Layer {
  at::Tensor w, b, unused;

  at::Tensor forward(at::Tensor x) { return at::tanh(x.mm(w) + b); }
  // torch's [RRef(p) for p in module.parameters()].
  std::vector<rpc::RRef<at::Tensor>> parameters() {
    return dist::localParameters({w, b, unused});
  }
  // Copies of the current values.
  std::vector<at::Tensor> values() {
    return {w.detach().clone(), b.detach().clone(), unused.detach().clone()};
  }
  int64_t definedGrads() {
    return static_cast<int64_t>(w.grad().defined()) + b.grad().defined() +
           unused.grad().defined();
  }
};

std::shared_ptr<Layer> makeLayer(at::Tensor w, at::Tensor b) {
  auto l = std::make_shared<Layer>();
  l->w = w.clone().requires_grad_(true);
  l->b = b.clone().requires_grad_(true);
  l->unused = at::full({2}, 0.5, at::kDouble).requires_grad_(true);
  return l;
}

// An EmbeddingBag(sum, sparse=true) table: its gradient is sparse.
struct Table {
  at::Tensor weight;

  at::Tensor lookup(at::Tensor ids, at::Tensor offsets) {
    return std::get<0>(at::embedding_bag(weight, ids, offsets,
                                         /*scale_grad_by_freq=*/false,
                                         /*mode=*/0, /*sparse=*/true));
  }
  std::vector<rpc::RRef<at::Tensor>> parameters() {
    return dist::localParameters({weight});
  }
  at::Tensor value() { return weight.detach().clone(); }
  bool gradientIsSparse(uint64_t contextId) {
    return dist::getGradients(contextId).at(weight).is_sparse();
  }
  bool gradDefined() { return weight.grad().defined(); }
};

std::shared_ptr<Table> makeTable(at::Tensor weight) {
  auto t = std::make_shared<Table>();
  t->weight = weight.clone().requires_grad_(true);
  return t;
}

at::Tensor makeLongTensor() { return at::arange(4, at::kLong); }
at::Tensor failToMakeTensor() { throw std::runtime_error("no tensor for you"); }

// Objects by key on their owner (one process holds every worker), for
// tests that reach them without an RRef.
template <typename T>
class ByKey {
 public:
  explicit ByKey(std::string kind) : kind_(std::move(kind)) {}
  std::shared_ptr<T> at(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) {
      throw std::out_of_range("no " + kind_ + " " + key);
    }
    return it->second;
  }
  void put(std::string key, std::shared_ptr<T> object) {
    std::lock_guard<std::mutex> lock(mu_);
    objects_[std::move(key)] = std::move(object);
  }
  void drop(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    objects_.erase(key);
  }

 private:
  const std::string kind_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<T>> objects_;
};

// Layers, for a test where trainers on several workers use one layer.
ByKey<Layer> gLayers("layer");
std::shared_ptr<Layer> layerAt(const std::string& key) {
  return gLayers.at(key);
}
void addLayer(std::string key, at::Tensor w, at::Tensor b) {
  gLayers.put(std::move(key), makeLayer(std::move(w), std::move(b)));
}
void dropLayer(std::string key) { gLayers.drop(key); }
at::Tensor layerForward(std::string key, at::Tensor x) {
  return layerAt(key)->forward(std::move(x));
}
std::vector<rpc::RRef<at::Tensor>> layerParameters(std::string key) {
  return layerAt(key)->parameters();
}
std::vector<at::Tensor> layerValues(std::string key) {
  return layerAt(key)->values();
}

// Forward: the identity. Backward: says it started, then takes 300 ms.
std::atomic<bool> gSlowBackwardStarted{false};
struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*,
                            const at::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    gSlowBackwardStarted = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return g;
  }
};
at::Tensor slowLayerForward(std::string key, at::Tensor x) {
  return SlowBackward::apply(layerAt(key)->forward(std::move(x)));
}
// Inline (it runs on the callee's transport loop) and not step-safe, so a
// read of the layer in the caller's context. It sleeps there 600 ms, which
// an inline function must never do: the test needs the loop busy while a
// backward ends on a worker thread.
double inlineSlowRead(std::string key) {
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  return layerAt(key)->w.sum().item<double>();
}

// Tables, for OptimizerInBackward: the test makes the optimizer over the
// owner's very tensor, as a server does over its own.
ByKey<Table> gTables("table");
std::shared_ptr<Table> tableAt(const std::string& key) {
  return gTables.at(key);
}
void addTable(std::string key, at::Tensor weight) {
  gTables.put(std::move(key), makeTable(std::move(weight)));
}
void dropTable(std::string key) { gTables.drop(key); }
at::Tensor tableLookup(std::string key, at::Tensor ids, at::Tensor offsets) {
  return tableAt(key)->lookup(std::move(ids), std::move(offsets));
}
at::Tensor tableValue(std::string key) { return tableAt(key)->value(); }
// Whether `contextId` holds a gradient for the table here.
bool tableHasContextGradient(std::string key, uint64_t contextId) {
  return dist::getGradients(contextId).find(tableAt(key)->weight).defined();
}
// Read on the owner's threads: the test's own thread reaching into the
// tensor would race with the owner's later steps as far as ThreadSanitizer
// can see (the messages between them go through the kernel).
bool tableGradDefined(std::string key) { return tableAt(key)->gradDefined(); }

TRELLIS_REMOTE_FUNCTION(addTable);
TRELLIS_REMOTE_FUNCTION(tableLookup);
TRELLIS_REMOTE_FUNCTION(tableValue);
TRELLIS_REMOTE_FUNCTION(tableHasContextGradient);
TRELLIS_REMOTE_FUNCTION(tableGradDefined);
TRELLIS_REMOTE_FUNCTION(slowLayerForward);
TRELLIS_REMOTE_FUNCTION(inlineSlowRead);
TRELLIS_REMOTE_INLINE(inlineSlowRead);
TRELLIS_REMOTE_FUNCTION(makeLayer);
TRELLIS_REMOTE_FUNCTION(addLayer);
TRELLIS_REMOTE_FUNCTION(dropLayer);
TRELLIS_REMOTE_FUNCTION(layerForward);
TRELLIS_REMOTE_FUNCTION(layerParameters);
TRELLIS_REMOTE_FUNCTION(layerValues);
TRELLIS_REMOTE_FUNCTION(makeTable);
TRELLIS_REMOTE_FUNCTION(makeLongTensor);
TRELLIS_REMOTE_FUNCTION(failToMakeTensor);
TRELLIS_REMOTE_METHODS(Layer, forward, parameters, values, definedGrads);
TRELLIS_REMOTE_METHODS(Table, lookup, parameters, value, gradientIsSparse,
                       gradDefined);

namespace {

constexpr double kTol = 1e-9;

// Agents "w0".."w<n-1>" in this process; every call (backward's messages
// included) bounded at 30 s.
struct Group : rpc::testing::AgentGroup {
  explicit Group(int n) : AgentGroup(n, rpc::testing::callsBoundedBy(30s)) {}
};

bool waitUntil(const std::function<bool()>& pred, Duration limit = 20s) {
  return rpc::testing::waitUntil(pred, limit);
}

double maxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.detach() - b.detach()).abs().max().item<double>();
}

at::Tensor grid(int64_t rows, int64_t cols, double shift) {
  return at::linspace(-0.9 + shift, 0.8 + shift, rows * cols, at::kDouble)
      .reshape({rows, cols});
}

// The reference optimizer: torch::optim with the spec's options.
std::unique_ptr<torch::optim::Optimizer> localOptimizer(
    const dist::OptimizerSpec& spec, std::vector<at::Tensor> params) {
  if (const auto* s = std::get_if<dist::SGD>(&spec)) {
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(s->lr)
                                                   .momentum(s->momentum)
                                                   .dampening(s->dampening)
                                                   .weight_decay(s->weightDecay)
                                                   .nesterov(s->nesterov));
  }
  if (const auto* a = std::get_if<dist::Adagrad>(&spec)) {
    return std::make_unique<torch::optim::Adagrad>(
        params, torch::optim::AdagradOptions(a->lr)
                    .lr_decay(a->lrDecay)
                    .weight_decay(a->weightDecay)
                    .initial_accumulator_value(a->initialAccumulatorValue)
                    .eps(a->eps));
  }
  const auto& m = std::get<dist::Adam>(spec);
  return std::make_unique<torch::optim::Adam>(params,
                                              torch::optim::AdamOptions(m.lr)
                                                  .betas({m.beta1, m.beta2})
                                                  .eps(m.eps)
                                                  .weight_decay(m.weightDecay)
                                                  .amsgrad(m.amsgrad));
}

// ---- parity with torch::optim ----------------------------------------------

struct ParityCase {
  std::string name;
  dist::OptimizerSpec spec;
};
// Names the case in test listings (instead of its bytes).
void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

class OptimizerParity : public ::testing::TestWithParam<ParityCase> {};

// loss = sum((layer2(layer1(x) * m) - y)^2): layer1 on w1, layer2 on w2, the
// scale m between them on the trainer w0 (so the trainer owns a parameter,
// and w2's gradient goes through the trainer's own graph on its way to w1).
TEST_P(OptimizerParity, MatchesTorchOptimEveryStep) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor w1 = grid(3, 4, 0.0), b1 = grid(1, 4, 0.1).reshape({4});
  const at::Tensor w2 = grid(4, 2, -0.2), b2 = grid(1, 2, 0.3).reshape({2});
  at::Tensor m = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_(true);
  auto layer1 = rpc::remote<makeLayer>("w1", w1, b1);
  auto layer2 = rpc::remote<makeLayer>("w2", w2, b2);

  auto params = layer1.rpcSync<&Layer::parameters>();
  auto more = layer2.rpcSync<&Layer::parameters>();
  params.insert(params.end(), more.begin(), more.end());
  auto mine = dist::localParameters({m});
  params.insert(params.end(), mine.begin(), mine.end());
  dist::DistributedOptimizer opt(GetParam().spec, params, 30s);
  EXPECT_EQ(opt.numOwners(), 3u);

  // The same model in one process.
  std::vector<at::Tensor> ref = {
      w1.clone().requires_grad_(true),
      b1.clone().requires_grad_(true),
      at::full({2}, 0.5, at::kDouble).requires_grad_(true),
      w2.clone().requires_grad_(true),
      b2.clone().requires_grad_(true),
      at::full({2}, 0.5, at::kDouble).requires_grad_(true),
      m.detach().clone().requires_grad_(true)};
  auto refOpt = localOptimizer(GetParam().spec, ref);
  const at::Tensor unusedBefore = at::full({2}, 0.5, at::kDouble);

  for (int step = 0; step < 4; ++step) {
    const at::Tensor x = grid(5, 3, 0.05 * step);
    const at::Tensor y = grid(5, 2, -0.1 * step);
    {
      dist::Context ctx;
      at::Tensor h = layer1.rpcSync<&Layer::forward>(x);
      at::Tensor out = layer2.rpcSync<&Layer::forward>(h * m);
      at::Tensor loss = (out - y).pow(2).sum();
      ctx.backward({loss});
      opt.step(ctx);
    }
    refOpt->zero_grad();
    at::Tensor rh = at::tanh(x.mm(ref[0]) + ref[1]);
    at::Tensor rout = at::tanh((rh * ref[6]).mm(ref[3]) + ref[4]);
    (rout - y).pow(2).sum().backward();
    refOpt->step();

    auto v1 = layer1.rpcSync<&Layer::values>();
    auto v2 = layer2.rpcSync<&Layer::values>();
    const std::vector<at::Tensor> got = {v1[0], v1[1], v1[2], v2[0],
                                         v2[1], v2[2], m};
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(maxAbsDiff(got[i], ref[i]), kTol)
          << "step " << step << ", parameter " << i;
    }
    // The step really moved the parameters that had gradients...
    if (step == 0) {
      EXPECT_GT(maxAbsDiff(v1[0], w1), 1e-6);
      EXPECT_GT(maxAbsDiff(v2[1], b2), 1e-6);
    }
    // ... left the one without any as it was, and put .grad back.
    EXPECT_TRUE(v1[2].equal(unusedBefore));
    EXPECT_TRUE(v2[2].equal(unusedBefore));
    EXPECT_EQ(layer1.rpcSync<&Layer::definedGrads>(), 0);
    EXPECT_EQ(layer2.rpcSync<&Layer::definedGrads>(), 0);
    EXPECT_FALSE(m.grad().defined());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Specs, OptimizerParity,
    ::testing::Values(
        ParityCase{"SgdMomentumNesterovWeightDecay",
                   dist::SGD{.lr = 0.05,
                             .momentum = 0.9,
                             .weightDecay = 0.01,
                             .nesterov = true}},
        ParityCase{"SgdDampening",
                   dist::SGD{.lr = 0.1, .momentum = 0.5, .dampening = 0.2}},
        ParityCase{"Adagrad", dist::Adagrad{.lr = 0.1,
                                            .lrDecay = 0.01,
                                            .weightDecay = 0.02,
                                            .initialAccumulatorValue = 0.1}},
        ParityCase{"Adam", dist::Adam{.lr = 0.01, .weightDecay = 0.01}},
        ParityCase{"AdamAmsgrad",
                   dist::Adam{.lr = 0.02, .beta2 = 0.99, .amsgrad = true}}),
    [](const ::testing::TestParamInfo<ParityCase>& info) {
      return info.param.name;
    });

// ---- sparse gradients ------------------------------------------------------

class SparseParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(SparseParity, EmbeddingBagSparseGradients) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  auto table = rpc::remote<makeTable>("w1", weight);
  dist::DistributedOptimizer opt(GetParam().spec,
                                 table.rpcSync<&Table::parameters>(), 30s);
  at::Tensor ref = weight.clone().requires_grad_(true);
  auto refOpt = localOptimizer(GetParam().spec, {ref});
  for (int step = 0; step < 3; ++step) {
    // Rows 1, 4, 7 (twice) and 8; the other rows get no gradient.
    const at::Tensor ids = at::tensor({1, 4, 7, 7, 8}, at::kLong);
    const at::Tensor offsets = at::tensor({0, 2}, at::kLong);
    const at::Tensor c = grid(2, 3, 0.2 * step);
    {
      dist::Context ctx;
      at::Tensor rows = table.rpcSync<&Table::lookup>(ids, offsets);
      ctx.backward({(rows * c).tanh().sum()});
      EXPECT_TRUE(table.rpcSync<&Table::gradientIsSparse>(ctx.id()));
      opt.step(ctx);
    }
    refOpt->zero_grad();
    at::Tensor rrows = std::get<0>(
        at::embedding_bag(ref, ids, offsets, false, 0, /*sparse=*/true));
    (rrows * c).tanh().sum().backward();
    ASSERT_TRUE(ref.grad().is_sparse());
    refOpt->step();
    at::Tensor got = table.rpcSync<&Table::value>();
    EXPECT_LE(maxAbsDiff(got, ref), kTol) << "step " << step;
    EXPECT_GT(maxAbsDiff(got, weight), 1e-6);
    EXPECT_TRUE(got[0].equal(weight[0]));  // never looked up
    EXPECT_FALSE(table.rpcSync<&Table::gradDefined>());
  }
}

// The optimizers torch::optim runs with sparse gradients.
auto sparseSpecs() {
  return ::testing::Values(
      ParityCase{"Sgd", dist::SGD{.lr = 0.3}},
      ParityCase{"Adagrad", dist::Adagrad{.lr = 0.2, .lrDecay = 0.05}});
}
std::string caseName(const ::testing::TestParamInfo<ParityCase>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Specs, SparseParity, sparseSpecs(), caseName);

// ---- parameters without gradients ------------------------------------------

// The context reaches w1 only: w2 never hears of it, and its parameters are
// left exactly as they were (as is w1's unused one).
TEST(DistributedOptimizer, ParametersWithoutGradientAreUnchanged) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  auto layer1 = rpc::remote<makeLayer>("w1", grid(3, 4, 0), grid(1, 4, 0.1));
  auto layer2 = rpc::remote<makeLayer>("w2", grid(4, 2, 0), grid(1, 2, 0.1));
  auto params = layer1.rpcSync<&Layer::parameters>();
  auto more = layer2.rpcSync<&Layer::parameters>();
  params.insert(params.end(), more.begin(), more.end());
  dist::DistributedOptimizer opt(dist::Adam{.lr = 0.1}, params, 30s);
  const auto before1 = layer1.rpcSync<&Layer::values>();
  const auto before2 = layer2.rpcSync<&Layer::values>();
  {
    dist::Context ctx;
    at::Tensor h = layer1.rpcSync<&Layer::forward>(grid(2, 3, 0.3));
    ctx.backward({h.sum()});
    opt.step(ctx);
  }
  const auto after1 = layer1.rpcSync<&Layer::values>();
  const auto after2 = layer2.rpcSync<&Layer::values>();
  EXPECT_GT(maxAbsDiff(after1[0], before1[0]), 1e-6);
  EXPECT_GT(maxAbsDiff(after1[1], before1[1]), 1e-6);
  EXPECT_TRUE(after1[2].equal(before1[2]));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(after2[i].equal(before2[i])) << i;
  }
  // A context with no gradient anywhere (no backward) changes nothing.
  {
    dist::Context ctx;
    (void)layer1.rpcSync<&Layer::forward>(grid(2, 3, 0.3));
    opt.step(ctx);
  }
  const auto again1 = layer1.rpcSync<&Layer::values>();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(again1[i].equal(after1[i])) << i;
  }
  EXPECT_EQ(layer1.rpcSync<&Layer::definedGrads>(), 0);
}

// ---- concurrent steps ------------------------------------------------------

// Two threads on w0 share one optimizer, a third on w2 has its own over the
// same parameters (the layer "shared" on w1). Each computes its gradients in
// its own context at the initial parameters; then all step at once. Plain
// SGD is additive, so in any order the result is p0 - lr * (g1 + g2 + g3).
TEST(DistributedOptimizer, ConcurrentStepsApplyEveryGradientSet) {
  Group g(3);
  const double lr = 0.1;
  const at::Tensor w = grid(3, 4, 0.0), b = grid(1, 4, 0.1).reshape({4});
  std::vector<rpc::RRef<at::Tensor>> params0, params2;
  {
    rpc::CurrentAgentScope scope(&g[0]);
    rpc::rpcSync<addLayer>("w1", std::string("shared"), w, b);
    params0 = rpc::rpcSync<layerParameters>("w1", std::string("shared"));
  }
  {
    rpc::CurrentAgentScope scope(&g[2]);
    params2 = rpc::rpcSync<layerParameters>("w1", std::string("shared"));
  }
  auto opt0 = std::make_unique<dist::DistributedOptimizer>(dist::SGD{.lr = lr},
                                                           params0, 30s);
  auto opt2 = std::make_unique<dist::DistributedOptimizer>(dist::SGD{.lr = lr},
                                                           params2, 30s);

  struct Trainer {
    rpc::Agent* agent;
    dist::DistributedOptimizer* opt;
    at::Tensor x;
    std::string failure;
  };
  std::vector<Trainer> trainers = {{&g[0], opt0.get(), grid(2, 3, 0.1), ""},
                                   {&g[0], opt0.get(), grid(4, 3, -0.3), ""},
                                   {&g[2], opt2.get(), grid(3, 3, 0.4), ""}};
  std::atomic<int> arrived{0};
  std::vector<std::thread> threads;
  for (auto& t : trainers) {
    threads.emplace_back([&t, &arrived, n = trainers.size()] {
      try {
        rpc::CurrentAgentScope scope(t.agent);
        dist::Context ctx;
        at::Tensor h =
            rpc::rpcSync<layerForward>("w1", std::string("shared"), t.x);
        ctx.backward({(h * h).sum()});
        ++arrived;
        if (!waitUntil([&] { return arrived.load() == int(n); })) {
          t.failure = "the other trainers did not finish backward";
          return;
        }
        t.opt->step(ctx.id());
      } catch (const std::exception& e) {
        t.failure = e.what();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (const auto& t : trainers) {
    EXPECT_EQ(t.failure, "");
  }

  at::Tensor rw = w.clone().requires_grad_(true);
  at::Tensor rb = b.clone().requires_grad_(true);
  for (const auto& t : trainers) {
    at::Tensor h = at::tanh(t.x.mm(rw) + rb);
    (h * h).sum().backward();  // sums the three gradient sets in .grad
  }
  rpc::CurrentAgentScope scope(&g[0]);
  auto got = rpc::rpcSync<layerValues>("w1", std::string("shared"));
  EXPECT_LE(maxAbsDiff(got[0], w - lr * rw.grad()), kTol);
  EXPECT_LE(maxAbsDiff(got[1], b - lr * rb.grad()), kTol);
  EXPECT_GT(maxAbsDiff(got[0], w), 1e-6);
  opt0.reset();
  opt2.reset();
  rpc::rpcSync<dropLayer>("w1", std::string("shared"));
}

// A step held for another context's readers runs on a worker thread even
// when the last read ends on the transport loop (an inline function's
// reply): on the loop it would stall every pipe (the step checks this and
// aborts there). Context 1 reads the layer on w1 (its forward's reply
// awaits a gradient) and makes an inline call while its backward runs on
// a worker of w1; context 2's step, held meanwhile, goes through when the
// inline call replies, on w1's loop.
TEST(DistributedOptimizer, AHeldStepLetThroughOnTheLoopRunsOnAWorker) {
  Group g(3);
  const double lr = 0.1;
  const at::Tensor w = grid(3, 4, 0.0), b = grid(1, 4, 0.1).reshape({4});
  std::vector<rpc::RRef<at::Tensor>> params;
  {
    rpc::CurrentAgentScope scope(&g[2]);
    rpc::rpcSync<addLayer>("w1", std::string("held"), w, b);
    params = rpc::rpcSync<layerParameters>("w1", std::string("held"));
  }
  auto opt = std::make_unique<dist::DistributedOptimizer>(dist::SGD{.lr = lr},
                                                          params, 30s);
  gSlowBackwardStarted = false;
  const at::Tensor x1 = grid(2, 3, 0.2), x2 = grid(2, 3, -0.1);

  // Context 1 on w0: its forward makes it a reader of the layer on w1.
  rpc::CurrentAgentScope scope0(&g[0]);
  dist::Context ctx1;
  at::Tensor h1 = rpc::rpcSync<slowLayerForward>("w1", std::string("held"), x1);

  // Context 2 on w2: forward, backward, then the step, which waits on w1
  // for context 1's readers.
  std::string stepFailure;
  std::atomic<bool> stepping{false}, stepped{false};
  std::thread trainer2([&] {
    try {
      rpc::CurrentAgentScope scope(&g[2]);
      dist::Context ctx2;
      at::Tensor h2 = rpc::rpcSync<layerForward>("w1", std::string("held"), x2);
      ctx2.backward({(h2 * h2).sum()});
      stepping = true;
      opt->step(ctx2.id());
      stepped = true;
    } catch (const std::exception& e) {
      stepFailure = e.what();
    }
  });
  ASSERT_TRUE(waitUntil([&] {
    return stepping.load() || !stepFailure.empty();
  })) << "trainer 2 did not get to its step";
  std::this_thread::sleep_for(200ms);  // its step reaches w1 and waits there
  EXPECT_FALSE(stepped.load()) << "the step did not wait for context 1";

  // Context 1's backward: 300 ms on a worker of w1. Meanwhile an inline
  // call of context 1 (admitted: the context reads already) holds w1's
  // loop; the backward ends first, so the inline call's reply ends the
  // context's reading, on the loop.
  std::thread backward1([&] { ctx1.backward({(h1 * h1).sum()}); });
  ASSERT_TRUE(waitUntil([] { return gSlowBackwardStarted.load(); }));
  double read = 0;
  {
    rpc::AutogradContextScope inCtx1(ctx1.id());
    read = rpc::rpcSync<inlineSlowRead>("w1", std::string("held"));
  }
  backward1.join();
  trainer2.join();
  EXPECT_EQ(stepFailure, "");
  EXPECT_TRUE(stepped.load());
  EXPECT_NEAR(read, w.sum().item<double>(), kTol);  // read before the step

  // Only context 2's gradient was applied.
  at::Tensor rw = w.clone().requires_grad_(true);
  at::Tensor rb = b.clone().requires_grad_(true);
  at::Tensor rh = at::tanh(x2.mm(rw) + rb);
  (rh * rh).sum().backward();
  auto got = rpc::rpcSync<layerValues>("w1", std::string("held"));
  EXPECT_LE(maxAbsDiff(got[0], w - lr * rw.grad()), kTol);
  EXPECT_LE(maxAbsDiff(got[1], b - lr * rb.grad()), kTol);
  opt.reset();
  rpc::rpcSync<dropLayer>("w1", std::string("held"));
}

// ---- errors ----------------------------------------------------------------

// An owner that cannot build its optimizer makes the constructor throw
// that owner's error, naming it.
TEST(DistributedOptimizer, OwnerFailureSurfacesFromConstructorNamingIt) {
  Group g(3);
  rpc::CurrentAgentScope scope(&g[0]);
  auto layer = rpc::remote<makeLayer>("w1", grid(3, 4, 0), grid(1, 4, 0.1));
  auto params = layer.rpcSync<&Layer::parameters>();

  // w2 holds an integer tensor: no optimizer can step it.
  auto withLong = params;
  withLong.push_back(rpc::remote<makeLongTensor>("w2"));
  try {
    dist::DistributedOptimizer opt(dist::SGD{}, withLong, 30s);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.origin().worker, "w2");
    const std::string what = e.what();
    EXPECT_NE(what.find("on 'w2'"), std::string::npos) << what;
    EXPECT_NE(what.find("Long"), std::string::npos) << what;
  }

  // A parameter whose remote() failed on w1: w1 answers with that error.
  auto withFailed = params;
  withFailed.push_back(rpc::remote<failToMakeTensor>("w1"));
  try {
    dist::DistributedOptimizer opt(dist::Adam{}, withFailed, 30s);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.origin().worker, "w1");
    const std::string what = e.what();
    EXPECT_NE(what.find("on 'w1'"), std::string::npos) << what;
    EXPECT_NE(what.find("no tensor for you"), std::string::npos) << what;
  }

  // Bad options are torch::optim's own checks, on the owner.
  EXPECT_THROW(
      dist::DistributedOptimizer(dist::SGD{.nesterov = true}, params, 30s),
      trellis::RemoteError);
  EXPECT_THROW(dist::DistributedOptimizer(dist::SGD{}, {}, 30s),
               trellis::InvalidArgumentError);
  auto twice = params;
  twice.push_back(params[0]);
  EXPECT_THROW(dist::DistributedOptimizer(dist::SGD{}, twice, 30s),
               trellis::RemoteError);

  // The good parameters alone work.
  dist::DistributedOptimizer opt(dist::SGD{}, params, 30s);
  EXPECT_EQ(opt.numOwners(), 1u);
}

// A step that fails on an owner (Adagrad's weight decay does not take
// sparse gradients) throws naming it, and leaves .grad and the value as
// they were.
TEST(DistributedOptimizer, StepFailureNamesTheOwnerAndRestoresGrad) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  auto table = rpc::remote<makeTable>("w1", weight);
  dist::DistributedOptimizer opt(dist::Adagrad{.weightDecay = 0.1},
                                 table.rpcSync<&Table::parameters>(), 30s);
  dist::Context ctx;
  at::Tensor rows = table.rpcSync<&Table::lookup>(at::tensor({1, 2}, at::kLong),
                                                  at::tensor({0}, at::kLong));
  ctx.backward({rows.sum()});
  try {
    opt.step(ctx);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    EXPECT_EQ(e.origin().worker, "w1");
    const std::string what = e.what();
    EXPECT_NE(what.find("step on 'w1'"), std::string::npos) << what;
    EXPECT_NE(what.find("sparse"), std::string::npos) << what;
  }
  EXPECT_FALSE(table.rpcSync<&Table::gradDefined>());
  EXPECT_TRUE(table.rpcSync<&Table::value>().equal(weight));
}

// The caller's own parameters step on the calling thread, not by an RPC to
// itself; the same failure there throws naming this worker and leaves
// .grad and the value as they were, and the remote owner's step, sent
// first, still happens.
TEST(DistributedOptimizer, OwnStepRunsHereAndItsFailureNamesThisWorker) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  auto mine = makeTable(weight);
  auto layer = rpc::remote<makeLayer>("w1", grid(3, 4, 0), grid(1, 4, 0.1));
  auto params = layer.rpcSync<&Layer::parameters>();
  auto own = mine->parameters();
  params.insert(params.end(), own.begin(), own.end());
  dist::DistributedOptimizer opt(dist::Adagrad{.weightDecay = 0.1}, params,
                                 30s);
  const auto before = layer.rpcSync<&Layer::values>();
  dist::Context ctx;
  at::Tensor h = layer.rpcSync<&Layer::forward>(grid(2, 3, 0.3));
  at::Tensor rows =
      mine->lookup(at::tensor({1, 2}, at::kLong), at::tensor({0}, at::kLong));
  ctx.backward({h.sum() + rows.sum()});
  try {
    opt.step(ctx);
    FAIL() << "no exception";
  } catch (const trellis::RemoteError& e) {
    FAIL() << "the own step went through an RPC to itself: " << e.what();
  } catch (const trellis::Exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("step on 'w0'"), std::string::npos) << what;
    EXPECT_NE(what.find("sparse"), std::string::npos) << what;
  }
  EXPECT_FALSE(mine->weight.grad().defined());
  EXPECT_TRUE(mine->weight.detach().equal(weight));
  // w1's step (dense gradients take weight decay) was sent first and goes
  // through; step() threw at the first error without waiting for it.
  const auto until = std::chrono::steady_clock::now() + 10s;
  double moved = 0;
  while (moved <= 1e-6 && std::chrono::steady_clock::now() < until) {
    moved = maxAbsDiff(layer.rpcSync<&Layer::values>()[0], before[0]);
    if (moved <= 1e-6) {
      std::this_thread::sleep_for(10ms);
    }
  }
  EXPECT_GT(moved, 1e-6);
}

// stateDict / loadStateDict: the first optimizer's state (Adam moments on
// the remote owner and here), loaded into a second one over a copy of the
// parameters, makes it take exactly the first one's next step (and not the
// step of a fresh Adam); a state of the wrong length or shapes is refused.
TEST(DistributedOptimizer, StateDictRestoresEveryOwnersState) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const dist::Adam spec{.lr = 0.05};
  struct Model {
    rpc::RRef<Layer> layer;
    at::Tensor m;
    std::vector<rpc::RRef<at::Tensor>> params() {
      auto p = layer.rpcSync<&Layer::parameters>();
      auto mine = dist::localParameters({m});
      p.insert(p.end(), mine.begin(), mine.end());
      return p;
    }
  };
  auto makeModel = [](const at::Tensor& w, const at::Tensor& b,
                      const at::Tensor& m) {
    return Model{rpc::remote<makeLayer>("w1", w, b),
                 m.detach().clone().requires_grad_(true)};
  };
  auto stepOnce = [](Model& model, dist::DistributedOptimizer& opt, int k) {
    dist::Context ctx;
    at::Tensor out =
        model.layer.rpcSync<&Layer::forward>(grid(5, 3, 0.1 * k)) * model.m;
    ctx.backward({out.pow(2).sum()});
    opt.step(ctx);
  };
  Model a = makeModel(grid(3, 4, 0.0), grid(1, 4, 0.1).reshape({4}),
                      at::linspace(0.5, 1.5, 4, at::kDouble));
  dist::DistributedOptimizer first(spec, a.params(), 30s);
  stepOnce(a, first, 0);
  stepOnce(a, first, 1);
  const std::vector<std::string> state = first.stateDict();
  ASSERT_EQ(state.size(), 2u);

  // Copies of a's current values: b with a's state loaded, c without.
  auto now = a.layer.rpcSync<&Layer::values>();
  Model b = makeModel(now[0], now[1], a.m);
  Model c = makeModel(now[0], now[1], a.m);
  dist::DistributedOptimizer second(spec, b.params(), 30s);
  dist::DistributedOptimizer fresh(spec, c.params(), 30s);
  second.loadStateDict(state);
  stepOnce(a, first, 2);
  stepOnce(b, second, 2);
  stepOnce(c, fresh, 2);
  auto va = a.layer.rpcSync<&Layer::values>();
  auto vb = b.layer.rpcSync<&Layer::values>();
  auto vc = c.layer.rpcSync<&Layer::values>();
  EXPECT_TRUE(va[0].equal(vb[0]));
  EXPECT_TRUE(va[1].equal(vb[1]));
  EXPECT_TRUE(a.m.equal(b.m));
  EXPECT_GT(maxAbsDiff(va[0], vc[0]), 1e-6);  // the state mattered
  EXPECT_GT(maxAbsDiff(a.m, c.m), 1e-6);

  EXPECT_THROW(second.loadStateDict({state[0]}), trellis::InvalidArgumentError);
  try {
    second.loadStateDict({state[1], state[0]});  // swapped: shapes differ
    FAIL() << "a swapped state loaded";
  } catch (const trellis::Exception& e) {
    EXPECT_NE(std::string(e.what()).find("does not load"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("'w"), std::string::npos) << e.what();
  }
  try {
    second.loadStateDict({std::string("not an archive"), state[1]});
    FAIL() << "garbage loaded";
  } catch (const trellis::Exception& e) {
    EXPECT_NE(std::string(e.what()).find("does not load"), std::string::npos)
        << e.what();
  }

  // Truncated or corrupted states (both owners': the remote one and this
  // worker's own) are refused by their checksum before libtorch's archive
  // reader sees them: that reader crashes the process on some corrupted
  // archives (a bit flip in its TorchScript code), which this loop hit
  // within a few hundred tries before states were sealed. Afterwards both
  // owners still load the true state.
  std::mt19937_64 rng(20261126);
  for (int i = 0; i < 300; ++i) {
    const size_t owner = static_cast<size_t>(i % 2);
    std::string bad = state[owner];
    switch (rng() % 3) {
      case 0:  // truncated
        bad.resize(rng() % bad.size());
        break;
      case 1:  // a few bits flipped anywhere
        for (int k = 0; k < 1 + static_cast<int>(rng() % 8); ++k) {
          bad[rng() % bad.size()] ^= static_cast<char>(1 << (rng() % 8));
        }
        break;
      default:  // a run of random bytes
        for (size_t at = rng() % bad.size(), k = 0;
             k < 64 && at + k < bad.size(); ++k) {
          bad[at + k] = static_cast<char>(rng());
        }
    }
    if (bad == state[owner]) {
      continue;
    }
    std::vector<std::string> parts = state;
    parts[owner] = bad;
    try {
      second.loadStateDict(parts);
      FAIL() << "a corrupted state loaded (try " << i << ")";
    } catch (const trellis::Exception& e) {
      EXPECT_NE(std::string(e.what()).find("does not load"), std::string::npos)
          << e.what();
    }
  }
  second.loadStateDict(state);
}

// ---- OptimizerInBackward ----------------------------------------------------

// A table on w1 (key "t"), removed at the end of the test.
struct KeyedTable {
  explicit KeyedTable(const at::Tensor& weight) {
    rpc::rpcSync<addTable>("w1", std::string("t"), weight);
  }
  ~KeyedTable() { dropTable("t"); }
  at::Tensor& weight() { return tableAt("t")->weight; }
};

// One step's lookup on w1 and its backward, in a context of its own; the
// context's id.
uint64_t lookupAndBackward(const at::Tensor& ids, const at::Tensor& offsets,
                           const at::Tensor& c) {
  dist::Context ctx;
  at::Tensor rows =
      rpc::rpcSync<tableLookup>("w1", std::string("t"), ids, offsets);
  ctx.backward({(rows * c).tanh().sum()});
  return ctx.id();
}

class InBackwardParity : public ::testing::TestWithParam<ParityCase> {};

// The table's owner steps it inside each backward: when ctx.backward()
// returns, the table equals torch::optim's after the same gradients, and
// the context holds no gradient for it.
TEST_P(InBackwardParity, StepsWithinTheBackwardLikeTorchOptim) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  KeyedTable table(weight);
  dist::OptimizerInBackward inBackward(GetParam().spec, {table.weight()});
  at::Tensor ref = weight.clone().requires_grad_(true);
  auto refOpt = localOptimizer(GetParam().spec, {ref});
  for (int step = 0; step < 3; ++step) {
    const at::Tensor ids = at::tensor({1, 4, 7, 7, 8}, at::kLong);
    const at::Tensor offsets = at::tensor({0, 2}, at::kLong);
    const at::Tensor c = grid(2, 3, 0.2 * step);
    {
      dist::Context ctx;
      at::Tensor rows =
          rpc::rpcSync<tableLookup>("w1", std::string("t"), ids, offsets);
      ctx.backward({(rows * c).tanh().sum()});
      // Applied already, and nothing left in the context.
      refOpt->zero_grad();
      at::Tensor rrows = std::get<0>(
          at::embedding_bag(ref, ids, offsets, false, 0, /*sparse=*/true));
      (rrows * c).tanh().sum().backward();
      refOpt->step();
      at::Tensor got = rpc::rpcSync<tableValue>("w1", std::string("t"));
      EXPECT_LE(maxAbsDiff(got, ref), kTol) << "step " << step;
      EXPECT_GT(maxAbsDiff(got, weight), 1e-6);
      EXPECT_TRUE(got[0].equal(weight[0]));  // never looked up
      EXPECT_FALSE(rpc::rpcSync<tableHasContextGradient>("w1", std::string("t"),
                                                         ctx.id()));
    }
    EXPECT_FALSE(rpc::rpcSync<tableGradDefined>("w1", std::string("t")));
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, InBackwardParity, sparseSpecs(), caseName);

// Dense parameters on the context's creator step in its own part of the
// backward, on the calling thread; the rest of the model goes on with a
// DistributedOptimizer, which refuses the in-backward parameters.
TEST(OptimizerInBackward, TheCreatorsOwnParametersAndADistributedOptimizer) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const dist::SGD spec{.lr = 0.1, .momentum = 0.9};
  auto layer = rpc::remote<makeLayer>("w1", grid(3, 4, 0.0),
                                      grid(1, 4, 0.1).reshape({4}));
  at::Tensor m = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_(true);
  at::Tensor refM = m.detach().clone().requires_grad_(true);
  auto refOpt = localOptimizer(spec, {refM});
  dist::OptimizerInBackward inBackward(spec, {m});
  try {
    dist::DistributedOptimizer both(spec, dist::localParameters({m}), 30s);
    FAIL() << "a DistributedOptimizer took an in-backward parameter";
  } catch (const trellis::Exception& e) {
    EXPECT_NE(std::string(e.what()).find("stepped in the backward pass"),
              std::string::npos)
        << e.what();
  }
  dist::DistributedOptimizer rest(spec, layer.rpcSync<&Layer::parameters>(),
                                  30s);
  for (int k = 0; k < 3; ++k) {
    const at::Tensor x = grid(5, 3, 0.1 * k);
    at::Tensor before = layer.rpcSync<&Layer::values>()[0];
    {
      dist::Context ctx;
      at::Tensor out = layer.rpcSync<&Layer::forward>(x) * m;
      ctx.backward({out.pow(2).sum()});
      EXPECT_FALSE(dist::getGradients(ctx.id()).find(m).defined());
      // The reference: the same gradient for m, from the layer's output.
      at::Tensor y = layer.rpcSync<&Layer::forward>(x).detach();
      refOpt->zero_grad();
      (y * refM).pow(2).sum().backward();
      refOpt->step();
      EXPECT_LE(maxAbsDiff(m, refM), kTol) << "step " << k;
      rest.step(ctx);
    }
    EXPECT_GT(maxAbsDiff(layer.rpcSync<&Layer::values>()[0], before), 1e-9);
  }
}

// What the step throws fails the backward, naming the owner; the table is
// unchanged. torch::optim::Adagrad refuses weight decay with a sparse
// gradient.
TEST(OptimizerInBackward, AFailingStepFailsTheBackwardNamingTheOwner) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  KeyedTable table(weight);
  dist::OptimizerInBackward inBackward(dist::Adagrad{.weightDecay = 0.1},
                                       {table.weight()});
  try {
    lookupAndBackward(at::tensor({1, 2}, at::kLong), at::tensor({0}, at::kLong),
                      grid(1, 3, 0.0));
    FAIL() << "no exception";
  } catch (const trellis::Exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("backward on worker 'w1'"), std::string::npos) << what;
    EXPECT_NE(what.find("sparse"), std::string::npos) << what;
  }
  EXPECT_TRUE(rpc::rpcSync<tableValue>("w1", std::string("t")).equal(weight));
  EXPECT_FALSE(rpc::rpcSync<tableGradDefined>("w1", std::string("t")));
}

// The step waits for another context that still reads on the owner (its
// lookup is not step-safe and its backward has not run): bounded, it
// fails that backward naming the context it waited for and changes
// nothing; when the other context's backward comes, the waiting step goes
// through after it.
TEST(OptimizerInBackward, TheStepWaitsForOtherContextsReadsBounded) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor weight = grid(10, 3, 0.0);
  KeyedTable table(weight);
  dist::OptimizerInBackward inBackward(dist::SGD{.lr = 0.1}, {table.weight()},
                                       400ms);
  const at::Tensor ids = at::tensor({1, 2}, at::kLong);
  const at::Tensor offsets = at::tensor({0}, at::kLong);
  const at::Tensor c = grid(1, 3, 0.0);
  // Current on this thread (the contexts below nest inside it).
  auto reader = std::make_unique<dist::Context>();
  at::Tensor held =
      rpc::rpcSync<tableLookup>("w1", std::string("t"), ids, offsets);
  const std::string readerName = std::to_string(reader->id());
  const auto t0 = std::chrono::steady_clock::now();
  try {
    lookupAndBackward(ids, offsets, c);
    FAIL() << "the step did not wait for the reading context";
  } catch (const trellis::Exception& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.error().code(), trellis::Code::kDeadlineExceeded) << what;
    EXPECT_NE(what.find("in-backward step"), std::string::npos) << what;
    EXPECT_NE(what.find(readerName), std::string::npos) << what;
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  EXPECT_TRUE(rpc::rpcSync<tableValue>("w1", std::string("t")).equal(weight));

  // Again, and the reader's backward ends its read while the step waits.
  std::atomic<bool> done{false};
  std::thread other([&] {
    rpc::CurrentAgentScope s(&g[0]);
    lookupAndBackward(ids, offsets, c);
    done = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load());
  reader->backward({held.sum()});
  other.join();
  EXPECT_TRUE(done.load());
  // Both steps applied: the reader's gradient (ones) and the other's.
  EXPECT_GT(
      maxAbsDiff(rpc::rpcSync<tableValue>("w1", std::string("t")), weight),
      1e-6);
  reader.reset();
}

// The constructor's refusals, and the state for checkpoints.
TEST(OptimizerInBackward, RefusesBadParametersAndRestoresItsState) {
  Group g(2);
  rpc::CurrentAgentScope scope(&g[0]);
  const dist::Adagrad spec{.lr = 0.2};
  at::Tensor p = grid(4, 3, 0.0).requires_grad_(true);
  EXPECT_THROW(dist::OptimizerInBackward(spec, {}),
               trellis::InvalidArgumentError);
  EXPECT_THROW(dist::OptimizerInBackward(spec, {at::arange(3, at::kLong)}),
               trellis::InvalidArgumentError);
  EXPECT_THROW(dist::OptimizerInBackward(spec, {grid(2, 2, 0.0)}),
               trellis::InvalidArgumentError);  // no requires_grad
  EXPECT_THROW(dist::OptimizerInBackward(spec, {p, p}),
               trellis::InvalidArgumentError);
  EXPECT_THROW(dist::OptimizerInBackward(spec, {p}, -1s),
               trellis::InvalidArgumentError);
  EXPECT_THROW(dist::OptimizerInBackward(dist::Adagrad{.lr = -1}, {p}),
               trellis::InvalidArgumentError);
  {
    dist::OptimizerInBackward first(spec, {p});
    try {
      dist::OptimizerInBackward second(spec, {p});
      FAIL() << "two in-backward optimizers over one tensor";
    } catch (const trellis::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("already belongs"),
                std::string::npos)
          << e.what();
    }
  }
  // Gone with its owner: the tensor is free again.
  dist::OptimizerInBackward again(spec, {p});

  // stateDict/loadStateDict: a copy with the state loaded steps exactly as
  // the original; without it, differently.
  const at::Tensor weight = grid(10, 3, 0.0);
  const at::Tensor ids = at::tensor({1, 4, 7}, at::kLong);
  const at::Tensor offsets = at::tensor({0}, at::kLong);
  std::string state;
  at::Tensor afterTwo, afterThree;
  {
    KeyedTable table(weight);
    dist::OptimizerInBackward opt(spec, {table.weight()});
    lookupAndBackward(ids, offsets, grid(1, 3, 0.0));
    lookupAndBackward(ids, offsets, grid(1, 3, 0.3));
    state = opt.stateDict();
    afterTwo = rpc::rpcSync<tableValue>("w1", std::string("t"));
    lookupAndBackward(ids, offsets, grid(1, 3, 0.6));
    afterThree = rpc::rpcSync<tableValue>("w1", std::string("t"));
  }
  for (const bool load : {true, false}) {
    KeyedTable table(afterTwo);
    dist::OptimizerInBackward opt(spec, {table.weight()});
    if (load) {
      opt.loadStateDict(state);
    }
    lookupAndBackward(ids, offsets, grid(1, 3, 0.6));
    const double diff = maxAbsDiff(
        rpc::rpcSync<tableValue>("w1", std::string("t")), afterThree);
    if (load) {
      EXPECT_EQ(diff, 0.0);
    } else {
      EXPECT_GT(diff, 1e-6);  // the state mattered
    }
    std::string bad = state;
    bad[bad.size() / 2] ^= 0x10;
    try {
      opt.loadStateDict(bad);
      FAIL() << "a corrupted state loaded";
    } catch (const trellis::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("does not load"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
