// DDP benchmark (issue 17): time per training step of an MLP and a small
// CNN under Trellis's DistributedDataParallel with 2 ranks (2 processes),
// against the same per-rank batch trained in one process, and against
// PyTorch's DDP (Debian's python3-torch, gloo) running the same models in
// the same run. `--json` prints one JSON object per line (DESIGN.md,
// "Benchmarks"); notes (`# ...`) go to stderr.
//
// Every measured process is a fresh one with the same thread settings
// (`--threads`, default 1: intra-op threads, OMP/MKL/OpenBLAS threads):
//  1. `--role single`: this program, each model alone (libtorch).
//  2. `--role worker` x 2: Trellis DDP over ProcessGroup::create("cpu"),
//     rendezvous through the TCPStoreServer this program hosts. Each model
//     three times: plain (the step figures), then with a comm hook that
//     wraps hooks::allreduce() and timestamps each bucket's launch and
//     completion (the overlap figures), then with gradientAsBucketView
//     (the `_bucket_view` figures).
//  3. bench/ddp_bench_torch.py under $TRELLIS_PYTHON (default
//     /usr/bin/python3): PyTorch single process, then DDP over gloo with 2
//     ranks, plain, with the same timestamping hook around torch's
//     default allreduce hook, and with gradient_as_bucket_view; it writes
//     its figures as JSON to a file.
// The three run in turn, `--rounds` times (default 3). A step is
// zero_grad, forward + loss, backward, SGD step; warm-up steps are left out;
// each figure is the median over the rounds of the median over the timed
// steps of rank 0. Overhead = DDP step - single-process step, each library
// against its own single process. From the hooked run, per step:
//  - last-bucket wait: from the last bucket's launch (the end of local
//    backward compute: the first layer's gradient is the last one) to
//    backward()'s return (gradients averaged and in .grad);
//  - allreduce busy: the union of the [launch, completion] spans;
//  - hidden fraction: the part of that union before the last launch,
//    over the union.
// Every wait is bounded (--timeout); a rank that fails ends the run with a
// non-zero exit and a message naming it.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_util.h"
#include <trellis/collectives/process_group.h>
#include <trellis/core/future.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>

#ifndef TRELLIS_DDP_BENCH_TORCH_SCRIPT
#define TRELLIS_DDP_BENCH_TORCH_SCRIPT "bench/ddp_bench_torch.py"
#endif

extern char** environ;

using namespace std::chrono_literals;
using namespace trellis;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWorld = 2;
const std::vector<std::string> kModels = {"mlp", "cnn"};

struct Flags {
  bool json = false;
  int steps = 30;
  int rounds = 3;
  int warmup = 8;
  int threads = 1;
  int timeoutS = 300;
  std::string python;
  std::string torchScript = TRELLIS_DDP_BENCH_TORCH_SCRIPT;
  std::string kill;  // testing: "trellis" or "torch" (rank 1 dies)
  // Internal (the processes this program starts).
  std::string role;
  int rank = 0;
  int round = 0;
  uint16_t storePort = 0;
  bool killMe = false;
};
Flags flags;

// ---- the models (bench/ddp_bench_torch.py defines the same) ---------------

constexpr int64_t kMlpIn = 1024;
constexpr int64_t kMlpHidden = 2048;
constexpr int64_t kMlpBatch = 32;
constexpr int64_t kCnnBatch = 32;

