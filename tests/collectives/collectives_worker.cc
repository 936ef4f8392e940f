// One rank of collectives_process_test: started with the torchrun
// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TRELLIS_JOB_TOKEN)
// and `collectives_worker SCENARIO [timeout_ms=N] [mode=exit|fail]
// [dir=PATH]`. Prints "step N" after each allreduce and "error: ..." when
// an op fails, on stdout, so the test can time what it sees.
//
// Scenarios (ranks 0..2; rank 2 misbehaves unless said otherwise):
//  stop    rank 2 issues the step-3 allreduce and SIGSTOPs itself.
//  kill    rank 2 says "ready" after step 2 and waits for the test's
//          SIGKILL.
//  kill-two  (4 ranks) ranks 2 and 3 do as rank 2 of `kill`.
//  never   rank 2 never calls the step-3 allreduce (it sleeps).
//  desync  rank 1 calls broadcast at step 3 where the others allreduce.
//  recover (mode=fail) rank 2 sleeps through step 3; every rank then
//          creates the group anew on the same store and allreduces again.
//  stall   (store=external) the store is a trellis-store process the test
//          runs and freezes; the ranks allreduce on (they need no store)
//          until the watchdog, stuck in a store call, is reported stuck.
//  plain   every rank runs all five steps (each a small allreduce and a
//          1 MiB one, results checked: in the hosts' shared-memory segments
//          where ranks share a host, by recursive doubling and by ring
//          between hosts) and says "done".
#include <chrono>
#include <cstdio>
#include <signal.h>
#include <string>
#include <thread>
#include <unistd.h>

#include <torch/torch.h>

#include <trellis/collectives/process_group.h>
#include <trellis/core/worker_env.h>
#include <trellis/store/tcp_store.h>

using namespace std::chrono_literals;
using trellis::collectives::ProcessGroup;
using trellis::collectives::ProcessGroupOptions;

