#include <algorithm>
#include <arpa/inet.h>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <filesystem>
#include <netdb.h>
#include <poll.h>
#include <linux/close_range.h>
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
#include <trellis/elastic/group_keeper.h>
#include <trellis/elastic/worker_process.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/worker_env.h>

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

std::string signalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev
                           : "signal " + std::to_string(sig);
}

// See AttemptResult::firstFailure.
std::optional<size_t> rootCause(const std::vector<WorkerExit>& workers) {
  auto when = [](const WorkerExit& w) {
    return std::pair{w.error && w.error->timestamp > 0 ? w.error->timestamp
                                                       : w.endedAtUnix,
                     w.endedAt};
  };
  std::optional<size_t> root;
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerExit& w = workers[i];
    if (w.succeeded() || w.pid <= 0 || (w.stoppedByAgent && !w.error)) {
      continue;
    }
    if (!root || when(w) < when(workers[*root])) {
      root = i;
    }
  }
  return root;
}

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
  const int32_t nproc = options_.nprocPerNode;
  int32_t restartCount = 0;
  int agentSignal = 0;
  // Drains the signal pipe between rendezvous moves; true once the agent
  // got a signal other than SIGCHLD.
  auto interrupted = [&] {
    unsigned char sigs[64];
    for (ssize_t n; (n = ::read(gSignalPipe[0], sigs, sizeof(sigs))) > 0;) {
      for (ssize_t i = 0; i < n; ++i) {
        if (sigs[i] != SIGCHLD && agentSignal == 0) {
          agentSignal = sigs[i];
        }
      }
    }
    return agentSignal != 0;
  };
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
    const LogFn logFn = [this](const std::string& l) { log(l); };
    rdzv = options_.rdzvBackend == RdzvBackend::kEtcd
               ? makeEtcdRendezvous(options_, result.runLogDir, token, logFn,
                                    interrupted)
           : usesC10d(options_)
               ? makeC10dRendezvous(options_, result.runLogDir, token, logFn,
                                    interrupted, shareStore)
           : staticSeveral(options_)
               ? makeStaticRendezvous(options_, result.runLogDir, token, logFn,
                                      interrupted)
               : makeLocalRendezvous(options_, result.runLogDir, token);
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
    std::vector<Worker> workers(static_cast<size_t>(nproc));
    std::optional<std::string> execFailure;
    const pid_t agentPid = ::getpid();
    for (int32_t lr = 0; lr < nproc && !execFailure; ++lr) {
      Worker& w = workers[static_cast<size_t>(lr)];
      const std::string dir = attemptDir + "/" + std::to_string(lr);
      throwIfError(makeDirs(dir));
      const Environment env =
          workerEnvironment(options_, outcome, lr, config_.env);
      w.exit.localRank = lr;
      w.exit.rank = outcome.rankOffset + lr;
      w.exit.errorFile = env.at(kErrorFileEnvVar);
      // A round that does not count as a restart reuses the attempt's
      // folder: an old error file must not pass for a new failure.
      std::error_code ignored;
      std::filesystem::remove(w.exit.errorFile, ignored);

      execFailure = startWorker(w, {.options = options_,
                                    .config = config_,
                                    .localRank = lr,
                                    .dir = dir,
                                    .env = env,
                                    .agentPid = agentPid},
                                keeper);
    }

    // Monitor until every worker is reaped.
    std::optional<Clock::time_point> killAt;
    std::optional<Clock::time_point> giveUpAt;
    bool stopping = false;
    bool groupRestart = false;  // another node opened a new round
    bool jobFailed = false;     // the round record says the job failed
    std::optional<std::string> rdzvLost;
    const auto pollEvery =
        std::max<Clock::duration>(options_.monitorInterval, 10ms);
    auto nextPollAt = Clock::now() + pollEvery;
    AttemptResult attempt;
    attempt.restartCount = restartCount;
    auto stopAll = [&](int sig) {
      for (auto& w : workers) {
        if (!w.reaped && w.exit.pid > 0) {
          ::kill(-w.exit.pid, sig);  // its group: only what we started
          w.exit.stoppedByAgent = true;
        }
      }
    };
    auto beginStop = [&](int sig) {
      if (!stopping) {
        stopping = true;
        stopAll(sig);
        killAt = Clock::now() + config_.stopGrace;
      }
    };
    if (execFailure) {
      beginStop(SIGKILL);
    }
    std::optional<Clock::time_point> drainUntil;
    for (;;) {
      bool allReaped = true;
      for (const auto& w : workers) {
        allReaped = allReaped && (w.reaped || w.exit.pid <= 0);
      }
      std::vector<pollfd> fds{{gSignalPipe[0], POLLIN, 0}};
      std::vector<Tee*> tees;
      for (auto& w : workers) {
        for (Tee& t : w.tees) {
          if (t.pipe >= 0) {
            fds.push_back({t.pipe, POLLIN, 0});
            tees.push_back(&t);
          }
        }
      }
      const auto now = Clock::now();
      if (allReaped) {
        // A worker's children may keep its pipes open: drain briefly.
        if (!drainUntil) {
          drainUntil = now + std::chrono::seconds(2);
        }
        if (tees.empty() || now >= *drainUntil) {
          break;
        }
      }
      if (killAt && now >= *killAt) {
        log("workers still running " +
            std::to_string(config_.stopGrace.count()) +
            " ms after the stop signal; sending SIGKILL");
        stopAll(SIGKILL);
        killAt.reset();
        giveUpAt = now + std::chrono::seconds(10);
      }
      if (giveUpAt && now >= *giveUpAt && !allReaped) {
        log("workers did not die within 10 s of SIGKILL; giving up on them");
        break;
      }
      auto next = now + std::chrono::seconds(1);
      for (const auto& t : {killAt, giveUpAt, drainUntil}) {
        if (t && *t < next) {
          next = *t;
        }
      }
      const auto waitMs =
          std::chrono::duration_cast<std::chrono::milliseconds>(next - now)
              .count();
      const auto pollMs =
          std::chrono::duration_cast<std::chrono::milliseconds>(pollEvery)
              .count();
      ::poll(fds.data(), fds.size(),
             static_cast<int>(std::max<int64_t>(
                 1, std::min<int64_t>({waitMs, 1000, pollMs}))));
      if ((fds[0].revents & POLLIN) != 0) {
        unsigned char sigs[64];
        const ssize_t n = ::read(gSignalPipe[0], sigs, sizeof(sigs));
        for (ssize_t i = 0; i < n; ++i) {
          const int sig = sigs[i];
          if (sig == SIGCHLD) {
            continue;
          }
          if (agentSignal != 0) {
            // A second signal: no more grace.
            log("got " + signalName(sig) + " again; sending SIGKILL");
            stopAll(SIGKILL);
            continue;
          }
          agentSignal = sig;
          log("got " + signalName(sig) + "; forwarding it to the workers (" +
              "SIGKILL after " + std::to_string(config_.stopGrace.count()) +
              " ms)");
          if (stopping) {
            stopAll(sig);
          } else {
            beginStop(sig);
          }
        }
      }
      for (size_t i = 0; i < tees.size(); ++i) {
        if ((fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
          pump(*tees[i]);
        }
      }
      // Reap only our own workers, by pid.
      for (size_t i = 0; i < workers.size(); ++i) {
        Worker& w = workers[i];
        if (w.reaped || w.exit.pid <= 0) {
          continue;
        }
        int status = 0;
        if (::waitpid(w.exit.pid, &status, WNOHANG) != w.exit.pid) {
          continue;
        }
        w.reaped = true;
        keeper.forget(w.exit.pid);
        w.exit.endedAt = Clock::now();
        w.exit.endedAtUnix = static_cast<int64_t>(std::time(nullptr));
        if (WIFSIGNALED(status)) {
          w.exit.signal = WTERMSIG(status);
        } else {
          w.exit.exitCode = WEXITSTATUS(status);
        }
        if (w.exit.succeeded()) {
          w.exit.stoppedByAgent = false;
          continue;
        }
        if (!stopping) {
          w.exit.stoppedByAgent = false;
          attempt.firstFailure = i;
          log("local rank " + std::to_string(w.exit.localRank) + " (pid " +
              std::to_string(w.exit.pid) + ") " + w.exit.describe() +
              "; stopping the other workers");
          beginStop(SIGTERM);
        }
      }
      // The other nodes: a new round, a dead peer, the job given up.
      if (!stopping && Clock::now() >= nextPollAt) {
        nextPollAt = Clock::now() + pollEvery;
        GroupEvent event = GroupEvent::kNone;
        try {
          event = rdzv->poll();
        } catch (const std::exception& e) {
          rdzvLost = e.what();
          log(std::string("lost the rendezvous: ") + e.what() +
              "; stopping the workers");
          beginStop(SIGTERM);
        }
        if (event == GroupEvent::kRestart) {
          log("a new rendezvous round opened; stopping the workers");
          groupRestart = true;
          beginStop(SIGTERM);
        } else if (event == GroupEvent::kJobFailed) {
          log("the job failed on another node; stopping the workers");
          jobFailed = true;
          beginStop(SIGTERM);
        }
      }
    }
    for (auto& w : workers) {
      for (Tee& t : w.tees) {
        if (t.pipe >= 0) {
          ::close(t.pipe);
        }
        if (t.file >= 0) {
          ::close(t.file);
        }
      }
      ErrorRecord record;
      if (!w.exit.succeeded() && w.exit.pid > 0) {
        if (const Error e = readErrorFile(w.exit.errorFile, &record); e.ok()) {
          w.exit.error = record;
        } else if (e.code() != Code::kNotFound) {
          // A worker that recorded no error writes no file; one that wrote
          // a file the reader refuses is worth a line.
          log("local rank " + std::to_string(w.exit.localRank) +
              ": its error file is not usable: " + e.message());
        }
      }
      attempt.workers.push_back(w.exit);
    }
    if (const auto root = rootCause(attempt.workers)) {
      attempt.firstFailure = root;
    }
    result.attempts.push_back(attempt);

    if (execFailure) {
      setState(AgentState::kFailed);
      result.state = state_;
      result.exitCode = kExitExecFailed;
      result.summary = *execFailure;
      return result;
    }
    if (agentSignal != 0) {
      return signalled("while the workers ran; they were stopped");
    }
    if (rdzvLost) {
      return fail(kExitWorkerFailed, "lost the rendezvous (" + *rdzvLost +
                                         "); the workers were stopped");
    }
    if (jobFailed) {
      return fail(kExitWorkerFailed, "the job failed: " + rdzv->failureNote());
    }
    if (groupRestart) {
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
    const std::string why =
        attempt.firstFailure
            ? "local rank " +
                  std::to_string(
                      attempt.workers[*attempt.firstFailure].localRank) +
                  " (rank " +
                  std::to_string(attempt.workers[*attempt.firstFailure].rank) +
                  ") " + attempt.workers[*attempt.firstFailure].describe()
            : "a worker failed";
    try {
      next = rdzv->reportFailure(why);
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
    setState(AgentState::kFailed);
    result.state = state_;
    result.exitCode = kExitWorkerFailed;
    std::string s = "the job failed after " + std::to_string(restartCount + 1) +
                    " attempt(s) (" + "--max-restarts " +
                    std::to_string(options_.maxRestarts) + ")";
    if (attempt.firstFailure) {
      const WorkerExit& f = attempt.workers[*attempt.firstFailure];
      s += "\n  first failure: local rank " + std::to_string(f.localRank) +
           " (rank " + std::to_string(f.rank) + ", pid " +
           std::to_string(f.pid) + ") " + f.describe() +
           (f.stoppedByAgent ? " (stopped by the agent after its error)"
                             : "");
      if (f.error) {
        // A summary line, not a dump: the file has the rest.
        constexpr size_t kShown = 4096;
        const std::string& m = f.error->message;
        s += "\n  error file: " + f.errorFile + "\n  message: " +
             (m.size() <= kShown
                  ? m
                  : m.substr(0, kShown) + " ... [" + std::to_string(m.size()) +
                        " bytes; the error file has more]");
      } else {
        s += "\n  error file: none written (" + f.errorFile + ")";
      }
    }
    for (const auto& w : attempt.workers) {
      if (attempt.firstFailure &&
          &w == &attempt.workers[*attempt.firstFailure]) {
        continue;
      }
      s += "\n  local rank " + std::to_string(w.localRank) + ": " +
           w.describe() + (w.stoppedByAgent ? " (stopped by the agent)" : "");
    }
    s += "\n  logs: " + result.runLogDir + "/attempt_" +
         std::to_string(restartCount);
    result.summary = s;
    return result;
  }
}

}  // namespace trellis::elastic