// 1024 -> 2048 -> 2048 -> 1024, ReLU between; MSE loss.
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kMlpIn, kMlpHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kMlpHidden, kMlpHidden))),
        fc3(register_module("fc3", torch::nn::Linear(kMlpHidden, kMlpIn))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

// 3x32x32 images: three 3x3 convolutions (32, 64, 64 channels; 2x2 max
// pooling after the first two), then 4096 -> 512 -> 10; cross entropy.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module(
            "conv1",
            torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 32, 3).padding(1)))),
        conv2(register_module(
            "conv2",
            torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        conv3(register_module(
            "conv3",
            torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 64, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 8 * 8, 512))),
        fc2(register_module("fc2", torch::nn::Linear(512, 10))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    auto x = torch::max_pool2d(torch::relu(conv1(input)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(conv3(x));
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1, conv2, conv3;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

using LossFn = std::function<at::Tensor(const at::Tensor&)>;

// Calls fn(net, x, loss) with the model (seed 1), this rank's batch (seed
// 2 + rank) and its loss, as ddp_bench_torch.py's make().
template <typename F>
void withModel(const std::string& name, int rank, F&& fn) {
  torch::manual_seed(1);
  if (name == "mlp") {
    Mlp net;
    torch::manual_seed(static_cast<uint64_t>(2 + rank));
    auto x = torch::randn({kMlpBatch, kMlpIn});
    auto y = torch::randn({kMlpBatch, kMlpIn});
    fn(net, x,
       LossFn([y](const at::Tensor& out) { return torch::mse_loss(out, y); }));
  } else {
    Cnn net;
    torch::manual_seed(static_cast<uint64_t>(2 + rank));
    auto x = torch::randn({kCnnBatch, 3, 32, 32});
    auto y = torch::randint(0, 10, {kCnnBatch}, torch::kLong);
    fn(net, x, LossFn([y](const at::Tensor& out) {
         return torch::cross_entropy_loss(out, y);
       }));
  }
}

// ---- timing ----------------------------------------------------------------

double ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// CPU time (user + system, ms) of this process (RUSAGE_SELF) or of the
// calling thread (RUSAGE_THREAD).
double cpuMs(int who) {
  rusage u{};
  ::getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

using Span = std::pair<Clock::time_point, Clock::time_point>;

// Length (ms) of the union of `spans`, clipped to [lo, hi].
double unionMs(std::vector<Span> spans, Clock::time_point lo,
               Clock::time_point hi) {
  std::sort(spans.begin(), spans.end());
  double total = 0;
  std::optional<Clock::time_point> end;
  for (auto [a, b] : spans) {
    a = std::max(a, lo);
    b = std::min(b, hi);
    if (b <= a) {
      continue;
    }
    if (!end || a > *end) {
      total += ms(b - a);
      end = b;
    } else if (b > *end) {
      total += ms(b - *end);
      end = b;
    }
  }
  return total;
}

// Launch and completion times of each bucket's allreduce in one step. The
// hook runs on autograd's thread, the completion on the group's.
class Recorder {
 public:
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    launch_.clear();
    done_.clear();
  }

  // hooks::allreduce() (what DDP does without a hook), timestamped. The
  // returned future completes after the completion is recorded, so every
  // span is closed when backward() returns.
  ddp::CommHook hook() {
    return [this, inner = ddp::hooks::allreduce()](ddp::GradBucket& b) {
      const size_t index = b.index;
      {
        std::lock_guard<std::mutex> lock(mu_);
        launch_[index] = Clock::now();
      }
      return inner(b).then([this, index](const at::Tensor& t) {
        std::lock_guard<std::mutex> lock(mu_);
        done_[index] = Clock::now();
        return t;
      });
    };
  }

  // The spans, and the last launch.
  std::pair<std::vector<Span>, Clock::time_point> spans() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Span> out;
    Clock::time_point last{};
    for (const auto& [index, t] : launch_) {
      last = std::max(last, t);
      auto d = done_.find(index);
      out.emplace_back(t, d == done_.end() ? t : d->second);
    }
    return {out, last};
  }

 private:
  std::mutex mu_;
  std::map<size_t, Clock::time_point> launch_;
  std::map<size_t, Clock::time_point> done_;
};

// Per-step samples by name ("step", "forward", ...), in ms (the hidden
// fraction in 0..1).
using Samples = std::map<std::string, std::vector<double>>;

// warmup + steps training steps of `forwardLoss` (forward and loss) over
// `params`; the timed steps' samples. With a recorder, also the overlap
// figures of the header.
Samples runSteps(const std::function<at::Tensor()>& forwardLoss,
                 const std::vector<at::Tensor>& params, Recorder* rec,
                 bool killMidway) {
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01));
  Samples s;
  size_t buckets = 0;
  for (int i = 0; i < flags.warmup + flags.steps; ++i) {
    if (killMidway && i == flags.warmup + 3) {
      ::raise(SIGKILL);  // testing the failure path (--kill)
    }
    if (rec != nullptr) {
      rec->clear();
    }
    const double self0 = cpuMs(RUSAGE_SELF);
    const double thread0 = cpuMs(RUSAGE_THREAD);
    const auto t0 = Clock::now();
    opt.zero_grad();
    auto loss = forwardLoss();
    const auto t1 = Clock::now();
    loss.backward();
    const auto t2 = Clock::now();
    opt.step();
    const auto t3 = Clock::now();
    const double thread = cpuMs(RUSAGE_THREAD) - thread0;
    const double others = cpuMs(RUSAGE_SELF) - self0 - thread;
    if (i < flags.warmup) {
      continue;
    }
    s["main_thread_cpu"].push_back(thread);
    s["other_threads_cpu"].push_back(others);
    s["step"].push_back(ms(t3 - t0));
    s["forward"].push_back(ms(t1 - t0));
    s["backward"].push_back(ms(t2 - t1));
    s["optim"].push_back(ms(t3 - t2));
    if (rec != nullptr) {
      auto [spans, last] = rec->spans();
      buckets = spans.size();
      const double busy =
          unionMs(spans, Clock::time_point::min(), Clock::time_point::max());
      const double hidden = unionMs(spans, t1, last);
      s["last_bucket_wait"].push_back(ms(t2 - last));
      s["allreduce_busy"].push_back(busy);
      s["hidden_fraction"].push_back(busy > 0 ? hidden / busy : 0);
    }
  }
  if (rec != nullptr) {
    s["buckets"].push_back(static_cast<double>(buckets));
  }
  return s;
}

// The median of `v` (the mean of the middle two for an even count).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// "<prefix>_<name> <median>" lines, plus the step's p10 and p90.
std::string summary(const std::string& prefix, const Samples& s) {
  std::ostringstream out;
  out.precision(6);
  for (const auto& [name, v] : s) {
    out << prefix << "_" << name << " " << median(v) << "\n";
  }
  out << prefix << "_step_p10 " << bench::percentile(s.at("step"), 0.1) << "\n";
  out << prefix << "_step_p90 " << bench::percentile(s.at("step"), 0.9) << "\n";
  return out.str();
}

// ---- the measured processes ------------------------------------------------

std::shared_ptr<store::Store> connectStore() {
  store::TCPStoreOptions o;
  o.port = flags.storePort;
  o.timeout = std::chrono::seconds(flags.timeoutS);
  return std::make_shared<store::PrefixStore>(
      "ddp-bench", std::make_shared<store::TCPStore>(o));
}

// The same thread settings as ddp_bench_torch.py's set_threads().
void setThreads() {
  at::set_num_threads(flags.threads);
  at::set_num_interop_threads(1);
}

int runSingle() {
  setThreads();
  auto st = connectStore();
  std::string result;
  for (const auto& name : kModels) {
    withModel(name, 0, [&](auto net, const at::Tensor& x, const LossFn& loss) {
      auto s = runSteps([&] { return loss(net->forward(x)); },
                        net->parameters(), nullptr, false);
      result += summary(name + "_single", s);
    });
  }
  st->set("result/single/" + std::to_string(flags.round),
          std::string_view(result));
  return 0;
}

int runWorker() {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  setThreads();
  auto st = connectStore();
  collectives::ProcessGroupOptions o;
  o.name = "ddp-bench";
  o.timeout = std::chrono::seconds(flags.timeoutS);
  o.initTimeout = std::chrono::seconds(60);
  auto pg = collectives::ProcessGroup::create("cpu", st, flags.rank, kWorld, o);
  std::string result;
  for (const auto& name : kModels) {
    // The defaults, the defaults with the timestamping hook, and
    // gradientAsBucketView (PyTorch's side runs the same three).
    for (const std::string mode : {"", "_hooked", "_bucket_view"}) {
      const bool hooked = mode == "_hooked";
      withModel(name, flags.rank,
                [&](auto net, const at::Tensor& x, const LossFn& loss) {
                  Recorder rec;  // outlives the model that holds its hook
                  ddp::Options options;
                  options.gradientAsBucketView = mode == "_bucket_view";
                  ddp::DistributedDataParallel model(net, pg, options);
                  if (hooked) {
                    model.registerCommHook(rec.hook());
                  }
                  pg->barrier().wait(pg->timeout());
                  auto s = runSteps(
                      [&] { return loss(model(x)); }, net->parameters(),
                      hooked ? &rec : nullptr,
                      flags.killMe && name == kModels[0] && mode.empty());
                  result += summary(name + "_trellis_ddp" + mode, s);
                });
    }
  }
  pg->barrier().wait(pg->timeout());
  if (flags.rank == 0) {
    st->set("result/ddp/" + std::to_string(flags.round),
            std::string_view(result));
  }
  return 0;
}

// ---- running processes, every wait bounded ---------------------------------

std::vector<std::string> childEnvironment() {
  const std::string n = std::to_string(flags.threads);
  const std::vector<std::pair<std::string, std::string>> set = {
      {"OMP_NUM_THREADS", n},
      {"MKL_NUM_THREADS", n},
      {"OPENBLAS_NUM_THREADS", n}};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (std::none_of(set.begin(), set.end(),
                     [&](const auto& v) { return v.first == key; })) {
      env.push_back(kv);
    }
  }
  for (const auto& [k, v] : set) {
    env.push_back(k + "=" + v);
  }
  return env;
}

