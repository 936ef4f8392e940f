// Hybrid DDP + RPC training, DLRM-shaped (docs/examples.md): the main job.
//
//   elastic-run --standalone --nproc-per-node 4 --max-restarts 1
//       hybrid_training --fail-at-step 120   (one command line)
//
// Roles come from the rank: ranks 0 .. S-1 are parameter servers (S =
// --servers), the others trainers. Every embedding table is split by rows
// over the servers (row r of a table lives on server r % S, as its row
// r / S); each server stacks its rows of every table in one weight (table
// batching), an object that trainers reach through an RRef. A trainer's
// step, inside one distributed-autograd context: one bag lookup per
// server, covering every table (RRef method calls, all in flight at once;
// sum-mode bags, so the servers' partial sums add up to the bag), the
// dense part (a bottom MLP for the dense features, DLRM's pairwise
// dot-product interaction, a top MLP) replicated over the trainers with
// DDP, ctx.backward() (the tables' gradients go to the servers over RPC,
// where each server steps its rows with sparse Adagrad inside the
// backward, as TorchRec's fused optimizers do: OptimizerInBackward; the
// dense part's gradients are averaged by DDP into the context), and one
// DistributedOptimizer step: Adagrad on each trainer for its replica of
// the dense part.
//
// Fault tolerance: every --checkpoint-every steps the group checkpoints
// (servers: their rows and their Adagrad state; then trainer 0: the dense
// part and its optimizer state, the same on every trainer). --fail-at-step
// S makes the last trainer exit abnormally at step S of the first attempt;
// elastic-run restarts the group, which resumes from the newest checkpoint
// that is whole on every rank (a damaged one is skipped, saying why), with
// any number of trainers: one that joins on a scale-up takes the common
// dense part. The number of servers must stay the same (the rows are
// sharded by it). The data are a deterministic function of (seed, trainer,
// step), so a resumed run trains on what an undisturbed one would have.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "cli_checks.h"
#include "click_data.h"
#include "dlrm.h"
#include "row_shards.h"
#include "server_shard.h"
#include <trellis/core/text.h>
#include <trellis/trellis.h>

namespace rpc = trellis::rpc;
namespace da = trellis::dist_autograd;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using trellis::examples::auc;
using trellis::examples::ClickWorld;
using trellis::examples::DenseNet;
using trellis::examples::DenseNetImpl;
using trellis::examples::shardRows;

namespace {

struct Flags {
  int64_t steps = 1000;
  int64_t batch = 64;  // samples per trainer and step
  int64_t servers = 2;
  int64_t tables = 3;
  int64_t rows = 20000;  // per table
  int64_t dim = 16;
  int64_t denseFeatures = 4;
  double lr = 0.1;
  int64_t logEvery = 100;
  int64_t evalSamples = 4096;
  int64_t checkpointEvery = 50;
  std::string checkpointDir;  // default: <tmp>/trellis-hybrid/<run id>
  int64_t failAtStep = -1;
  bool checkConsistency = false;
  double minAuc = 0.7;
  double weightStd = 0.4;
  double zipf = 1.1;
  int64_t seed = 1234;
  double timeoutS = 60;
};

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::mutex gShardMu;
std::shared_ptr<ServerShard> gShard;  // this server's, built at startup
}  // namespace

// This server's rows of the tables.
std::shared_ptr<ServerShard> serverShard() {
  std::lock_guard<std::mutex> lock(gShardMu);
  if (!gShard) {
    throw std::logic_error("this process holds no rows of the tables");
  }
  return gShard;
}

TRELLIS_REMOTE_FUNCTION(serverShard);
TRELLIS_REMOTE_METHODS(ServerShard, lookup, save, restore);
// A lookup is a bounds check and one embedding_bag over a few hundred rows
// (tens of microseconds, no waits; its lock is held by stats() alone, after
// training): it runs on the server's transport loop, without a hand-off to
// a worker thread and back (docs/rpc.md, "Inline functions"). Its graph
// keeps no copy of the table (sum-mode bags, no per-sample weights), so it
// is step-safe: another trainer's step may update the table before this
// lookup's backward (docs/dist_autograd.md, "Step-safe functions").
TRELLIS_REMOTE_INLINE(ServerShard::lookup);
TRELLIS_REMOTE_STEP_SAFE(ServerShard::lookup);

