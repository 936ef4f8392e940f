#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <trellis/core/error.h>
#include <trellis/elastic/attempt_watch.h>
#include <trellis/elastic/errors.h>

namespace trellis::elastic {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::string signalName(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev
                           : "signal " + std::to_string(sig);
}

std::optional<size_t> rootCause(const std::vector<WorkerExit>& workers) {
  auto when = [](const WorkerExit& w) {
    return std::pair{
        w.error && w.error->timestamp > 0 ? w.error->timestamp : w.endedAtUnix,
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

namespace {

// Stops an attempt's workers: a signal to every live worker's process
// group (only what the agent started), then SIGKILL after the grace.
struct Stopper {
  std::vector<Worker>& workers;
  Clock::duration grace;
  bool stopping = false;
  std::optional<Clock::time_point> killAt{};

  void signalAll(int sig) {
    for (auto& w : workers) {
      if (!w.reaped && w.exit.pid > 0) {
        ::kill(-w.exit.pid, sig);
        w.exit.stoppedByAgent = true;
      }
    }
  }
  void begin(int sig) {
    if (!stopping) {
      stopping = true;
      signalAll(sig);
      killAt = Clock::now() + grace;
    }
  }
};

// The agent's signals: the first is forwarded to the workers (the stop
// begins), a second sends SIGKILL at once; SIGCHLD only wakes the watch.
void forwardAgentSignals(const AttemptWatch& ctx, Stopper& stop) {
  unsigned char sigs[64];
  const ssize_t n = ::read(ctx.signalFd, sigs, sizeof(sigs));
  for (ssize_t i = 0; i < n; ++i) {
    const int sig = sigs[i];
    if (sig == SIGCHLD) {
      continue;
    }
    if (ctx.agentSignal != 0) {
      // A second signal: no more grace.
      ctx.log("got " + signalName(sig) + " again; sending SIGKILL");
      stop.signalAll(SIGKILL);
      continue;
    }
    ctx.agentSignal = sig;
    ctx.log("got " + signalName(sig) + "; forwarding it to the workers (" +
            "SIGKILL after " + std::to_string(ctx.config.stopGrace.count()) +
            " ms)");
    if (stop.stopping) {
      stop.signalAll(sig);
    } else {
      stop.begin(sig);
    }
  }
}

// After the watch: closes the workers' log streams, reads the error file
// of each that failed, and picks the root cause.
void collectExits(std::vector<Worker>& workers, AttemptResult& attempt,
                  const LogFn& log) {
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
}

}  // namespace

WatchEnd watchAttempt(std::vector<Worker>& workers, bool execFailed,
                      int32_t restartCount, const AttemptWatch& ctx) {
  std::optional<Clock::time_point> giveUpAt;
  const auto pollEvery =
      std::max<Clock::duration>(ctx.options.monitorInterval, 10ms);
  auto nextPollAt = Clock::now() + pollEvery;
  WatchEnd end;
  end.attempt.restartCount = restartCount;
  Stopper stop{workers, ctx.config.stopGrace};
  if (execFailed) {
    stop.begin(SIGKILL);
  }
  std::optional<Clock::time_point> drainUntil;
  for (;;) {
    bool allReaped = true;
    for (const auto& w : workers) {
      allReaped = allReaped && (w.reaped || w.exit.pid <= 0);
    }
    std::vector<pollfd> fds{{ctx.signalFd, POLLIN, 0}};
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
    if (stop.killAt && now >= *stop.killAt) {
      ctx.log("workers still running " +
              std::to_string(ctx.config.stopGrace.count()) +
              " ms after the stop signal; sending SIGKILL");
      stop.signalAll(SIGKILL);
      stop.killAt.reset();
      giveUpAt = now + std::chrono::seconds(10);
    }
    if (giveUpAt && now >= *giveUpAt && !allReaped) {
      ctx.log("workers did not die within 10 s of SIGKILL; giving up on them");
      break;
    }
    auto next = now + std::chrono::seconds(1);
    for (const auto& t : {stop.killAt, giveUpAt, drainUntil}) {
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
      forwardAgentSignals(ctx, stop);
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
      ctx.keeper.forget(w.exit.pid);
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
      if (!stop.stopping) {
        w.exit.stoppedByAgent = false;
        end.attempt.firstFailure = i;
        ctx.log("local rank " + std::to_string(w.exit.localRank) + " (pid " +
                std::to_string(w.exit.pid) + ") " + w.exit.describe() +
                "; stopping the other workers");
        stop.begin(SIGTERM);
      }
    }
    // The other nodes: a new round, a dead peer, the job given up.
    if (!stop.stopping && Clock::now() >= nextPollAt) {
      nextPollAt = Clock::now() + pollEvery;
      GroupEvent event = GroupEvent::kNone;
      try {
        event = ctx.rdzv.poll();
      } catch (const std::exception& e) {
        end.rdzvLost = e.what();
        ctx.log(std::string("lost the rendezvous: ") + e.what() +
                "; stopping the workers");
        stop.begin(SIGTERM);
      }
      if (event == GroupEvent::kRestart) {
        ctx.log("a new rendezvous round opened; stopping the workers");
        end.groupRestart = true;
        stop.begin(SIGTERM);
      } else if (event == GroupEvent::kJobFailed) {
        ctx.log("the job failed on another node; stopping the workers");
        end.jobFailed = true;
        stop.begin(SIGTERM);
      }
    }
  }
  collectExits(workers, end.attempt, ctx.log);
  return end;
}

std::string failureSummary(const AttemptResult& attempt, int32_t maxRestarts,
                           const std::string& runLogDir) {
  std::string s = "the job failed after " +
                  std::to_string(attempt.restartCount + 1) + " attempt(s) (" +
                  "--max-restarts " + std::to_string(maxRestarts) + ")";
  if (attempt.firstFailure) {
    const WorkerExit& f = attempt.workers[*attempt.firstFailure];
    s += "\n  first failure: local rank " + std::to_string(f.localRank) +
         " (rank " + std::to_string(f.rank) + ", pid " + std::to_string(f.pid) +
         ") " + f.describe() +
         (f.stoppedByAgent ? " (stopped by the agent after its error)" : "");
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
    if (attempt.firstFailure && &w == &attempt.workers[*attempt.firstFailure]) {
      continue;
    }
    s += "\n  local rank " + std::to_string(w.localRank) + ": " + w.describe() +
         (w.stoppedByAgent ? " (stopped by the agent)" : "");
  }
  s += "\n  logs: " + runLogDir + "/attempt_" +
       std::to_string(attempt.restartCount);
  return s;
}

}  // namespace trellis::elastic