std::string describeStatus(int status) {
  if (WIFEXITED(status)) {
    return "exited with " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") +
           std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "ended with status " + std::to_string(status);
}

// Runs the commands as processes side by side, stdout going to stderr
// (notes), stdin closed. Returns "" when all exit with 0 within `timeout`;
// otherwise kills the rest (a peer of a failed rank would only fail at the
// group's timeout) and returns what happened, naming the process.
std::string runProcesses(const std::string& what,
                         const std::vector<std::vector<std::string>>& cmds,
                         std::chrono::seconds timeout) {
  const auto envStrings = childEnvironment();
  std::vector<char*> envp;
  for (const auto& s : envStrings) {
    envp.push_back(const_cast<char*>(s.c_str()));
  }
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null",
                                   O_RDONLY, 0);
  std::vector<pid_t> pids;
  std::string error;
  for (const auto& cmd : cmds) {
    std::vector<char*> argv;
    for (const auto& a : cmd) {
      argv.push_back(const_cast<char*>(a.c_str()));
    }
    argv.push_back(nullptr);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(),
                                 envp.data());
    if (rc != 0) {
      error = what + ": cannot start " + cmd[0] + ": " + std::strerror(rc);
      break;
    }
    pids.push_back(pid);
  }
  posix_spawn_file_actions_destroy(&actions);
  std::vector<bool> running(pids.size(), true);
  auto deadline = Clock::now() + timeout;
  bool graceSet = false;
  while (std::count(running.begin(), running.end(), true) > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      int status = 0;
      if (!running[i] || ::waitpid(pids[i], &status, WNOHANG) != pids[i]) {
        continue;
      }
      running[i] = false;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        // Every failure is named: the rank that died first may be reaped
        // after a peer that failed because of it.
        error += (error.empty() ? what : ";") +
                 (pids.size() > 1 ? " rank " + std::to_string(i) : "") + " " +
                 describeStatus(status);
      }
    }
    if (!error.empty() && !graceSet) {
      // Give the others a moment to report their side, then stop them.
      deadline = std::min(deadline, Clock::now() + 5s);
      graceSet = true;
    }
    if (Clock::now() >= deadline) {
      if (error.empty()) {
        error = what + " ran past --timeout (" +
                std::to_string(timeout.count()) + " s)";
      }
      for (size_t i = 0; i < pids.size(); ++i) {
        if (running[i]) {
          ::kill(pids[i], SIGKILL);
          ::waitpid(pids[i], nullptr, 0);  // SIGKILLed: returns at once
          running[i] = false;
        }
      }
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  return error;
}

