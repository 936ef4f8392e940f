// The main job's throughput (issue 19): examples/hybrid_training under
// elastic-run at 1 server + 1 trainer and 2 servers + 2 trainers, against
// the same model trained in one process (local tables, torch autograd,
// torch::optim Adagrad) at the same total batch, in the same run: tables
// stacked in one weight as the job's servers do, and one per table; the
// faster of the two is the ratios' baseline. The
// hybrid job's time split per step (lookup RPCs, forward, backward with the
// remote gradients and the allreduce, optimizer step, trainer barrier) is
// read from the line its trainer 0 prints.
//
//   build/dev/bench/hybrid_bench [--json] [--steps N] [--batch B]
//                                [--large-batch L]
//
// B is the total batch per step (default 128): 1+1 runs B on its trainer,
// 2+2 runs B/2 on each. A second pass runs all three at total batch L
// (default 1024, 0: none) for N * B / L steps (at least 100): the `_b<L>`
// rows. `*_step_overhead_ms` is the hybrid job's time per step less one
// process's at the same batch: what distribution costs per step. Every process
// runs one libtorch thread, as the job does; the machine's cores are shared by
// all of them (2 on the development VM, where 2+2 puts 4 processes on 2 cores).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <sys/wait.h>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include "../examples/click_data.h"
#include "../examples/dlrm.h"
#include "bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;
using trellis::examples::ClickWorld;
using trellis::examples::DenseNet;

// The job's defaults (examples/hybrid_training.cc).
constexpr int64_t kTables = 3, kRows = 20000, kDim = 16, kDense = 4;
constexpr double kLr = 0.1;

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Split {
  double lookupMs = 0, forwardMs = 0, backwardMs = 0, allreduceMs = 0,
         optimizerMs = 0, barrierMs = 0, samplesPerS = 0;
};

// The same model in one process: the tables (sum-mode bags, sparse
// gradients) and the dense part, one Adagrad over both, `batch` samples per
// step. `batched`: the tables stacked in one EmbeddingBag, one lookup and
// one sparse parameter for all (the job's servers' layout); otherwise an
// EmbeddingBag per table, as a PyTorch user would write it.
Split oneProcess(int64_t steps, int64_t batch, bool batched) {
  torch::manual_seed(1234);
  const ClickWorld world({.tables = kTables,
                          .rows = kRows,
                          .denseFeatures = kDense,
                          .weightStd = 0.4,
                          .zipf = 1.1,
                          .seed = 1234});
  std::vector<torch::nn::EmbeddingBag> tables;
  std::vector<at::Tensor> params;
  for (int64_t t = 0; t < (batched ? 1 : kTables); ++t) {
    tables.emplace_back(
        torch::nn::EmbeddingBagOptions(batched ? kTables * kRows : kRows, kDim)
            .mode(torch::kSum)
            .sparse(true));
    params.push_back(tables.back()->weight);
  }
  DenseNet net(kDense, kTables, kDim);
  for (const auto& p : net->parameters()) {
    params.push_back(p);
  }
  torch::optim::Adagrad opt(
      params, torch::optim::AdagradOptions(kLr).initial_accumulator_value(0.1));
  Split s;
  const int64_t warmup = steps / 10;
  Clock::time_point start;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == warmup) {
      s = Split{};
      start = Clock::now();
    }
    std::mt19937_64 g(1234 * 7919 + static_cast<uint64_t>(step) * 131);
    const auto b = world.draw(g, batch);
    const auto t0 = Clock::now();
    opt.zero_grad();
    at::Tensor emb;
    if (batched) {
      // Table t's rows at t * kRows; its bags after table t-1's.
      std::vector<at::Tensor> ids, offsets;
      int64_t before = 0;
      for (int64_t t = 0; t < kTables; ++t) {
        const auto u = static_cast<size_t>(t);
        ids.push_back(b.ids[u] + t * kRows);
        offsets.push_back(b.offsets[u] + before);
        before += b.ids[u].size(0);
      }
      emb = tables[0](torch::cat(ids), torch::cat(offsets))
                .view({kTables, batch, kDim})
                .transpose(0, 1);
    } else {
      std::vector<at::Tensor> embs;
      for (int64_t t = 0; t < kTables; ++t) {
        embs.push_back(tables[static_cast<size_t>(t)](
            b.ids[static_cast<size_t>(t)], b.offsets[static_cast<size_t>(t)]));
      }
      emb = torch::stack(embs, 1);
    }
    at::Tensor loss =
        torch::binary_cross_entropy_with_logits(net(b.dense, emb), b.labels);
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    opt.step();
    s.forwardMs += std::chrono::duration<double, std::milli>(t1 - t0).count();
    s.backwardMs += std::chrono::duration<double, std::milli>(t2 - t1).count();
    s.optimizerMs +=
        std::chrono::duration<double, std::milli>(Clock::now() - t2).count();
  }
  const double measured = static_cast<double>(steps - warmup);
  s.samplesPerS = measured * static_cast<double>(batch) / secondsSince(start);
  s.forwardMs /= measured;
  s.backwardMs /= measured;
  s.optimizerMs /= measured;
  return s;
}

