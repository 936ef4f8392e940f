#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <filesystem>
#include <linux/close_range.h>
#include <netdb.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/attempt_watch.h>
#include <trellis/elastic/group_keeper.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/worker_env.h>
#include <trellis/elastic/worker_process.h>

namespace trellis::elastic {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// The self-pipe the signal handler writes to; one Agent runs at a time.
int gSignalPipe[2] = {-1, -1};

void onSignal(int signo) {
  const int saved = errno;
  const auto b = static_cast<unsigned char>(signo);
  [[maybe_unused]] const ssize_t n = ::write(gSignalPipe[1], &b, 1);
  errno = saved;
}

constexpr const int (&kHandled)[std::size(kAgentSignals)] = kAgentSignals;

// Installs the handlers and the pipe for run()'s duration.
class SignalScope {
 public:
  SignalScope() {
    if (::pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      throwError(Error::fromErrno(errno, "elastic-run: pipe"));
    }
    for (size_t i = 0; i < std::size(kHandled); ++i) {
      struct sigaction sa {};
      sa.sa_handler = kHandled[i] == SIGPIPE ? SIG_IGN : onSignal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;
      ::sigaction(kHandled[i], &sa, &saved_[i]);
    }
  }
  ~SignalScope() {
    for (size_t i = 0; i < std::size(kHandled); ++i) {
      ::sigaction(kHandled[i], &saved_[i], nullptr);
    }
    ::close(gSignalPipe[0]);
    ::close(gSignalPipe[1]);
    gSignalPipe[0] = gSignalPipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  struct sigaction saved_[std::size(kHandled)]{};
};

Error makeDirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) {
    return Error::fromErrno(ec.value(), "cannot create " + path);
  }
  return Error();
}

// torchrun's run folder: <base>/<run id>_<random>.
std::string makeRunLogDir(const ElasticOptions& options,
                          const Environment& env) {
  std::string base;
  if (options.logDir) {
    base = *options.logDir;
  } else {
    const auto tmp = env.find("TMPDIR");
    base = tmp != env.end() && !tmp->second.empty() ? tmp->second : "/tmp";
    base += "/torchelastic";
  }
  throwIfError(makeDirs(base));
  std::string pattern = base + "/" + options.rdzvId + "_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throwError(Error::fromErrno(errno, "cannot create a folder in " + base));
  }
  return pattern;
}

// The rendezvous of --rdzv-backend (one node: a trivial local one).
std::unique_ptr<Rendezvous> makeRendezvous(const ElasticOptions& options,
                                           const std::string& runLogDir,
                                           const auth::JobToken& token,
                                           const LogFn& logFn,
                                           const Interruption& interrupted,
                                           bool shareStore) {
  return options.rdzvBackend == RdzvBackend::kEtcd
             ? makeEtcdRendezvous(options, runLogDir, token, logFn, interrupted)
         : usesC10d(options)
             ? makeC10dRendezvous(options, runLogDir, token, logFn, interrupted,
                                  shareStore)
         : staticSeveral(options)
             ? makeStaticRendezvous(options, runLogDir, token, logFn,
                                    interrupted)
             : makeLocalRendezvous(options, runLogDir, token);
}

// Starts the attempt's workers, one per local rank, each with its log
// folder under `attemptDir`; stops at the first that cannot be executed
// and returns why.
std::optional<std::string> startWorkers(std::vector<Worker>& workers,
                                        const ElasticOptions& options,
                                        const AgentConfig& config,
                                        const RendezvousOutcome& outcome,
                                        const std::string& attemptDir,
                                        GroupKeeper& keeper) {
  std::optional<std::string> execFailure;
  const pid_t agentPid = ::getpid();
  for (int32_t lr = 0; lr < options.nprocPerNode && !execFailure; ++lr) {
    Worker& w = workers[static_cast<size_t>(lr)];
    const std::string dir = attemptDir + "/" + std::to_string(lr);
    throwIfError(makeDirs(dir));
    const Environment env = workerEnvironment(options, outcome, lr, config.env);
    w.exit.localRank = lr;
    w.exit.rank = outcome.rankOffset + lr;
    w.exit.errorFile = env.at(kErrorFileEnvVar);
    // A round that does not count as a restart reuses the attempt's
    // folder: an old error file must not pass for a new failure.
    std::error_code ignored;
    std::filesystem::remove(w.exit.errorFile, ignored);

    execFailure = startWorker(w,
                              {.options = options,
                               .config = config,
                               .localRank = lr,
                               .dir = dir,
                               .env = env,
                               .agentPid = agentPid},
                              keeper);
  }
  return execFailure;
}