// "metric value" lines into the report, in the given unit.
std::map<std::string, double> parseLines(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream f(line);
    std::string metric;
    double value = 0;
    if (f >> metric >> value) {
      out[metric] = value;
    }
  }
  return out;
}

// ---- PyTorch's side --------------------------------------------------------

std::string lastLine(const std::string& text) {
  auto end = text.find_last_not_of("\n ");
  if (end == std::string::npos) {
    return "";
  }
  auto start = text.rfind('\n', end);
  return text.substr(start == std::string::npos ? 0 : start + 1,
                     end + 1 - (start == std::string::npos ? 0 : start + 1));
}

std::string readFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string tempPath(const std::string& stem) {
  std::string p = "/tmp/" + stem + "XXXXXX";
  const int fd = ::mkstemp(p.data());
  if (fd < 0) {
    std::perror("mkstemp");
    std::exit(1);
  }
  ::close(fd);
  return p;
}

// Why the PyTorch baseline cannot run here, or "" when it can: the
// interpreter imports torch with gloo (bounded, its stderr kept).
std::string torchUnavailable() {
  if (::access(flags.torchScript.c_str(), R_OK) != 0) {
    return flags.torchScript + " not found (--torch-script)";
  }
  const std::string err = tempPath("ddp_bench_check_");
  const std::string code =
      "import sys, torch, torch.distributed as d\n"
      "if not (d.is_available() and d.is_gloo_available()):\n"
      "  sys.exit(\"torch.distributed without gloo\")\n";
  const std::string cmd =
      "exec " + flags.python + " -c '" + code + "' 2>" + err + " >/dev/null";
  const std::string failed =
      runProcesses("the torch check", {{"/bin/sh", "-c", cmd}}, 120s);
  const std::string why = lastLine(readFile(err));
  ::unlink(err.c_str());
  if (failed.empty()) {
    return "";
  }
  return flags.python + " cannot import torch with gloo (" +
         (why.empty() ? failed : why) + ")";
}