namespace {

// ---- trainers: the dense part ----------------------------------------------

// Time spent in the DDP buckets' allreduces, summed (comm hook): since
// the last progress line, and in all.
std::atomic<int64_t> gAllreduceNs{0};
std::atomic<int64_t> gAllreduceTotalNs{0};

trellis::ddp::CommHook timedAllreduce() {
  return [inner = trellis::ddp::hooks::allreduce()](
             trellis::ddp::GradBucket& bucket) {
    const auto t0 = Clock::now();
    return inner(bucket).then([t0](const at::Tensor& t) {
      const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             Clock::now() - t0)
                             .count();
      gAllreduceNs += ns;
      gAllreduceTotalNs += ns;
      return t;
    });
  };
}

struct Trainer {
  const Flags& f;
  int trainer;  // 0 .. trainers-1
  int trainers;
  int restartCount;
  fs::path dir;  // this job's checkpoint directory
  std::shared_ptr<trellis::collectives::ProcessGroup> group;
  ClickWorld world;
  // shards[s]: the tables' rows on server s.
  std::vector<rpc::RRef<ServerShard>> shards;

  Trainer(const Flags& flags, int t, int n, int restarts, fs::path d,
          std::shared_ptr<trellis::collectives::ProcessGroup> g)
      : f(flags),
        trainer(t),
        trainers(n),
        restartCount(restarts),
        dir(std::move(d)),
        group(std::move(g)),
        world({.tables = flags.tables,
               .rows = flags.rows,
               .denseFeatures = flags.denseFeatures,
               .weightStd = flags.weightStd,
               .zipf = flags.zipf,
               .seed = static_cast<uint64_t>(flags.seed)}) {
    for (int64_t s = 0; s < f.servers; ++s) {
      shards.push_back(rpc::remote<serverShard>("ps" + std::to_string(s)));
    }
  }

  std::string name() const { return "trainer" + std::to_string(trainer); }

  // The batch of this trainer at `step`: the same in every attempt.
  ClickWorld::Batch batchAt(int64_t step) const {
    std::mt19937_64 g(static_cast<uint64_t>(f.seed) * 7919 +
                      static_cast<uint64_t>(step) * 131 +
                      static_cast<uint64_t>(trainer));
    return world.draw(g, f.batch);
  }

  // [B, tables, dim]: each table's bags, summed over the servers holding
  // their rows. One lookup per server covers every table: server s gets
  // the bags of table 0, then those of table 1, ..., over its stacked rows
  // (ServerShard); all lookups are in flight at once.
  at::Tensor embeddings(const ClickWorld::Batch& b) {
    const int64_t bags = b.offsets[0].size(0);
    const auto lookups = trellis::examples::splitLookups(b, f.rows, f.servers);
    std::vector<std::optional<trellis::Future<at::Tensor>>> parts;
    for (int64_t s = 0; s < f.servers; ++s) {
      const auto& l = lookups[static_cast<size_t>(s)];
      if (l.ids.numel() == 0) {
        parts.emplace_back(std::nullopt);
        continue;
      }
      // Completed on the transport loop (docs/rref.md): these futures are
      // only waited on below, so the loop wakes this thread itself rather
      // than through a completion thread.
      parts.emplace_back(
          shards[static_cast<size_t>(s)].rpcAsyncOnLoop<&ServerShard::lookup>(
              l.ids, l.offsets));
    }
    at::Tensor sum = torch::zeros({f.tables * bags, f.dim});
    for (auto& p : parts) {
      if (p) {
        sum = sum + p->wait();
      }
    }
    return sum.view({f.tables, bags, f.dim}).transpose(0, 1);
  }

