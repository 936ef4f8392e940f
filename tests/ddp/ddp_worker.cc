// One rank of ddp_test's process tests: started with the torchrun variables
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TRELLIS_JOB_TOKEN) and
// `ddp_worker SCENARIO`. Prints on stdout, for the test to read.
//
// Scenarios:
//  train   5 SGD steps of testing::Mlp (seeded 100 + rank, so the ranks
//          start apart) on its shard of a fixed batch of 12 (seed 7); then
//          "params v1 v2 ..." (every parameter, registration order, %a).
//  unused  rank 1's forward skips the `branch` head; prints
//          "error: <what backward threw>" or "no error".
//  killed  trains step after step (watchdog in fail mode, so the error
//          reaches the program); the last rank prints "mid-step" after a
//          forward and waits there for the test's SIGKILL; the others
//          print "error: <what their step threw>".
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "models.h"
#include <trellis/collectives/process_group.h>
#include <trellis/ddp/distributed_data_parallel.h>

namespace {

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  using trellis::ddp::testing::Mlp;
  const std::string scenario = argc > 1 ? argv[1] : "";
  at::set_num_threads(1);
  try {
    trellis::collectives::ProcessGroupOptions options;
    if (scenario == "killed") {
      options.timeout = std::chrono::seconds(60);  // far beyond the bound
      options.watchdogMode = trellis::collectives::WatchdogMode::kFail;
    }
    auto pg =
        trellis::collectives::ProcessGroup::fromEnvironment("cpu", options);
    const int rank = pg->rank();
    const int n = pg->size();
    torch::manual_seed(7);
    const auto x = torch::randn({12, 8});
    const auto y = torch::randn({12, 4});
    const int64_t rows = 12 / n;
    const auto xs = x.narrow(0, rank * rows, rows);
    const auto ys = y.narrow(0, rank * rows, rows);
    torch::manual_seed(100 + rank);
    if (scenario == "train") {
      Mlp net;
      trellis::ddp::DistributedDataParallel model(net, pg);
      torch::optim::SGD opt(net->parameters(),
                            torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int it = 0; it < 5; ++it) {
        opt.zero_grad();
        torch::mse_loss(model(xs), ys).backward();
        opt.step();
      }
      std::string line = "params";
      char buf[64];
      for (const auto& p : net->parameters()) {
        auto flat = p.detach().reshape({-1});
        for (int64_t k = 0; k < flat.numel(); ++k) {
          std::snprintf(buf, sizeof buf, " %a", flat[k].item<float>());
          line += buf;
        }
      }
      say(line);
      return 0;
    }
    if (scenario == "unused") {
      Mlp net(/*withBranch=*/true);
      trellis::ddp::DistributedDataParallel model(net, pg);
      try {
        torch::mse_loss(model(xs, rank != 1), ys).backward();
        say("no error");
      } catch (const trellis::FailedPreconditionError& e) {
        say(std::string("error: ") + e.what());
      }
      return 0;
    }
    if (scenario == "killed") {
      Mlp net;
      trellis::ddp::DistributedDataParallel model(net, pg);
      try {
        for (int it = 0; it < 100000; ++it) {
          auto loss = torch::mse_loss(model(xs), ys);
          if (rank == n - 1 && it == 3) {
            say("mid-step");
            std::this_thread::sleep_for(std::chrono::seconds(60));
          }
          loss.backward();
        }
        say("no error");
      } catch (const std::exception& e) {
        say(std::string("error: ") + e.what());
      }
      return 0;
    }
    say("unknown scenario " + scenario);
    return 2;
  } catch (const std::exception& e) {
    say(std::string("failed: ") + e.what());
    return 1;
  }
}