// Runs ddp_bench_torch.py; its figures as "metric value" pairs named like
// ours (<model>_torch_single_step, ...). Throws on a failed run; notes the
// version in round 0.
std::map<std::string, double> runTorch(int round) {
  const std::string out = tempPath("ddp_bench_torch_out_");
  std::vector<std::string> cmd = {flags.python, flags.torchScript,
                                  "--steps",    std::to_string(flags.steps),
                                  "--warmup",   std::to_string(flags.warmup),
                                  "--threads",  std::to_string(flags.threads),
                                  "--timeout",  std::to_string(flags.timeoutS),
                                  "--out",      out};
  if (flags.kill == "torch") {
    cmd.insert(cmd.end(), {"--kill-rank", "1"});
  }
  // The script bounds its DDP phase by --timeout; the single-process phase
  // and the imports come on top.
  const std::string error =
      runProcesses("PyTorch's run (" + flags.torchScript + ")", {cmd},
                   std::chrono::seconds(flags.timeoutS + 180));
  const std::string text = readFile(out);
  ::unlink(out.c_str());
  if (!error.empty()) {
    throw std::runtime_error(error);
  }
  const auto j = nlohmann::json::parse(text);
  if (round == 0) {
    bench::note("PyTorch " + j.at("torch_version").get<std::string>() + ", " +
                std::to_string(j.at("threads").get<int>()) +
                " thread(s) per process");
  }
  std::map<std::string, double> figures;
  for (const auto& name : kModels) {
    for (const std::string mode :
         {"single", "ddp", "ddp_hooked", "ddp_bucket_view"}) {
      for (const auto& [k, v] : j.at(name + "_" + mode).items()) {
        figures[name + "_torch_" + mode + "_" + k] = v.get<double>();
      }
    }
  }
  return figures;
}

// ---- the program -----------------------------------------------------------

bench::Report report("ddp");

void target(const std::string& what, double value, bool measured, bool ok) {
  char line[256];
  std::snprintf(line, sizeof(line), "target %s: %.2f %s", what.c_str(), value,
                measured ? (ok ? "✔" : "✘") : "(not measured)");
  if (flags.json) {
    bench::note(line);
  } else {
    std::printf("%s\n", line);
  }
}