  int run() {
    torch::manual_seed(static_cast<uint64_t>(f.seed));  // same on every trainer
    DenseNet net(f.denseFeatures, f.tables, f.dim);
    // The dense part is the same on every trainer (DDP), so one copy of
    // it serves any number of trainers: trainer 0 writes it, after the
    // servers wrote their rows (checkpoint() below).
    trellis::elastic::Checkpoints ckpt({.dir = dir / "dense", .keepLast = 3});
    std::optional<trellis::elastic::Checkpoints::Loaded> loaded;
    at::Tensor resume = torch::tensor({int64_t{-1}}, torch::kLong);
    if (trainer == 0) {
      const auto step = chooseResumeStep(ckpt, loaded);
      if (!step) {
        return 4;
      }
      resume.fill_(*step);
    }
    group->broadcast(resume, 0).wait();
    const int64_t resumeStep = resume.item<int64_t>();
    if (resumeStep >= 0) {
      std::string why;
      if (!loaded) {
        loaded = ckpt.load(resumeStep, std::nullopt, &why);
      }
      if (!loaded) {
        std::fprintf(stderr, "%s: the dense checkpoint of step %" PRId64
                     " that trainer0 chose: %s\n",
                     name().c_str(), resumeStep, why.c_str());
        return 4;
      }
      trellis::elastic::loadModule(loaded->archive, "dense", *net);
    }

    trellis::ddp::DistributedDataParallel model(net, group);
    model.registerCommHook(timedAllreduce());
    // The dense part only: the servers step the tables in the backward.
    da::DistributedOptimizer opt(
        da::Adagrad{.lr = f.lr, .initialAccumulatorValue = 0.1},
        da::localParameters(net->parameters()));
    if (loaded) {
      c10::IValue state;
      loaded->archive.read("optimizer", state);
      std::vector<std::string> parts;
      for (const auto& s : state.toListRef()) {
        parts.push_back(s.toStringRef());
      }
      opt.loadStateDict(parts);
    }
    // Nobody trains before every restore is done.
    group->barrier().wait();
    if (resumeStep >= 0 && trainer == 0) {
      std::printf("%s: resumed from the checkpoint of step %" PRId64
                  " (attempt %d, %d trainer%s)\n",
                  name().c_str(), resumeStep, restartCount + 1, trainers,
                  trainers == 1 ? "" : "s");
      std::fflush(stdout);
    }

    const auto start = Clock::now();
    double windowLoss = 0, windowRpc = 0, windowAllreduce = 0;
    int64_t windowSteps = 0;
    auto windowStart = start;
    std::optional<double> recoverySeconds;
    // Seconds per stage over this attempt's steps.
    double tLookup = 0, tForward = 0, tBackward = 0, tOptimizer = 0,
           tBarrier = 0;
    for (int64_t step = resumeStep + 1; step < f.steps; ++step) {
      if (step == f.failAtStep && restartCount == 0 &&
          trainer == trainers - 1) {
        // The failure-time file lets the resumed job say how long recovery
        // took.
        std::ofstream(dir / "failure-time")
            << std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count();
        std::printf("%s: injected failure at step %" PRId64
                    " (exiting with status 13)\n",
                    name().c_str(), step);
        std::fflush(stdout);
        std::_Exit(13);
      }
      const ClickWorld::Batch b = batchAt(step);
      const auto t0 = Clock::now();
      double loss = 0;
      {
        da::Context ctx;
        at::Tensor emb = embeddings(b);
        const auto t1 = Clock::now();
        at::Tensor l = torch::binary_cross_entropy_with_logits(
            model(b.dense, emb), b.labels);
        const auto t2 = Clock::now();
        ctx.backward({l});
        const auto t3 = Clock::now();
        opt.step(ctx);
        loss = l.item<double>();
        windowRpc += seconds(t1 - t0);
        tLookup += seconds(t1 - t0);
        tForward += seconds(t2 - t1);
        tBackward += seconds(t3 - t2);
        tOptimizer += seconds(Clock::now() - t3);
      }
      const auto t4 = Clock::now();
      // No trainer looks rows up for the next step before every trainer's
      // step is applied: every step's lookups see every trainer's previous
      // update, as one process would (bulk-synchronous, so runs repeat).
      // The lookups being step-safe, this is a choice, not a need: a
      // gated lookup would make it one (a fast trainer's next lookups
      // would hold the tables for its backward, which waits in DDP's
      // allreduce for the slow trainer, whose step waits for them;
      // docs/ddp.md, "DDP with distributed autograd"). Without it the job
      // runs as fast: DDP's allreduce keeps the trainers in step anyway.
      group->barrier().wait();
      tBarrier += seconds(Clock::now() - t4);
      if (f.checkConsistency) {
        checkReplicas(*net, step);
      }
      if (f.checkpointEvery > 0 && (step + 1) % f.checkpointEvery == 0) {
        checkpoint(ckpt, *net, opt, step);
      }
      if (restartCount > 0 && !recoverySeconds && trainer == 0) {
        recoverySeconds = sinceFailure();
      }
      windowLoss += loss;
      ++windowSteps;
      if ((step + 1) % f.logEvery == 0 || step + 1 == f.steps) {
        const auto now = Clock::now();
        const double ns = static_cast<double>(gAllreduceNs.exchange(0));
        windowAllreduce += ns / 1e9;
        std::printf("%s step %4" PRId64 "/%" PRId64
                    "  loss %.4f  samples/s %.0f  lookup RPC %.2f ms/step  "
                    "allreduce %.2f ms/step\n",
                    name().c_str(), step + 1, f.steps, windowLoss / windowSteps,
                    static_cast<double>(windowSteps * f.batch) /
                        seconds(now - windowStart),
                    1e3 * windowRpc / windowSteps,
                    1e3 * windowAllreduce / windowSteps);
        std::fflush(stdout);
        windowStart = now;
        windowLoss = windowRpc = windowAllreduce = 0;
        windowSteps = 0;
      }
    }
    const double trainSecs = seconds(Clock::now() - start);
    group->barrier().wait();  // every trainer's last step is in
    int rc = 0;
    const auto done =
        static_cast<double>(std::max<int64_t>(1, f.steps - resumeStep - 1));
    if (trainer == 0) {
      // One line a benchmark can parse (bench/hybrid_bench.cc).
      std::printf(
          "%s: per step: lookup RPC %.3f ms, forward %.3f ms, backward %.3f "
          "ms (allreduce %.3f ms of it), optimizer %.3f ms, barrier %.3f ms; "
          "samples/s %.0f per trainer, %.0f in all\n",
          name().c_str(), 1e3 * tLookup / done, 1e3 * tForward / done,
          1e3 * tBackward / done,
          1e-6 * static_cast<double>(gAllreduceTotalNs.load()) / done,
          1e3 * tOptimizer / done, 1e3 * tBarrier / done,
          done * static_cast<double>(f.batch) / trainSecs,
          done * static_cast<double>(f.batch * trainers) / trainSecs);
      rc = evaluate(*net);
      std::printf("%s: trained steps %" PRId64 "..%" PRId64 " in %.1f s",
                  name().c_str(), resumeStep + 1, f.steps - 1, trainSecs);
      if (restartCount > 0) {
        std::printf(
            "; restarts: %d (resumed from the checkpoint of step %" PRId64 ")",
            restartCount, resumeStep);
        if (recoverySeconds) {
          std::printf(
              ", recovery %.1f s from the failure to the first step "
              "after it",
              *recoverySeconds);
        }
      } else {
        std::printf("; no restart");
      }
      std::printf("\n");
      std::fflush(stdout);
    }
    group->barrier().wait();
    return rc;
  }

