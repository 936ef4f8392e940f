// elastic-run against starting the workers directly and against torchrun
// (Debian's python3-torch), in the same run (issue 18):
//  - launch overhead: `--standalone --nproc-per-node 2 /bin/true`, minus
//    two /bin/true started directly and waited for;
//  - crash → restart: a worker that exits 1 on attempt 0; the time from its
//    last act to the first act of the restarted worker (both write the
//    wall clock, in ns, to a file);
//  - rendezvous of N agents (processes on this host, c10d, --nnodes N): from
//    starting them all to the last one's exit, with /bin/true as worker.
// Each figure is the median over --runs runs. torchrun is run with
// --redirects 1 --tee 1 (Debian's 1.13 fails with the defaults under
// Python 3.11, docs/elastic.md) and its default monitor interval (5 s in
// 1.13) as well as 0.1 s.
//
//   build/dev/bench/elastic_bench [--json] [--runs N] [--agents N]
//                                 [--torchrun-agents N]
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <spawn.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "bench_util.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string gTmp;

// Starts argv with `env` added to this process's environment (stdout and
// stderr to /dev/null); returns the pid.
pid_t start(const std::vector<std::string>& argv,
            const std::vector<std::string>& env = {}) {
  std::vector<char*> a;
  for (const auto& s : argv) {
    a.push_back(const_cast<char*>(s.c_str()));
  }
  a.push_back(nullptr);
  std::vector<std::string> envStore;
  for (char** e = environ; *e != nullptr; ++e) {
    envStore.emplace_back(*e);
  }
  envStore.insert(envStore.end(), env.begin(), env.end());
  std::vector<char*> ev;
  for (const auto& s : envStore) {
    ev.push_back(const_cast<char*>(s.c_str()));
  }
  ev.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  if (posix_spawnp(&pid, a[0], &fa, nullptr, a.data(), ev.data()) != 0) {
    std::fprintf(stderr, "elastic_bench: cannot start %s\n", a[0]);
    std::exit(1);
  }
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// Waits for `pid` (at most `limitS` seconds, then SIGKILL and exit 1).
void waitFor(pid_t pid, const std::string& what, double limitS = 300) {
  const auto end = Clock::now() + std::chrono::duration<double>(limitS);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      std::fprintf(stderr, "elastic_bench: %s took over %.0f s\n", what.c_str(),
                   limitS);
      std::exit(1);
    }
    ::usleep(500);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "elastic_bench: %s failed (status %d)\n", what.c_str(),
                 status);
    std::exit(1);
  }
}

double timeRun(const std::vector<std::string>& argv,
               const std::vector<std::string>& env = {}) {
  const auto t0 = Clock::now();
  waitFor(start(argv, env), argv[0]);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  return trellis::bench::percentile(v, 0.5);
}

std::vector<std::string> torchrunArgs(double monitorS) {
  return {"torchrun",
          "--redirects",
          "1",
          "--tee",
          "1",
          "--log_dir",
          gTmp + "/torchrun-logs",
          "--monitor_interval",
          std::to_string(monitorS)};
}

// The crash → restart gap of one launcher command (its workers run `sh -c`).
double restartGap(std::vector<std::string> launcher) {
  const std::string a = gTmp + "/crashed", b = gTmp + "/restarted";
  fs::remove(a);
  fs::remove(b);
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then date +%s%N > " + a +
      "; exit 1; else date +%s%N > " + b + "; fi";
  launcher.insert(launcher.end(), {"/bin/sh", "-c", script});
  waitFor(start(launcher), launcher[0]);
  int64_t t0 = 0, t1 = 0;
  std::ifstream(a) >> t0;
  std::ifstream(b) >> t1;
  if (t0 <= 0 || t1 <= 0) {
    std::fprintf(stderr, "elastic_bench: %s: no restart timestamps\n",
                 launcher[0].c_str());
    std::exit(1);
  }
  return static_cast<double>(t1 - t0) / 1e9;
}