// The rows of one library (`lib`: "trellis" or "torch") for one model.
void addRows(const std::string& m, const std::string& lib,
             const std::map<std::string, double>& f) {
  const std::string single =
      lib == "trellis" ? m + "_single" : m + "_torch_single";
  const std::string ddp = m + "_" + lib + "_ddp";
  auto get = [&](const std::string& k) {
    auto it = f.find(k);
    if (it == f.end()) {
      throw std::runtime_error("figure " + k + " missing from the run");
    }
    return it->second;
  };
  for (const std::string part : {"step", "forward", "backward", "optim"}) {
    report.add(single + "_" + part + "_median", get(single + "_" + part), "ms");
  }
  for (const std::string part : {"step", "forward", "backward", "optim"}) {
    report.add(ddp + "_" + part + "_median", get(ddp + "_" + part), "ms",
               single + "_" + part + "_median");
  }
  report.add(ddp + "_hooked_step_median", get(ddp + "_hooked_step"), "ms",
             ddp + "_step_median");
  for (const std::string part : {"step", "forward", "backward"}) {
    report.add(ddp + "_" + part + "_overhead",
               get(ddp + "_" + part) - get(single + "_" + part), "ms",
               lib == "trellis" ? m + "_torch_ddp_" + part + "_overhead" : "");
  }
  // gradientAsBucketView on both sides (PyTorch's
  // gradient_as_bucket_view): like against like.
  const std::string view = ddp + "_bucket_view";
  report.add(view + "_step_median", get(view + "_step"), "ms",
             single + "_step_median");
  report.add(
      view + "_step_overhead", get(view + "_step") - get(single + "_step"),
      "ms", lib == "trellis" ? m + "_torch_ddp_bucket_view_step_overhead" : "");
  report.add(
      view + "_cpu_overhead",
      get(view + "_main_thread_cpu") + get(view + "_other_threads_cpu") -
          get(single + "_main_thread_cpu") - get(single + "_other_threads_cpu"),
      "ms", lib == "trellis" ? m + "_torch_ddp_bucket_view_cpu_overhead" : "");
  report.add(ddp + "_last_bucket_wait_median",
             get(ddp + "_hooked_last_bucket_wait"), "ms",
             lib == "trellis" ? m + "_torch_ddp_last_bucket_wait_median" : "");
  report.add(ddp + "_allreduce_busy_median",
             get(ddp + "_hooked_allreduce_busy"), "ms",
             lib == "trellis" ? m + "_torch_ddp_allreduce_busy_median" : "");
  report.add(ddp + "_hidden_fraction", get(ddp + "_hooked_hidden_fraction"),
             "1");
  // CPU per step of the step's thread and of every other thread of the
  // process (communication, progress, watchdog): on 2 cores with a rank
  // per core, the others' CPU is taken from the ranks' compute.
  report.add(single + "_main_thread_cpu_median",
             get(single + "_main_thread_cpu"), "ms");
  report.add(ddp + "_main_thread_cpu_median", get(ddp + "_main_thread_cpu"),
             "ms", single + "_main_thread_cpu_median");
  report.add(ddp + "_other_threads_cpu_median", get(ddp + "_other_threads_cpu"),
             "ms",
             lib == "trellis" ? m + "_torch_ddp_other_threads_cpu_median" : "");
  // What DDP costs in CPU per step, all threads: steadier than the wall
  // time on a loaded machine, where a rank's wall time includes waiting
  // for a core.
  report.add(ddp + "_cpu_overhead",
             get(ddp + "_main_thread_cpu") + get(ddp + "_other_threads_cpu") -
                 get(single + "_main_thread_cpu") -
                 get(single + "_other_threads_cpu"),
             "ms", lib == "trellis" ? m + "_torch_ddp_cpu_overhead" : "");
  char line[256];
  std::snprintf(line, sizeof(line),
                "%s %s: step p10 %.1f / median %.1f / p90 %.1f ms (single "
                "%.1f / %.1f / %.1f), %g buckets",
                m.c_str(), lib.c_str(), get(ddp + "_step_p10"),
                get(ddp + "_step"), get(ddp + "_step_p90"),
                get(single + "_step_p10"), get(single + "_step"),
                get(single + "_step_p90"), get(ddp + "_hooked_buckets"));
  bench::note(line);
}