  // DDP keeps the replicas bit-identical: checked with two allreduces of
  // each parameter's sum (MIN and MAX must agree).
  void checkReplicas(DenseNetImpl& net, int64_t step) {
    std::vector<at::Tensor> sums;
    for (const auto& p : net.parameters()) {
      sums.push_back(p.detach().to(torch::kDouble).sum().reshape({1}));
    }
    at::Tensor lo = torch::cat(sums);
    at::Tensor hi = lo.clone();
    group->allreduce(lo, trellis::collectives::ReduceOp::kMin).wait();
    group->allreduce(hi, trellis::collectives::ReduceOp::kMax).wait();
    if (!lo.equal(hi)) {
      std::fprintf(stderr,
                   "%s: the trainers' dense parameters differ after step "
                   "%" PRId64 "\n",
                   name().c_str(), step);
      std::exit(5);
    }
  }

  // Trainer 0: the newest step whose dense checkpoint (read into `dense`,
  // which the other trainers read once it is broadcast) and every server's
  // rows are whole; the servers are restored to it. -1: no checkpoint yet;
  // nullopt (said on stderr): none whole everywhere. Skips are named.
  std::optional<int64_t> chooseResumeStep(
      const trellis::elastic::Checkpoints& ckpt,
      std::optional<trellis::elastic::Checkpoints::Loaded>& dense) {
    const std::vector<int64_t> steps = ckpt.steps();
    std::vector<std::string> skipped;
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      const int64_t step = *it;
      std::string why;
      dense = ckpt.load(step, std::nullopt, &why);
      if (!dense) {
        skipped.push_back("step " + std::to_string(step) + ": " + why);
        continue;
      }
      std::vector<trellis::Future<std::string>> restored;
      for (auto& shard : shards) {
        restored.push_back(shard.rpcAsync<&ServerShard::restore>(step));
      }
      std::string refused;
      for (size_t k = 0; k < restored.size(); ++k) {
        const std::string r = restored[k].wait();
        if (!r.empty() && refused.empty()) {
          refused = "ps" + std::to_string(k) + ": " + r;
        }
      }
      if (!refused.empty()) {
        skipped.push_back("step " + std::to_string(step) + ": " + refused);
        continue;
      }
      for (const auto& note : skipped) {
        std::fprintf(stderr, "%s: skipped the checkpoint of %s\n",
                     name().c_str(), note.c_str());
      }
      return step;
    }
    if (steps.empty()) {
      return -1;
    }
    std::string all;
    for (const auto& note : skipped) {
      all += "\n  " + note;
    }
    std::fprintf(stderr,
                 "%s: no checkpoint in %s is whole on every rank:%s\n",
                 name().c_str(), dir.c_str(), all.c_str());
    return std::nullopt;
  }

  // Every rank's state after `step`: trainers wait for each other's last
  // optimizer step, trainer 0 has the servers save their rows, then
  // saves the dense part (the same on every trainer), so a dense
  // checkpoint exists only for a step every server saved too.
  void checkpoint(trellis::elastic::Checkpoints& ckpt, DenseNetImpl& net,
                  da::DistributedOptimizer& opt, int64_t step) {
    group->barrier().wait();
    if (trainer == 0) {
      std::vector<trellis::Future<bool>> saved;
      for (auto& shard : shards) {
        saved.push_back(shard.rpcAsync<&ServerShard::save>(step));
      }
      for (auto& s : saved) {
        (void)s.wait();
      }
    }
    // No trainer's next lookups before the servers saved.
    group->barrier().wait();
    if (trainer == 0) {
      const std::vector<std::string> state = opt.stateDict();
      c10::List<std::string> list;
      for (const auto& s : state) {
        list.push_back(s);
      }
      ckpt.save(step, [&](torch::serialize::OutputArchive& a) {
        trellis::elastic::saveModule(a, "dense", net);
        a.write("optimizer", c10::IValue(list));
      });
    }
  }

  std::optional<double> sinceFailure() const {
    std::ifstream in(dir / "failure-time");
    std::string text;
    if (!(in >> text)) {
      return std::nullopt;
    }
    auto ns = trellis::parseDecimal(text);
    if (!ns) {
      return std::nullopt;
    }
    const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    return static_cast<double>(now - *ns) / 1e9;
  }

  // Held-out samples (another stream of the same hidden model) through the
  // trained model; no context, so no graph on the servers.
  int evaluate(DenseNetImpl& net) {
    std::mt19937_64 heldOut(static_cast<uint64_t>(f.seed) * 104729 + 17);
    std::vector<at::Tensor> scores, labels, oracle;
    torch::NoGradGuard noGrad;
    for (int64_t done = 0; done < f.evalSamples; done += 1024) {
      const int64_t n = std::min<int64_t>(1024, f.evalSamples - done);
      auto b = world.draw(heldOut, n);
      scores.push_back(net.forward(b.dense, embeddings(b)));
      labels.push_back(b.labels);
      oracle.push_back(b.trueLogits);
    }
    const double got = auc(torch::cat(scores), torch::cat(labels));
    std::printf("%s: held-out AUC %.4f (%" PRId64
                " samples; chance 0.5000, hidden-model ceiling %.4f)\n",
                name().c_str(), got, f.evalSamples,
                auc(torch::cat(oracle), torch::cat(labels)));
    if (got < f.minAuc) {
      std::fprintf(stderr, "%s: AUC %.4f is below --min-auc %.4f\n",
                   name().c_str(), got, f.minAuc);
      return 3;
    }
    return 0;
  }
};