// Runs the job and parses trainer 0's "per step:" line; exits on failure.
Split hybrid(const std::string& elasticRun, const std::string& job, int servers,
             int trainers, int64_t steps, int64_t batch) {
  char cmd[2048];
  std::snprintf(cmd, sizeof(cmd),
                "timeout 600 %s --standalone --nproc-per-node %d %s "
                "--servers %d --batch %" PRId64 " --steps %" PRId64
                " --log-every %" PRId64
                " --checkpoint-every 0 --eval-samples 1024 --min-auc 0 "
                "--checkpoint-dir /tmp/trellis-hybrid-bench-%d 2>&1",
                elasticRun.c_str(), servers + trainers, job.c_str(), servers,
                batch, steps, steps, static_cast<int>(::getpid()));
  FILE* p = ::popen(cmd, "r");
  if (p == nullptr) {
    std::perror("popen");
    std::exit(1);
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) {
    out += buf;
  }
  const int status = ::pclose(p);
  std::error_code ec;
  std::filesystem::remove_all(
      "/tmp/trellis-hybrid-bench-" + std::to_string(::getpid()), ec);
  Split s;
  const char* line = std::strstr(out.c_str(), "trainer0: per step: ");
  double perTrainer = 0;
  if (status != 0 || line == nullptr ||
      std::sscanf(line,
                  "trainer0: per step: lookup RPC %lf ms, forward %lf ms, "
                  "backward %lf ms (allreduce %lf ms of it), optimizer %lf "
                  "ms, barrier %lf ms; samples/s %lf per trainer, %lf in all",
                  &s.lookupMs, &s.forwardMs, &s.backwardMs, &s.allreduceMs,
                  &s.optimizerMs, &s.barrierMs, &perTrainer,
                  &s.samplesPerS) != 8) {
    std::fprintf(stderr, "hybrid_bench: %d+%d run failed (status %d):\n%s\n",
                 servers, trainers, status, out.c_str());
    std::exit(1);
  }
  return s;
}

void addSplit(trellis::bench::Report& r, const std::string& prefix,
              const Split& s, bool hybridRun) {
  if (hybridRun) {
    r.add(prefix + "_lookup_rpc_ms", s.lookupMs, "ms");
  }
  r.add(prefix + "_forward_ms", s.forwardMs, "ms");
  r.add(prefix + "_backward_ms", s.backwardMs, "ms");
  if (hybridRun) {
    r.add(prefix + "_allreduce_ms", s.allreduceMs, "ms");
  }
  r.add(prefix + "_optimizer_ms", s.optimizerMs, "ms");
  if (hybridRun) {
    r.add(prefix + "_barrier_ms", s.barrierMs, "ms");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int64_t steps = 400;
  int64_t batch = 128;
  int64_t largeBatch = 1024;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::strtoll(argv[++i], nullptr, 10);
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::strtoll(argv[++i], nullptr, 10);
    } else if (a == "--large-batch" && i + 1 < argc) {
      largeBatch = std::strtoll(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: hybrid_bench [--json] [--steps N] [--batch B] "
                   "[--large-batch L]\n");
      return 2;
    }
  }
  const auto evenBatch = [](int64_t b) {
    return b >= 2 && b <= 1000000 && b % 2 == 0;
  };
  if (steps < 20 || steps > 1000000 || !evenBatch(batch) ||
      (largeBatch != 0 && !evenBatch(largeBatch))) {
    std::fprintf(stderr,
                 "hybrid_bench: --steps must be 20..1e6, --batch an even "
                 "number 2..1e6, --large-batch 0 or an even number 2..1e6\n");
    return 2;
  }
  torch::set_num_threads(1);
  trellis::bench::Report r("hybrid");
  // One pass at total batch `b`: the samples/s rows (suffix `tag`), each
  // hybrid one's ratio to one process's, and the per-step overheads.
  const auto pass = [&](int64_t b, int64_t n, const std::string& tag) {
    const Split perTable = oneProcess(n, b, /*batched=*/false);
    const Split batched = oneProcess(n, b, /*batched=*/true);
    const Split one =
        hybrid(TRELLIS_ELASTIC_RUN, TRELLIS_HYBRID_TRAINING, 1, 1, n, b);
    const Split two =
        hybrid(TRELLIS_ELASTIC_RUN, TRELLIS_HYBRID_TRAINING, 2, 2, n, b / 2);
    // The hybrid rows' baseline is the faster of the two layouts in one
    // process (`_best`): the job's table batching must not be what the
    // ratio credits.
    r.add("one_process" + tag + "_samples_per_s", perTable.samplesPerS, "1/s");
    r.add("one_process_batched" + tag + "_samples_per_s", batched.samplesPerS,
          "1/s");
    const Split& local =
        batched.samplesPerS > perTable.samplesPerS ? batched : perTable;
    const std::string base = "one_process_best" + tag + "_samples_per_s";
    r.add(base, local.samplesPerS, "1/s");
    r.add("hybrid_1s1t" + tag + "_samples_per_s", one.samplesPerS, "1/s", base);
    r.add("hybrid_2s2t" + tag + "_samples_per_s", two.samplesPerS, "1/s", base);
    const auto msPerStep = [&](const Split& s) {
      return 1e3 * static_cast<double>(b) / s.samplesPerS;
    };
    r.add("hybrid_1s1t" + tag + "_step_overhead_ms",
          msPerStep(one) - msPerStep(local), "ms");
    r.add("hybrid_2s2t" + tag + "_step_overhead_ms",
          msPerStep(two) - msPerStep(local), "ms");
    return std::make_tuple(local, one, two);
  };
  const auto [local, one, two] = pass(batch, steps, "");
  addSplit(r, "one_process", local, false);
  addSplit(r, "hybrid_1s1t", one, true);
  addSplit(r, "hybrid_2s2t", two, true);
  if (largeBatch != 0) {
    pass(largeBatch, std::max<int64_t>(100, steps * batch / largeBatch),
         "_b" + std::to_string(largeBatch));
  }
  r.print(json);
  return 0;
}