// What the rendezvous tells the other nodes about this node's failure.
std::string describeFailure(const AttemptResult& attempt) {
  if (!attempt.firstFailure) {
    return "a worker failed";
  }
  const WorkerExit& f = attempt.workers[*attempt.firstFailure];
  return "local rank " + std::to_string(f.localRank) + " (rank " +
         std::to_string(f.rank) + ") " + f.describe();
}

// Drains the signal pipe between rendezvous moves; true once the agent
// got a signal other than SIGCHLD (the first one is kept in agentSignal).
bool drainSignals(int& agentSignal) {
  unsigned char sigs[64];
  for (ssize_t n; (n = ::read(gSignalPipe[0], sigs, sizeof(sigs))) > 0;) {
    for (ssize_t i = 0; i < n; ++i) {
      if (sigs[i] != SIGCHLD && agentSignal == 0) {
        agentSignal = sigs[i];
      }
    }
  }
  return agentSignal != 0;
}

}  // namespace

const char* agentStateName(AgentState state) {
  switch (state) {
    case AgentState::kInit:
      return "INIT";
    case AgentState::kRendezvous:
      return "RENDEZVOUS";
    case AgentState::kRunning:
      return "RUNNING";
    case AgentState::kRestarting:
      return "RESTARTING";
    case AgentState::kSucceeded:
      return "SUCCEEDED";
    case AgentState::kFailed:
      return "FAILED";
  }
  return "?";
}

std::string WorkerExit::describe() const {
  if (signal != 0) {
    return "killed by signal " + std::to_string(signal) + " (" +
           signalName(signal) + ")";
  }
  return "exited with code " + std::to_string(exitCode);
}

bool usesC10d(const ElasticOptions& options) {
  return options.rdzvBackend == RdzvBackend::kC10d && !options.standalone;
}

void checkSupported(const ElasticOptions& options) {
  if (options.rdzvBackend == RdzvBackend::kEtcdV2) {
    throw InvalidArgumentError(Error::invalidArgument(
        "--rdzv-backend etcd-v2: etcd v2 API is not supported; use etcd (v3)"));
  }
}

bool staticSeveral(const ElasticOptions& options) {
  return options.rdzvBackend == RdzvBackend::kStatic && !options.standalone &&
         options.maxNodes > 1;
}

void checkJobToken(const ElasticOptions& options, const Environment& env) {
  const bool several = usesC10d(options) ||
                       options.rdzvBackend == RdzvBackend::kEtcd ||
                       staticSeveral(options);
  if (!several || options.maxNodes <= 1) {
    return;
  }
  const auto it = env.find(auth::kTokenEnvVar);
  if (it == env.end() || it->second.empty()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "--rdzv-backend " + std::string(backendName(options.rdzvBackend)) +
        " with --nnodes " + std::to_string(options.minNodes) + ":" +
        std::to_string(options.maxNodes) + " needs " + auth::kTokenEnvVar +
        ": every node's agent must be given the same secret (e.g. export " +
        auth::kTokenEnvVar +
        "=$(openssl rand -hex 32) once, and pass it to every node); the "
        "rendezvous store and the workers authenticate with it"));
  }
}

uint16_t pickFreePort(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0) {
    throw InvalidArgumentError(Error::invalidArgument(
        "cannot resolve master address '" + host + "': " + gai_strerror(rc)));
  }
  int err = EADDRNOTAVAIL;
  uint16_t port = 0;
  for (addrinfo* a = res; a != nullptr && port == 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      port = bound.ss_family == AF_INET6
                 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                 : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    } else {
      err = errno;
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (port == 0) {
    throwError(Error::fromErrno(err, "cannot bind a port on '" + host + "'"));
  }
  return port;
}

Agent::Agent(ElasticOptions options, AgentConfig config)
    : options_(std::move(options)), config_(std::move(config)) {}

void Agent::setState(AgentState next) { state_ = next; }

void Agent::log(const std::string& line) const {
  writeAll(config_.logFd, "elastic-run: " + line + "\n");
}