int runMain() {
  const auto t0 = Clock::now();
  if (flags.python.empty()) {
    const char* env = std::getenv("TRELLIS_PYTHON");
    flags.python = env != nullptr && *env != '\0' ? env : "/usr/bin/python3";
  }
  store::TCPStoreServer server;
  flags.storePort = server.port();
  const auto st = connectStore();
  const std::vector<std::string> common = {
      "--role",       "",
      "--steps",      std::to_string(flags.steps),
      "--warmup",     std::to_string(flags.warmup),
      "--threads",    std::to_string(flags.threads),
      "--timeout",    std::to_string(flags.timeoutS),
      "--store-port", std::to_string(flags.storePort)};
  auto command = [&](const std::string& role, int rank, int round) {
    std::vector<std::string> c = {"/proc/self/exe"};
    c.insert(c.end(), common.begin(), common.end());
    c[2] = role;
    c.insert(c.end(), {"--rank", std::to_string(rank), "--round",
                       std::to_string(round)});
    if (flags.kill == "trellis" && role == "worker" && rank == 1) {
      c.push_back("--kill-me");
    }
    return c;
  };
  const auto timeout = std::chrono::seconds(flags.timeoutS);
  const std::string unavailable = torchUnavailable();
  if (!unavailable.empty()) {
    bench::note("the PyTorch baseline is unavailable: " + unavailable +
                "; deploy/install-deps.sh installs python3-torch, or set "
                "TRELLIS_PYTHON to an interpreter with torch");
  }
  // Rounds of single, Trellis, PyTorch in turn, so that a change in the
  // machine's load hits all three; each figure is the median over rounds.
  std::string torchError;
  std::vector<std::map<std::string, double>> rounds;
  for (int r = 0; r < flags.rounds && torchError.empty(); ++r) {
    const std::string round = std::to_string(r);
    std::string error = runProcesses("the single-process run",
                                     {command("single", 0, r)}, timeout);
    if (!error.empty()) {
      std::fprintf(stderr, "ddp_bench: %s\n", error.c_str());
      return 1;
    }
    auto figures = parseLines(st->getString("result/single/" + round));
    error = runProcesses("Trellis's DDP run",
                         {command("worker", 0, r), command("worker", 1, r)},
                         timeout);
    if (!error.empty()) {
      std::fprintf(stderr, "ddp_bench: %s\n", error.c_str());
      return 1;
    }
    figures.merge(parseLines(st->getString("result/ddp/" + round)));
    if (unavailable.empty()) {
      try {
        figures.merge(runTorch(r));
      } catch (const std::exception& e) {
        torchError = e.what();
      }
    }
    rounds.push_back(std::move(figures));
  }
  std::map<std::string, std::vector<double>> all;
  for (const auto& round : rounds) {
    for (const auto& [k, v] : round) {
      all[k].push_back(v);
    }
  }
  std::map<std::string, double> figures;
  for (const auto& [k, v] : all) {
    figures[k] = median(v);
  }
  const bool haveTorch = unavailable.empty() && torchError.empty();
  for (const auto& m : kModels) {
    addRows(m, "trellis", figures);
    if (haveTorch) {
      addRows(m, "torch", figures);
    }
  }
  for (const std::string mode : {"", "_bucket_view"}) {
    for (const auto& lib : {"trellis", "torch"}) {
      for (const auto& m : kModels) {
        std::string line =
            m + " " + lib + mode + " step overhead by round (ms):";
        for (const auto& round : rounds) {
          auto a = round.find(m + "_" + lib + "_ddp" + mode + "_step");
          auto b =
              round.find(m + (lib == std::string("trellis") ? "" : "_torch") +
                         "_single_step");
          if (a != round.end() && b != round.end()) {
            line += " " + std::to_string(a->second - b->second).substr(0, 6);
          }
        }
        bench::note(line);
      }
    }
  }
  for (const auto& m : kModels) {
    if (!haveTorch) {
      break;
    }
    report.add(m + "_trellis_ddp_step_vs_torch",
               report.valueOf(m + "_trellis_ddp_step_median"), "ms",
               m + "_torch_ddp_step_median");
    report.add(m + "_trellis_ddp_hidden_fraction_vs_torch",
               report.valueOf(m + "_trellis_ddp_hidden_fraction"), "1",
               m + "_torch_ddp_hidden_fraction");
  }
  report.print(flags.json);
  std::fflush(stdout);  // the table before the notes that follow it
  for (const std::string mode : {"", "_bucket_view"}) {
    for (const auto& m : kModels) {
      const double ours =
          report.valueOf(m + "_trellis_ddp" + mode + "_step_overhead");
      const double theirs =
          report.valueOf(m + "_torch_ddp" + mode + "_step_overhead");
      target(m + " DDP overhead / PyTorch's DDP overhead <= 0.5" +
                 (mode.empty() ? "" : " (both with gradient as bucket view)"),
             theirs > 0 ? ours / theirs : 0, haveTorch && theirs > 0,
             ours <= 0.5 * theirs);
    }
  }
  const double hidden = report.valueOf("cnn_trellis_ddp_hidden_fraction");
  target("cnn allreduce time hidden behind backward >= 0.5", hidden, true,
         hidden >= 0.5);
  bench::note(
      "total " +
      std::to_string(std::chrono::duration<double>(Clock::now() - t0).count()) +
      " s");
  if (!torchError.empty()) {
    std::fprintf(stderr, "ddp_bench: %s\n", torchError.c_str());
    return 1;
  }
  return 0;
}