// N agents of one c10d job on this host; seconds until the last exits.
double rendezvous(const std::vector<std::string>& agentPrefix, int agents,
                  int port) {
  std::vector<pid_t> pids;
  const auto t0 = Clock::now();
  for (int i = 0; i < agents; ++i) {
    std::vector<std::string> argv = agentPrefix;
    argv.insert(argv.end(),
                {"--nnodes", std::to_string(agents), "--nproc_per_node", "1",
                 "--rdzv_backend", "c10d", "--rdzv_endpoint",
                 "127.0.0.1:" + std::to_string(port), "--rdzv_id",
                 "bench" + std::to_string(port), "/bin/true"});
    pids.push_back(start(argv));
  }
  for (pid_t p : pids) {
    waitFor(p, agentPrefix[0] + " agent", 600);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int runs = 3, agents = 64, torchrunAgents = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool hasValue = i + 1 < argc;
    if (a == "--json") {
      json = true;
    } else if (a == "--runs" && hasValue) {
      runs = static_cast<int>(trellis::bench::flagValue(
          "elastic_bench", "--runs", argv[++i], 1, 100));
    } else if (a == "--agents" && hasValue) {
      agents = static_cast<int>(trellis::bench::flagValue(
          "elastic_bench", "--agents", argv[++i], 2, 256));
    } else if (a == "--torchrun-agents" && hasValue) {
      torchrunAgents = static_cast<int>(trellis::bench::flagValue(
          "elastic_bench", "--torchrun-agents", argv[++i], 0, 256));
    } else {
      std::fprintf(stderr,
                   "usage: elastic_bench [--json] [--runs 1..100] [--agents "
                   "2..256] [--torchrun-agents 0..256]\n");
      return 2;
    }
  }
  char dir[] = "/tmp/trellis-elastic-bench.XXXXXX";
  if (::mkdtemp(dir) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  gTmp = dir;
  const std::string run = TRELLIS_ELASTIC_RUN;
  const bool haveTorchrun =
      std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0 &&
      std::system("command -v torchrun >/dev/null 2>&1") == 0;
  if (!haveTorchrun) {
    std::fprintf(stderr,
                 "elastic_bench: torchrun (Debian python3-torch) not found: "
                 "its columns are left out\n");
  }
  // Job token for the several-node rendezvous (required there).
  ::setenv("TRELLIS_JOB_TOKEN",
           "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
           1);

  std::vector<double> direct, ours, torchDefault, torchFast;
  std::vector<double> gapOurs, gapTorchDefault, gapTorchFast;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    const pid_t a = start({"/bin/true"});
    const pid_t b = start({"/bin/true"});
    waitFor(a, "/bin/true");
    waitFor(b, "/bin/true");
    direct.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    ours.push_back(
        timeRun({run, "--standalone", "--nproc-per-node", "2", "/bin/true"}));
    gapOurs.push_back(restartGap(
        {run, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1"}));
    if (haveTorchrun) {
      for (double monitor : {5.0, 0.1}) {
        auto args = torchrunArgs(monitor);
        auto launch = args;
        launch.insert(launch.end(), {"--standalone", "--nproc_per_node", "2",
                                     "--no_python", "/bin/true"});
        auto crash = args;
        crash.insert(crash.end(), {"--standalone", "--nproc_per_node", "1",
                                   "--max_restarts", "1", "--no_python"});
        (monitor > 1 ? torchDefault : torchFast).push_back(timeRun(launch));
        (monitor > 1 ? gapTorchDefault : gapTorchFast)
            .push_back(restartGap(crash));
      }
    }
  }
  const double rdzvOurs =
      rendezvous({run}, agents, 20000 + static_cast<int>(::getpid() % 20000));
  double rdzvTorch = 0, rdzvOursSmall = 0;
  if (haveTorchrun && torchrunAgents > 1) {
    auto prefix = torchrunArgs(0.1);
    prefix.push_back("--no_python");
    rdzvTorch = rendezvous(prefix, torchrunAgents,
                           21000 + static_cast<int>(::getpid() % 20000));
    rdzvOursSmall = rendezvous({run}, torchrunAgents,
                               22000 + static_cast<int>(::getpid() % 20000));
  }
  fs::remove_all(gTmp);

  trellis::bench::Report rep("elastic");
  rep.add("direct_2_workers_s", median(direct), "s");
  rep.add("elastic_run_launch_2_workers_s", median(ours), "s",
          "direct_2_workers_s");
  rep.add("elastic_run_launch_overhead_ms",
          1e3 * (median(ours) - median(direct)), "ms");
  rep.add("elastic_run_crash_to_restart_s", median(gapOurs), "s");
  if (haveTorchrun) {
    rep.add("torchrun_launch_2_workers_s", median(torchDefault), "s",
            "direct_2_workers_s");
    rep.add("torchrun_monitor_0.1_launch_2_workers_s", median(torchFast), "s",
            "direct_2_workers_s");
    rep.add("torchrun_crash_to_restart_s", median(gapTorchDefault), "s");
    rep.add("torchrun_monitor_0.1_crash_to_restart_s", median(gapTorchFast),
            "s");
    rep.add("elastic_run_vs_torchrun_launch", median(ours), "s",
            "torchrun_monitor_0.1_launch_2_workers_s");
    rep.add("elastic_run_vs_torchrun_crash_to_restart", median(gapOurs), "s",
            "torchrun_monitor_0.1_crash_to_restart_s");
  }
  rep.add("elastic_run_rendezvous_" + std::to_string(agents) + "_agents_s",
          rdzvOurs, "s");
  if (rdzvTorch > 0) {
    const std::string n = std::to_string(torchrunAgents);
    rep.add("torchrun_rendezvous_" + n + "_agents_s", rdzvTorch, "s");
    rep.add("elastic_run_rendezvous_" + n + "_agents_s", rdzvOursSmall, "s",
            "torchrun_rendezvous_" + n + "_agents_s");
  }
  rep.print(json);
  return 0;
}
