// A worker for elastic_run_test, driven by its arguments:
//
//   --dir D            write D/env_<RANK>_<RESTART>.txt (the variables the
//                      test checks) and D/pid_<RANK>_<RESTART> (its pid)
//   --fail-rank R      rank R fails: records "boom from rank R" in its
//                      error file, then exits 3 ...
//   --fail-restart N   ... only when TORCHELASTIC_RESTART_COUNT is N
//                      (default: every attempt)
//   --sleep-ms M       sleep M ms before exiting (0 by default)
//   --sleep-first-ms M sleep M ms more when TORCHELASTIC_RESTART_COUNT is 0
//   --ignore-signals   ignore SIGTERM, SIGINT, SIGHUP (needs SIGKILL)
//   --print TEXT       print TEXT on stdout and stderr first

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

#include <trellis/elastic/errors.h>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int failRank = -1;
  int failRestart = -1;
  long sleepMs = 0;
  long sleepFirstMs = 0;
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
    } else if (a == "--sleep-ms") {
      sleepMs = std::atol(next);
      ++i;
    } else if (a == "--sleep-first-ms") {
      sleepFirstMs = std::atol(next);
      ++i;
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
  if (failRank >= 0 && std::to_string(failRank) == rank &&
      (failRestart < 0 || std::to_string(failRestart) == restart)) {
    try {
      throw std::runtime_error("boom from rank " + rank);
    } catch (...) {
      (void)trellis::elastic::recordCurrentException();  // exits 3 anyway
    }
    return 3;
  }
  if (restart == "0") {
    sleepMs += sleepFirstMs;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(sleepMs));
  return 0;
}