// TORCHELASTIC_RESTART_COUNT, or 0 when unset; a bad value is an error.
int restartCountFromEnvironment() {
  const char* v = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (v == nullptr || *v == '\0') {
    return 0;
  }
  auto n = trellis::parseDecimal(v);
  if (!n || *n < 0 || *n > 1'000'000) {
    throw std::invalid_argument(
        std::string("TORCHELASTIC_RESTART_COUNT is not a count: '") + v + "'");
  }
  return static_cast<int>(*n);
}

fs::path defaultCheckpointDir() {
  const char* runId = std::getenv("TORCHELASTIC_RUN_ID");
  std::string id = runId != nullptr && *runId != '\0' ? runId : "local";
  // A run id names a directory: keep it to a safe alphabet.
  for (char& c : id) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') {
      c = '_';
    }
  }
  return fs::temp_directory_path() / "trellis-hybrid" / id;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Trellis hybrid DDP + RPC training (run under elastic-run, srun or "
      "mpirun; ranks 0..servers-1 are parameter servers, the rest trainers)"};
  Flags f;
  app.add_option("--steps", f.steps, "training steps (per trainer)")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--batch", f.batch, "samples per trainer and step")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--servers", f.servers, "parameter-server ranks")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--tables", f.tables, "embedding tables")
      ->check(CLI::Range(1, 64));
  app.add_option("--rows", f.rows, "rows per table")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--dim", f.dim, "embedding dimension")
      ->check(CLI::Range(1, 4096));
  app.add_option("--dense-features", f.denseFeatures, "dense features")
      ->check(CLI::Range(1, 4096));
  app.add_option("--lr", f.lr, "Adagrad learning rate (tables and dense part)")
      ->check(trellis::examples::positiveReal());
  app.add_option("--log-every", f.logEvery, "progress every N steps")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--eval-samples", f.evalSamples, "held-out samples")
      ->check(trellis::examples::wholeNumberFrom(1));
  app.add_option("--checkpoint-every", f.checkpointEvery,
                 "checkpoint every N steps (0: never)")
      ->check(trellis::examples::wholeNumberFrom(0));
  app.add_option("--checkpoint-dir", f.checkpointDir,
                 "checkpoint directory, shared by the job's ranks (default "
                 "<tmp>/trellis-hybrid/<TORCHELASTIC_RUN_ID>)");
  app.add_option("--fail-at-step", f.failAtStep,
                 "the last trainer exits abnormally at this step of the first "
                 "attempt (-1: never)");
  app.add_flag("--check-consistency", f.checkConsistency,
               "check after every step that the trainers' dense parameters "
               "are equal (two small allreduces per step)");
  app.add_option("--min-auc", f.minAuc,
                 "exit with status 3 when the held-out AUC is below this");
  app.add_option("--weight-std", f.weightStd,
                 "hidden model: standard deviation of the item weights");
  app.add_option("--zipf", f.zipf, "hidden model: popularity exponent");
  app.add_option("--seed", f.seed, "seed of the hidden model, data and init");
  app.add_option("--timeout-s", f.timeoutS,
                 "bound on every RPC and collective, in seconds")
      ->check(trellis::examples::positiveReal());
  CLI11_PARSE(app, argc, argv);

  trellis::WorkerEnv env;
  int restartCount = 0;
  try {
    env = trellis::WorkerEnv::fromEnvironment();
    restartCount = restartCountFromEnvironment();
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "hybrid_training: %s\n(start it with elastic-run --standalone "
                 "--nproc-per-node 4 %s)\n",
                 e.what(), argv[0]);
    return 2;
  }
  const int rank = env.rank;
  const int worldSize = env.worldSize;
  const int trainers = worldSize - static_cast<int>(f.servers);
  if (trainers < 1 || !env.master.complete()) {
    std::fprintf(stderr,
                 "hybrid_training: %d processes for %" PRId64
                 " servers: needs at least one trainer, and MASTER_ADDR / "
                 "MASTER_PORT\n",
                 worldSize, f.servers);
    return 2;
  }
  const fs::path dir = f.checkpointDir.empty() ? defaultCheckpointDir()
                                               : fs::path(f.checkpointDir);
  // Two cores are shared by every process of the job.
  torch::set_num_threads(1);
  const auto timeout = std::chrono::duration_cast<trellis::Duration>(
      std::chrono::duration<double>(f.timeoutS));

  const bool isServer = rank < f.servers;
  if (isServer) {
    ServerShard::setCheckpointDir(dir / ("server" + std::to_string(rank)));
    std::lock_guard<std::mutex> lock(gShardMu);
    gShard = std::make_shared<ServerShard>(rank, f.tables, f.rows, f.dim,
                                           f.servers,
                                           static_cast<uint64_t>(f.seed), f.lr);
  }
  std::vector<int> trainerRanks(static_cast<size_t>(trainers));
  std::iota(trainerRanks.begin(), trainerRanks.end(), static_cast<int>(f.servers));
  int rc = 0;
  // RPC over every rank, the trainers' group, the exit barrier (job.h).
  auto job = trellis::init(
      {.rpcName = isServer ? "ps" + std::to_string(rank)
                           : "trainer" + std::to_string(rank - f.servers),
       .groupRanks = trainerRanks,
       .timeout = timeout});
  if (job.inGroup()) {
    Trainer trainer(f, job.group()->rank(), trainers, restartCount, dir,
                    job.group());
    rc = trainer.run();
  }
  // Servers serve until every trainer is done (graceful shutdown waits
  // for all of them); then their rows are final.
  rpc::shutdown();
  if (isServer) {
    int64_t changedUnlooked = 0;
    for (int64_t t = 0; t < gShard->tables(); ++t) {
      const auto s = gShard->stats(t);
      std::printf("ps%d table%" PRId64 "/shard%d: %" PRId64
                  " rows looked up in training, %" PRId64 " changed, %" PRId64
                  " changed without a lookup\n",
                  rank, t, rank, s.looked, s.changed, s.changedUnlooked);
      changedUnlooked += s.changedUnlooked;
    }
    std::fflush(stdout);
    rc = changedUnlooked == 0 ? 0 : 6;
  }
  // Rank 0 learns every rank's exit code. A job that ended well needs its
  // checkpoints in the default place no more (a given --checkpoint-dir is
  // the user's to keep); after a failure elastic-run may restart the group
  // from them.
  const int jobRc = job.shutdown(rc);
  if (rank == 0 && jobRc == 0 && f.checkpointDir.empty()) {
    trellis::removeTree(dir);
  }
  return rc;
}
