// A worker for elastic_run_test, driven by its arguments:
//
//   --dir D            write D/env_<RANK>_<RESTART>.txt (the variables the
//                      test checks) and D/pid_<RANK>_<RESTART> (its pid)
//   --fail-rank R      rank R fails: records "boom from rank R" in its
//                      error file, then exits 3 ...
//   --fail-restart N   ... only when TORCHELASTIC_RESTART_COUNT is N
//                      (default: every attempt)
//   --fail-pad N       ... with N more bytes ('x') after that message
//   --fail-garbage     ... writing "not json" as its error file instead
//   --fail-after-ms M  ... M ms after it recorded the error (a worker
//                      that is slow to go after its failure)
//   --sleep-ms M       sleep M ms before exiting (0 by default)
//   --exit-rank R      rank R exits with --exit-code's status after its
//   --exit-code C      sleep, recording nothing (a worker that fails as a
//                      consequence of another's failure)
//   --sleep-first-ms M sleep M ms more when TORCHELASTIC_RESTART_COUNT is 0
//   --ignore-signals   ignore SIGTERM, SIGINT, SIGHUP (needs SIGKILL)
//   --print TEXT       print TEXT on stdout and stderr first
//   --store            meet the other ranks in the workers' store found the
//                      way Trellis's layers find it (store/worker_store.h:
//                      rank 0 serves it, or the agent does when
//                      TORCHELASTIC_USE_AGENT_STORE=True), and write
//                      D/store_<RANK>_<RESTART>.txt: whether it was the
//                      agent's, the key prefix, whether this rank served
//                      it, the ranks seen; rank 0 also leaves a mark, and
//                      a later attempt reports the mark of attempt 0 read
//                      through an unprefixed client (the store survived)
//                      and whether its own prefix was empty (fresh). Done
//                      before --fail-rank fails.

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <trellis/core/worker_env.h>
#include <trellis/elastic/errors.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// --store: see the top. Returns false (and says why) when it fails.
bool meetInStore(const std::string& dir, const std::string& tag) {
  using namespace std::chrono_literals;
  try {
    const trellis::WorkerEnv env = trellis::WorkerEnv::fromEnvironment();
    trellis::store::WorkerStoreOptions o;
    o.jobToken = env.jobToken;
    o.timeout = 20s;
    auto ws = trellis::store::connectWorkerStore(env.master, env.rank, o);
    trellis::store::Store& s = *ws.store;
    const std::string restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
    std::string lines;
    lines += "agent=" + std::string(env.master.agentStore ? "1" : "0") + "\n";
    lines += "prefix=" + env.master.keyPrefix + "\n";
    lines += "server=" + std::string(ws.server ? "1" : "0") + "\n";
    if (env.rank == 0) {
      lines += "fresh=" + std::string(s.check({"mark"}) ? "0" : "1") + "\n";
      s.set("mark", "attempt " + restart);
      if (env.master.agentStore && restart != "0") {
        trellis::store::TCPStoreOptions raw;
        raw.host = env.master.addr;
        raw.port = env.master.port;
        raw.jobToken = env.jobToken;
        raw.timeout = 5s;
        trellis::store::TCPStore unprefixed(raw);
        const std::string old = "/worker/attempt_0/round_0/mark";
        lines += "survived=" +
                 (unprefixed.check({old}) ? unprefixed.getString(old)
                                          : std::string("absent")) +
                 "\n";
      }
    }
    std::vector<std::string> keys;
    for (int r = 0; r < env.worldSize; ++r) {
      keys.push_back("rank" + std::to_string(r));
    }
    s.set(keys[static_cast<size_t>(env.rank)], std::to_string(::getpid()));
    s.wait(keys, 20s);
    lines += "seen=" + std::to_string(keys.size()) + "\n";
    std::ofstream(dir + "/store_" + tag + ".txt.tmp") << lines;
    std::rename((dir + "/store_" + tag + ".txt.tmp").c_str(),
                (dir + "/store_" + tag + ".txt").c_str());
    // Nobody goes on (a --fail-rank would stop the group) before every rank
    // has written its file; rank 0, which may serve the store, leaves last.
    auto await = [&](const char* key, int64_t n) {
      const auto end = std::chrono::steady_clock::now() + 20s;
      while (s.add(key, 0) < n && std::chrono::steady_clock::now() < end) {
        std::this_thread::sleep_for(10ms);
      }
    };
    s.add("done", 1);
    await("done", env.worldSize);
    if (env.rank == 0) {
      await("left", env.worldSize - 1);
    } else {
      s.add("left", 1);
    }
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker store: %s\n", e.what());
    return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int failRank = -1;
  int failRestart = -1;
  long sleepMs = 0;
  long sleepFirstMs = 0;
  bool store = false;
  long failPad = 0;
  bool failGarbage = false;
  long failAfterMs = 0;
  int exitRank = -1;
  int exitCode = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* next = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--dir") {
      dir = next;
      ++i;
    } else if (a == "--fail-rank") {
      failRank = std::atoi(next);
      ++i;
    } else if (a == "--fail-restart") {
      failRestart = std::atoi(next);
      ++i;
    } else if (a == "--fail-pad") {
      failPad = std::atol(next);
      ++i;
    } else if (a == "--fail-after-ms") {
      failAfterMs = std::atol(next);
      ++i;
    } else if (a == "--exit-rank") {
      exitRank = std::atoi(next);
      ++i;
    } else if (a == "--exit-code") {
      exitCode = std::atoi(next);
      ++i;
    } else if (a == "--fail-garbage") {
      failGarbage = true;
    } else if (a == "--sleep-ms") {
      sleepMs = std::atol(next);
      ++i;
    } else if (a == "--sleep-first-ms") {
      sleepFirstMs = std::atol(next);
      ++i;
    } else if (a == "--store") {
      store = true;
    } else if (a == "--ignore-signals") {
      for (int s : {SIGTERM, SIGINT, SIGHUP}) {
        std::signal(s, SIG_IGN);
      }
    } else if (a == "--print") {
      std::printf("%s\n", next);
      std::fprintf(stderr, "%s\n", next);
      std::fflush(stdout);
      ++i;
    }
  }
  const std::string rank = env("RANK");
  const std::string restart = env("TORCHELASTIC_RESTART_COUNT");
  if (!dir.empty()) {
    const std::string tag = rank + "_" + restart;
    {
      std::ofstream out(dir + "/env_" + tag + ".txt.tmp");
      for (const char* name :
           {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "TRELLIS_JOB_TOKEN", "ROLE_NAME"}) {
        out << name << "=" << env(name) << "\n";
      }
    }
    std::rename((dir + "/env_" + tag + ".txt.tmp").c_str(),
                (dir + "/env_" + tag + ".txt").c_str());
    std::ofstream(dir + "/pid_" + tag + ".tmp") << ::getpid() << "\n";
    std::rename((dir + "/pid_" + tag + ".tmp").c_str(),
                (dir + "/pid_" + tag).c_str());
  }
  if (store && !meetInStore(dir, rank + "_" + restart)) {
    return 4;
  }
  if (failRank >= 0 && std::to_string(failRank) == rank &&
      (failRestart < 0 || std::to_string(failRestart) == restart)) {
    if (failGarbage) {
      std::ofstream(env("TORCHELASTIC_ERROR_FILE")) << "not json";
      return 3;
    }
    try {
      throw std::runtime_error(
          "boom from rank " + rank +
          std::string(static_cast<size_t>(std::max(failPad, 0L)), 'x'));
    } catch (...) {
      (void)trellis::elastic::recordCurrentException();  // exits 3 anyway
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(failAfterMs));
    return 3;
  }
  if (restart == "0") {
    sleepMs += sleepFirstMs;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(sleepMs));
  return std::to_string(exitRank) == rank ? exitCode : 0;
}
