#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <linux/close_range.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/elastic/worker_process.h>

namespace trellis::elastic {

namespace {

// What the child needs, built before fork(): after it, only
// async-signal-safe calls.
struct ChildPlan {
  std::vector<std::string> argvStore;
  std::vector<std::string> envStore;
  std::vector<char*> argv;
  std::vector<char*> envp;
  int stdoutFd = -1;  // dup2'd onto 1 when >= 0
  int stderrFd = -1;
};

// In a forked child (async-signal-safe): every descriptor from `first` on
// becomes close-on-exec. close_range(2) does it in one call (Linux 5.11);
// before that, one fcntl per possible descriptor, bounded.
void markCloseOnExecFrom(int first) {
  if (::syscall(SYS_close_range, static_cast<unsigned>(first), ~0U,
                CLOSE_RANGE_CLOEXEC) == 0) {
    return;
  }
  rlimit lim{};
  const rlim_t top =
      ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY
          ? std::min<rlim_t>(lim.rlim_cur, 1 << 20)
          : 1 << 16;
  for (int fd = first; fd < static_cast<int>(top); ++fd) {
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && (flags & FD_CLOEXEC) == 0) {
      ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
    }
  }
}

int openLog(const std::string& path) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throwError(Error::fromErrno(errno, "cannot open " + path));
  }
  return fd;
}

bool hasStream(Streams s, int stream) {
  return (static_cast<int>(s) & (stream == 1 ? 1 : 2)) != 0;
}

}  // namespace

bool pump(Tee& t) {
  char buf[65536];
  const ssize_t n = ::read(t.pipe, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
    return true;
  }
  if (n <= 0) {
    if (!t.partial.empty() && t.console >= 0) {
      writeAll(t.console, t.prefix + t.partial + "\n");
    }
    t.partial.clear();
    ::close(t.pipe);
    t.pipe = -1;
    return false;
  }
  if (t.file >= 0) {
    writeAll(t.file, std::string(buf, static_cast<size_t>(n)));
  }
  if (t.console < 0) {
    return true;
  }
  t.partial.append(buf, static_cast<size_t>(n));
  std::string lines;
  size_t start = 0;
  for (size_t nl; (nl = t.partial.find('\n', start)) != std::string::npos;
       start = nl + 1) {
    lines += t.prefix;
    lines.append(t.partial, start, nl + 1 - start);
  }
  t.partial.erase(0, start);
  writeAll(t.console, lines);
  return true;
}

std::optional<std::string> startWorker(Worker& w, const WorkerSpawn& s,
                                       GroupKeeper& keeper) {
  ChildPlan plan;
  plan.argvStore = s.options.workerArgv;
  for (const auto& [k, v] : s.env) {
    plan.envStore.push_back(k + "=" + v);
  }
  for (auto& a : plan.argvStore) {
    plan.argv.push_back(a.data());
  }
  plan.argv.push_back(nullptr);
  for (auto& e : plan.envStore) {
    plan.envp.push_back(e.data());
  }
  plan.envp.push_back(nullptr);

  // Streams: redirected to a file, tee'd (file + prefixed console),
  // silenced (filtered out), or inherited.
  const bool shown = s.options.localRanksFilter.empty() ||
                     s.options.localRanksFilter.count(s.localRank) != 0;
  std::vector<int> toCloseInParent;
  for (int stream : {1, 2}) {
    const bool redirect =
        hasStream(s.options.redirects.forRank(s.localRank), stream);
    const bool tee = hasStream(s.options.tee.forRank(s.localRank), stream);
    int childFd = -1;
    if (redirect || tee) {
      const int file =
          openLog(s.dir + (stream == 1 ? "/stdout.log" : "/stderr.log"));
      if (tee && shown) {
        int fds[2];
        if (::pipe2(fds, O_CLOEXEC) != 0) {
          throwError(Error::fromErrno(errno, "elastic-run: pipe"));
        }
        Tee& t = w.tees[stream - 1];
        t.pipe = fds[0];
        t.file = file;
        t.console = stream == 1 ? s.config.consoleOutFd : s.config.consoleErrFd;
        t.prefix = "[" + s.options.role + std::to_string(s.localRank) + "]:";
        childFd = fds[1];
      } else {
        childFd = file;
      }
      toCloseInParent.push_back(childFd);
    } else if (!shown) {
      childFd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
      toCloseInParent.push_back(childFd);
    }
    (stream == 1 ? plan.stdoutFd : plan.stderrFd) = childFd;
  }

  int execPipe[2];
  if (::pipe2(execPipe, O_CLOEXEC) != 0) {
    throwError(Error::fromErrno(errno, "elastic-run: pipe"));
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    throwError(Error::fromErrno(errno, "elastic-run: fork"));
  }
  if (pid == 0) {
    // The child: async-signal-safe calls only.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != s.agentPid) {
      ::_exit(kExitExecFailed);  // the agent died before prctl
    }
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int s : kAgentSignals) {
      ::sigaction(s, &dfl, nullptr);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (plan.stdoutFd >= 0) {
      ::dup2(plan.stdoutFd, 1);
    }
    if (plan.stderrFd >= 0) {
      ::dup2(plan.stderrFd, 2);
    }
    // The worker gets stdin, stdout and stderr, nothing else of the
    // agent's: not the rendezvous store's port, the log files or other
    // workers' pipes, whatever opened them without close-on-exec
    // (torchrun's subprocess closes them too). Marked, not closed, so
    // that execPipe still reports a failed exec.
    markCloseOnExecFrom(3);
    ::execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
    const int err = errno;
    [[maybe_unused]] const ssize_t n = ::write(execPipe[1], &err, sizeof(err));
    ::_exit(kExitExecFailed);
  }
  // Also here, so that a signal sent right after fork() finds the group.
  ::setpgid(pid, pid);
  w.exit.pid = pid;
  keeper.watch(pid);
  ::close(execPipe[1]);
  for (int fd : toCloseInParent) {
    if (fd != w.tees[0].file && fd != w.tees[1].file) {
      ::close(fd);
    }
  }
  // EOF once exec succeeded; an errno when it failed. Bounded: the
  // child does nothing but set itself up before exec.
  pollfd p{execPipe[0], POLLIN, 0};
  int err = 0;
  std::optional<std::string> failure;
  if (::poll(&p, 1, 10'000) == 1 &&
      ::read(execPipe[0], &err, sizeof(err)) == sizeof(err)) {
    failure = "cannot run '" + s.options.workerArgv[0] + "' (local rank " +
              std::to_string(s.localRank) + "): " + std::strerror(err);
  }
  ::close(execPipe[0]);
  return failure;
}

}  // namespace trellis::elastic