[[noreturn]] void usage(const char* self) {
  std::fprintf(
      stderr,
      "usage: %s [--json] [--rounds N] [--steps N] [--warmup N] [--threads N]\n"
      "          [--timeout S] [--python PATH] [--torch-script PATH]\n"
      "  --rounds N     single, Trellis, PyTorch in turn N times; figures "
      "are the\n"
      "                 medians over rounds (default 3)\n"
      "  --steps N      timed steps per model and mode (default 30)\n"
      "  --warmup N     steps before them, not timed (default 8)\n"
      "  --threads N    intra-op (OMP/MKL/OpenBLAS) threads of every "
      "process (default 1:\n"
      "                 2 ranks x 1 thread on this 2-core machine)\n"
      "  --timeout S    bound on each run and on every collective "
      "(default 300)\n"
      "  --python PATH  interpreter for PyTorch's DDP (default "
      "$TRELLIS_PYTHON,\n"
      "                 else /usr/bin/python3)\n"
      "  --torch-script PATH  ddp_bench_torch.py (default: the source "
      "tree's)\n"
      "  --kill trellis|torch  testing: rank 1 SIGKILLs itself mid-run\n",
      self);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool hasValue = i + 1 < argc;
    if (a == "--json") {
      flags.json = true;
    } else if (a == "--steps" && hasValue) {
      flags.steps = static_cast<int>(
          bench::flagValue("ddp_bench", "--steps", argv[++i], 1, 1000000));
    } else if (a == "--warmup" && hasValue) {
      flags.warmup = static_cast<int>(
          bench::flagValue("ddp_bench", "--warmup", argv[++i], 1, 1000000));
    } else if (a == "--threads" && hasValue) {
      flags.threads = static_cast<int>(
          bench::flagValue("ddp_bench", "--threads", argv[++i], 1, 1024));
    } else if (a == "--timeout" && hasValue) {
      flags.timeoutS = static_cast<int>(
          bench::flagValue("ddp_bench", "--timeout", argv[++i], 10, 86400));
    } else if (a == "--python" && hasValue) {
      flags.python = argv[++i];
    } else if (a == "--torch-script" && hasValue) {
      flags.torchScript = argv[++i];
    } else if (a == "--kill" && hasValue) {
      flags.kill = argv[++i];
    } else if (a == "--role" && hasValue) {
      flags.role = argv[++i];
    } else if (a == "--rounds" && hasValue) {
      flags.rounds = static_cast<int>(
          bench::flagValue("ddp_bench", "--rounds", argv[++i], 1, 1000));
    } else if (a == "--round" && hasValue) {
      flags.round = static_cast<int>(
          bench::flagValue("ddp_bench", "--round", argv[++i], 0, 1000));
    } else if (a == "--rank" && hasValue) {
      flags.rank = static_cast<int>(
          bench::flagValue("ddp_bench", "--rank", argv[++i], 0, 1 << 16));
    } else if (a == "--store-port" && hasValue) {
      flags.storePort = static_cast<uint16_t>(
          bench::flagValue("ddp_bench", "--store-port", argv[++i], 1, 65535));
    } else if (a == "--kill-me") {
      flags.killMe = true;
    } else {
      usage(argv[0]);
    }
  }
  try {
    if (flags.role == "single") {
      return runSingle();
    }
    if (flags.role == "worker") {
      return runWorker();
    }
    return runMain();
  } catch (const std::exception& e) {
    std::fprintf(
        stderr, "ddp_bench (%s): %s\n",
        flags.role.empty()
            ? "main"
            : (flags.role + " rank " + std::to_string(flags.rank)).c_str(),
        e.what());
    return 1;
  }
}