RunResult Agent::run() {
  checkSupported(options_);
  checkJobToken(options_, config_.env);
  if (options_.workerArgv.empty()) {
    throw InvalidArgumentError(Error::invalidArgument("no worker command"));
  }
  SignalScope signals;
  // Ends what the workers started if this process dies (group_keeper.h).
  GroupKeeper keeper;
  RunResult result;
  result.runId = options_.rdzvId;
  result.runLogDir = makeRunLogDir(options_, config_.env);
  const auth::JobToken token = jobTokenForRun(config_.env);
  if (auto note = ompNumThreadsWarning(options_, config_.env)) {
    writeAll(config_.logFd, *note + "\n");
  }
  int32_t restartCount = 0;
  int agentSignal = 0;
  auto interrupted = [&] { return drainSignals(agentSignal); };
  auto fail = [&](int exitCode, std::string summary) {
    setState(AgentState::kFailed);
    result.state = state_;
    result.exitCode = exitCode;
    result.summary = std::move(summary);
    return result;
  };
  auto signalled = [&](const char* when) {
    result.agentSignal = agentSignal;
    return fail(kExitSignalBase + agentSignal,
                "stopped by " + signalName(agentSignal) + " " + when);
  };
  std::string storeNote;
  const bool shareStore =
      agentStoreForWorkers(options_, config_.env, &storeNote);
  if (!storeNote.empty()) {
    log(storeNote);
  }
  // Connecting to the backend's store waits up to join_timeout; it looks
  // at `interrupted` about every second.
  std::unique_ptr<Rendezvous> rdzv;
  try {
    rdzv = makeRendezvous(
        options_, result.runLogDir, token,
        [this](const std::string& l) { log(l); }, interrupted, shareStore);
  } catch (const Interrupted&) {
    return signalled("while connecting to the rendezvous");
  }

  for (;;) {
    // RENDEZVOUS: a closed round this node is in (one node: the port).
    setState(AgentState::kRendezvous);
    RendezvousOutcome outcome;
    try {
      outcome = rdzv->next(interrupted);
    } catch (const Interrupted&) {
      return signalled("during the rendezvous");
    } catch (const JobFailed& f) {
      return fail(kExitWorkerFailed, "the job failed: " + f.note);
    }
    restartCount = outcome.restartCount;
    result.masterPort = outcome.masterPort;

    // RUNNING: start the group.
    setState(AgentState::kRunning);
    const std::string attemptDir =
        result.runLogDir + "/attempt_" + std::to_string(restartCount);
    std::vector<Worker> workers(static_cast<size_t>(options_.nprocPerNode));
    const std::optional<std::string> execFailure =
        startWorkers(workers, options_, config_, outcome, attemptDir, keeper);

    // Watch them until every one is reaped.
    WatchEnd end =
        watchAttempt(workers, execFailure.has_value(), restartCount,
                     {.options = options_,
                      .config = config_,
                      .rdzv = *rdzv,
                      .keeper = keeper,
                      .log = [this](const std::string& l) { log(l); },
                      .signalFd = gSignalPipe[0],
                      .agentSignal = agentSignal});
    const AttemptResult& attempt = end.attempt;
    result.attempts.push_back(attempt);

    if (execFailure) {
      return fail(kExitExecFailed, *execFailure);
    }
    if (agentSignal != 0) {
      return signalled("while the workers ran; they were stopped");
    }
    if (end.rdzvLost) {
      return fail(kExitWorkerFailed, "lost the rendezvous (" + *end.rdzvLost +
                                         "); the workers were stopped");
    }
    if (end.jobFailed) {
      return fail(kExitWorkerFailed, "the job failed: " + rdzv->failureNote());
    }
    if (end.groupRestart) {
      setState(AgentState::kRestarting);
      continue;
    }
    bool allOk = true;
    for (const auto& w : attempt.workers) {
      allOk = allOk && w.succeeded();
    }
    if (allOk) {
      // The exit barrier: every node of the round finishes, or none does.
      BarrierResult barrier;
      try {
        barrier = rdzv->finish(interrupted);
      } catch (const Interrupted&) {
        return signalled("at the exit barrier");
      } catch (const std::exception& e) {
        return fail(
            kExitWorkerFailed,
            std::string("exit barrier: lost the rendezvous: ") + e.what());
      }
      if (barrier.event == GroupEvent::kRestart) {
        log("restarting the worker group: " + barrier.message);
        setState(AgentState::kRestarting);
        continue;
      }
      if (barrier.event == GroupEvent::kJobFailed) {
        return fail(kExitWorkerFailed, barrier.message);
      }
      setState(AgentState::kSucceeded);
      result.state = state_;
      result.exitCode = 0;
      return result;
    }
    GroupEvent next = GroupEvent::kJobFailed;
    try {
      next = rdzv->reportFailure(describeFailure(attempt));
    } catch (const std::exception& e) {
      return fail(kExitWorkerFailed,
                  std::string("lost the rendezvous: ") + e.what());
    }
    if (next == GroupEvent::kRestart) {
      setState(AgentState::kRestarting);
      log("restarting the worker group (restart " +
          std::to_string(restartCount + 1) + ", --max-restarts " +
          std::to_string(options_.maxRestarts) + ")");
      continue;
    }

    // FAILED: one summary, rooted in the first failure.
    return fail(kExitWorkerFailed, failureSummary(attempt, options_.maxRestarts,
                                                  result.runLogDir));
  }
}

}  // namespace trellis::elastic