namespace {

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// The store of the `recover` scenario, kept outside any group so a second
// group can be made on it.
std::shared_ptr<trellis::store::Store> jobStore(
    const trellis::WorkerEnv& env,
    std::shared_ptr<trellis::store::TCPStoreServer>* server) {
  if (env.rank == 0) {
    trellis::store::TCPStoreServerOptions so;
    so.host = env.master.addr;
    so.port = env.master.port;
    so.jobToken = env.jobToken;
    *server = std::make_shared<trellis::store::TCPStoreServer>(so);
  }
  trellis::store::TCPStoreOptions co;
  co.host = env.master.addr;
  co.port = env.master.port;
  co.jobToken = env.jobToken;
  co.timeout = 30s;
  return std::make_shared<trellis::store::TCPStore>(co);
}

int recover(const trellis::WorkerEnv& env, ProcessGroupOptions o) {
  std::shared_ptr<trellis::store::TCPStoreServer> server;
  auto store = jobStore(env, &server);
  auto t = torch::ones({256});
  {
    auto pg = ProcessGroup::create("cpu", store, env.rank, env.worldSize, o);
    pg->allreduce(t).wait();
    say("step 1");
    if (env.rank == 2) {
      // Misses seq 2 long enough for the others to time out and give up.
      std::this_thread::sleep_for(*o.timeout + 1500ms);
    } else {
      try {
        pg->allreduce(t).wait();
        say("unexpected: the allreduce completed");
        return 2;
      } catch (const trellis::TimeoutError& e) {
        say(std::string("error: ") + e.what());
      }
    }
  }
  auto again = ProcessGroup::create("cpu", store, env.rank, env.worldSize, o);
  auto u = torch::ones({256});
  again->allreduce(u).wait();
  say("recovered " + std::to_string(u[0].item<float>()));
  again->barrier().wait();  // rank 0's store outlives the others' use
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: collectives_worker SCENARIO [k=v...]\n");
    return 2;
  }
  const std::string scenario = argv[1];
  ProcessGroupOptions o;
  o.timeout = 2000ms;
  // The ops' timeouts are short so the watchdog fires fast; forming the
  // group is not held to them: under a sanitizer on a loaded machine the
  // ranks may start seconds apart.
  o.initTimeout = 60s;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("timeout_ms=", 0) == 0) {
      o.timeout = std::chrono::milliseconds(std::stoi(a.substr(11)));
    } else if (a.rfind("mode=", 0) == 0) {
      setenv("TRELLIS_WATCHDOG_MODE", a.substr(5).c_str(), 1);
    } else if (a.rfind("interval_ms=", 0) == 0) {
      setenv("TRELLIS_WATCHDOG_INTERVAL_MS", a.substr(12).c_str(), 1);
    } else if (a.rfind("heartbeat_ms=", 0) == 0) {
      setenv("TRELLIS_WATCHDOG_HEARTBEAT_TIMEOUT_MS", a.substr(13).c_str(), 1);
    } else if (a.rfind("dir=", 0) == 0) {
      setenv("TRELLIS_FLIGHT_RECORDER_DIR", a.substr(4).c_str(), 1);
    } else {
      std::fprintf(stderr, "collectives_worker: unknown argument %s\n",
                   a.c_str());
      return 2;
    }
  }
  try {
    const auto env = trellis::WorkerEnv::fromEnvironment();
    if (scenario == "recover") {
      return recover(env, o);
    }
    if (scenario == "stall") {
      trellis::store::TCPStoreOptions co;
      co.host = env.master.addr;
      co.port = env.master.port;
      co.jobToken = env.jobToken;
      co.timeout = 30s;
      auto store = std::make_shared<trellis::store::TCPStore>(co);
      auto pg = ProcessGroup::create("cpu", store, env.rank, env.worldSize, o);
      auto t = torch::ones({16});
      for (int step = 1; step <= 3000; ++step) {
        pg->allreduce(t).wait();
        if (step <= 3) {
          say("step " + std::to_string(step));
        }
        std::this_thread::sleep_for(20ms);
      }
      say("unexpected: the watchdog never reported itself stuck");
      return 5;
    }
    auto pg = ProcessGroup::fromEnvironment("cpu", o);
    const int rank = pg->rank();
    // Between hosts `big` (1 MiB, above the recursive-doubling limit) runs
    // the ring and `t` recursive doubling; on a host, both the segment.
    auto t = torch::ones({1024});
    auto big = torch::ones({1 << 18});
    double expect = 1;
    for (int step = 1; step <= 5; ++step) {
      if (step == 3 && rank == 2 && scenario == "stop") {
        auto w = pg->allreduce(t);
        say("stopping");
        raise(SIGSTOP);
        w.wait();
      } else if (step == 3 && rank == 2 && scenario == "never") {
        say("skipping");
        std::this_thread::sleep_for(60s);  // the test ends it before
        return 3;
      } else if (step == 3 && rank == 1 && scenario == "desync") {
        pg->broadcast(t, 1).wait();
      } else {
        pg->allreduce(t).wait();
      }
      pg->allreduce(big).wait();
      expect *= pg->size();
      for (const auto& x : {t, big}) {
        const double lo = x.min().item<double>(), hi = x.max().item<double>();
        if (lo != expect || hi != expect) {
          say("error: step " + std::to_string(step) + " gave [" +
              std::to_string(lo) + ", " + std::to_string(hi) + "], expected " +
              std::to_string(expect));
          return 4;
        }
      }
      say("step " + std::to_string(step));
      if (step == 2 && ((rank == 2 && scenario == "kill") ||
                        (rank >= 2 && scenario == "kill-two"))) {
        say("ready");
        std::this_thread::sleep_for(60s);  // the test SIGKILLs it before
        return 3;
      }
    }
    pg->barrier().wait();
    say("done");
    return 0;
  } catch (const std::exception& e) {
    say(std::string("error: ") + e.what());
    return 1;
  }
}
