// trellis-launch: starts N local worker processes of one job with the
// environment rpc::init() reads (RANK, WORLD_SIZE, MASTER_ADDR, ...), tags
// their output by rank, and tears the whole job down when one of them
// fails. A stand-in until elastic-run exists (docs/examples.md).
//
//   trellis-launch --nproc 3 -- build/dev/examples/parameter_server --steps 300
//
// Exit status: 0 when every rank exited 0; 1 when one failed or was killed
// (the launcher then SIGTERMs the others, SIGKILL 5 s later); 124 when
// --timeout-s passed; 2 for a usage error. A rank that exits 0 while the
// others still run does not end the job (as with torchrun). A rank that is
// stopped (SIGSTOP) when another fails is named as the likely cause.
// Workers die with the launcher (PR_SET_PDEATHSIG), even when it is
// SIGKILLed.

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <netinet/in.h>
#include <optional>
#include <poll.h>
#include <signal.h>
#include <string>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <CLI/CLI.hpp>

#include <trellis/core/auth.h>
#include <trellis/core/text.h>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

int gSignalPipe[2] = {-1, -1};

void onSignal(int signo) {
  const int saved = errno;
  const auto b = static_cast<unsigned char>(signo);
  [[maybe_unused]] ssize_t n = ::write(gSignalPipe[1], &b, 1);
  errno = saved;
}

// A port no one listens on right now. Another process may take it before
// rank 0 binds it; the window is small and the failure is loud (rank 0's
// store cannot bind), so a retry by hand is the remedy.
int pickFreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return -1;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

// One of a rank's output streams, forwarded line by line with a prefix.
struct Stream {
  int fd = -1;
  int target = 1;  // our fd the lines go to
  std::string partial;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int status = 0;
  // Set while the process is stopped (SIGSTOP, SIGTSTP, ...): a stopped
  // rank makes its peers' calls time out, so it is the likely cause of
  // their failure.
  std::optional<Clock::time_point> stoppedSince;
  int stopSignal = 0;
  Stream out;
  Stream err;
};

std::string prefixOf(int rank) {
  return "[rank " + std::to_string(rank) + "] ";
}

// Reads what is available; forwards complete lines. Returns false at EOF.
bool pump(Stream& s, int rank) {
  char buf[65536];
  const ssize_t n = ::read(s.fd, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
    return true;
  }
  if (n <= 0) {
    if (!s.partial.empty()) {
      trellis::writeAll(s.target, prefixOf(rank) + s.partial + "\n");
      s.partial.clear();
    }
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
  s.partial.append(buf, static_cast<size_t>(n));
  std::string lines;
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos;
       start = nl + 1) {
    lines += prefixOf(rank);
    lines.append(s.partial, start, nl + 1 - start);
  }
  s.partial.erase(0, start);
  if (!lines.empty()) {
    trellis::writeAll(s.target, lines);
  }
  return true;
}

std::string describeStatus(int status) {
  if (WIFEXITED(status)) {
    return "exited with code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "killed by signal " + std::to_string(sig) + " (SIG" +
           (name != nullptr ? name : "?") + ")";
  }
  return "ended with status " + std::to_string(status);
}

bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Starts the local processes of a Trellis job."};
  int nproc = 1;
  int masterPort = 0;
  double timeoutS = 600;
  std::string masterAddr = "127.0.0.1";
  std::vector<std::string> command;
  app.add_option("--nproc", nproc, "processes to start (ranks 0..N-1)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--master-port", masterPort,
                 "rank 0's store port; 0 picks a free one")
      ->check(CLI::Range(0, 65535));
  app.add_option("--master-addr", masterAddr, "MASTER_ADDR for every rank");
  app.add_option("--timeout-s", timeoutS,
                 "tear the job down after this many seconds")
      ->check(CLI::PositiveNumber);
  app.add_option("command", command, "-- program and its arguments")
      ->required();
  CLI11_PARSE(app, argc, argv);

  if (masterPort == 0) {
    masterPort = pickFreePort();
    if (masterPort <= 0) {
      std::fprintf(stderr, "trellis-launch: cannot find a free port: %s\n",
                   std::strerror(errno));
      return 2;
    }
  }
  // A token set by the user (several launchers of one job) is kept;
  // otherwise this job gets its own.
  std::string token;
  if (const char* t = std::getenv(trellis::auth::kTokenEnvVar);
      t != nullptr && *t != '\0') {
    token = t;
  } else {
    token = trellis::auth::JobToken::generate().secret();
  }

  if (::pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::perror("trellis-launch: pipe");
    return 2;
  }
  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGINT, SIGTERM, SIGCHLD}) {
    ::sigaction(s, &sa, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<Rank> ranks(static_cast<size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    Rank& rk = ranks[static_cast<size_t>(r)];
    rk.rank = r;
    int outFds[2];
    int errFds[2];
    if (::pipe2(outFds, O_CLOEXEC) != 0 || ::pipe2(errFds, O_CLOEXEC) != 0) {
      std::perror("trellis-launch: pipe");
      return 2;
    }
    // The environment is built before fork(): the child only execs.
    std::vector<std::string> env = {
        "RANK=" + std::to_string(r),
        "LOCAL_RANK=" + std::to_string(r),
        "WORLD_SIZE=" + std::to_string(nproc),
        "LOCAL_WORLD_SIZE=" + std::to_string(nproc),
        "MASTER_ADDR=" + masterAddr,
        "MASTER_PORT=" + std::to_string(masterPort),
        std::string(trellis::auth::kTokenEnvVar) + "=" + token,
    };
    std::vector<char*> envp;
    for (auto& e : env) {
      envp.push_back(e.data());
    }
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      bool mine = false;
      for (const auto& m : env) {
        mine = mine || entry.rfind(m.substr(0, m.find('=') + 1), 0) == 0;
      }
      if (!mine) {
        envp.push_back(*e);
      }
    }
    envp.push_back(nullptr);
    std::vector<char*> args;
    for (auto& a : command) {
      args.push_back(a.data());
    }
    args.push_back(nullptr);

    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("trellis-launch: fork");
      return 2;
    }
    if (pid == 0) {
      // Its own process group: a terminal's Ctrl-C reaches the launcher
      // alone, which forwards it once.
      ::setpgid(0, 0);
      // No orphan outlives a launcher that is SIGKILLed: the kernel kills
      // the worker when the launcher's thread that forked it goes.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) {
        ::_exit(127);  // the launcher died before prctl took effect
      }
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int s : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) {
        ::sigaction(s, &dfl, nullptr);
      }
      ::dup2(outFds[1], 1);
      ::dup2(errFds[1], 2);
      ::execvpe(args[0], args.data(), envp.data());
      const std::string msg = std::string("trellis-launch: cannot run ") +
                              args[0] + ": " + std::strerror(errno) + "\n";
      trellis::writeAll(2, msg);
      ::_exit(127);
    }
    rk.pid = pid;
    ::close(outFds[1]);
    ::close(errFds[1]);
    rk.out = Stream{outFds[0], 1, {}};
    rk.err = Stream{errFds[0], 2, {}};
  }

  const auto start = Clock::now();
  const auto jobDeadline = start + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(timeoutS));
  std::optional<Clock::time_point> killAt;  // SIGKILL stragglers then
  std::optional<Clock::time_point> drainEnd;
  bool timedOut = false;
  bool interrupted = false;
  int firstFailed = -1;
  std::vector<int> stoppedCause;  // ranks stopped when the first one failed

  auto signalAll = [&](int sig) {
    for (auto& rk : ranks) {
      if (!rk.exited) {
        ::kill(rk.pid, sig);  // only the pids started above
        if (rk.stoppedSince && sig != SIGKILL) {
          ::kill(rk.pid, SIGCONT);  // else it cannot act on `sig`
        }
      }
    }
  };
  auto secondsSinceStart = [&](Clock::time_point t) {
    return std::chrono::duration<double>(t - start).count();
  };
  auto tearDown = [&](int sig) {
    if (!killAt) {
      signalAll(sig);
      killAt = Clock::now() + std::chrono::seconds(5);
    }
  };

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<int> owners;
    fds.push_back({gSignalPipe[0], POLLIN, 0});
    for (auto& rk : ranks) {
      for (Stream* s : {&rk.out, &rk.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
          owners.push_back(rk.rank);
        }
      }
    }
    bool allExited = true;
    for (const auto& rk : ranks) {
      allExited = allExited && rk.exited;
    }
    if (allExited && streams.empty()) {
      break;
    }
    ::poll(fds.data(), fds.size(), 100);

    if ((fds[0].revents & POLLIN) != 0) {
      unsigned char sigs[64];
      const ssize_t n = ::read(gSignalPipe[0], sigs, sizeof(sigs));
      for (ssize_t i = 0; i < n; ++i) {
        if (sigs[i] == SIGINT || sigs[i] == SIGTERM) {
          interrupted = true;
          if (!killAt) {
            std::fprintf(stderr,
                         "trellis-launch: got SIG%s, forwarding it to the "
                         "job\n",
                         sigabbrev_np(sigs[i]));
          }
          tearDown(sigs[i]);
        }
      }
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      if ((fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        pump(*streams[i], owners[i]);
      }
    }
    for (auto& rk : ranks) {
      if (rk.exited) {
        continue;
      }
      int status = 0;
      if (::waitpid(rk.pid, &status, WNOHANG | WUNTRACED | WCONTINUED) !=
          rk.pid) {
        continue;
      }
      if (WIFSTOPPED(status)) {
        rk.stoppedSince = Clock::now();
        rk.stopSignal = WSTOPSIG(status);
        continue;
      }
      if (WIFCONTINUED(status)) {
        rk.stoppedSince.reset();
        continue;
      }
      rk.exited = true;
      rk.status = status;
      rk.stoppedSince.reset();
      // A rank that fails on its own (not from our teardown) stops the
      // job. One that exits 0 while others still run does not: like
      // torchrun, the launcher waits for the rest (a worker may finish
      // early; the others' graceful RPC shutdown notices if it left
      // without one).
      if (failed(status) && !killAt) {
        firstFailed = rk.rank;
        std::fprintf(stderr,
                     "trellis-launch: rank %d %s; stopping the other "
                     "ranks\n",
                     rk.rank, describeStatus(status).c_str());
        for (const auto& other : ranks) {
          if (other.stoppedSince) {
            std::fprintf(stderr,
                         "trellis-launch: rank %d (pid %d) has been stopped "
                         "(SIG%s) since %.1f s, before rank %d failed: it "
                         "is the likely cause\n",
                         other.rank, static_cast<int>(other.pid),
                         sigabbrev_np(other.stopSignal) != nullptr
                             ? sigabbrev_np(other.stopSignal)
                             : "?",
                         secondsSinceStart(*other.stoppedSince), rk.rank);
            stoppedCause.push_back(other.rank);
          }
        }
        tearDown(SIGTERM);
      }
    }
    const auto now = Clock::now();
    if (!timedOut && now >= jobDeadline) {
      timedOut = true;
      std::fprintf(stderr,
                   "trellis-launch: the job ran past --timeout-s %.0f; "
                   "stopping it\n",
                   timeoutS);
      tearDown(SIGTERM);
    }
    if (killAt && now >= *killAt) {
      signalAll(SIGKILL);
      killAt = now + std::chrono::hours(1);  // once
    }
    // A rank's children may hold its pipes open after it exited: once
    // every rank is reaped, stop reading after a short grace period.
    if (allExited) {
      if (!drainEnd) {
        drainEnd = now + std::chrono::seconds(2);
      }
      if (now >= *drainEnd) {
        for (auto& rk : ranks) {
          for (Stream* s : {&rk.out, &rk.err}) {
            if (s->fd >= 0) {
              ::close(s->fd);
              s->fd = -1;
            }
          }
        }
      }
    }
  }

  const double secs =
      std::chrono::duration<double>(Clock::now() - start).count();
  bool ok = true;
  for (const auto& rk : ranks) {
    ok = ok && !failed(rk.status);
  }
  if (!ok || timedOut || interrupted) {
    for (const auto& rk : ranks) {
      std::fprintf(stderr, "trellis-launch: rank %d (pid %d) %s\n", rk.rank,
                   static_cast<int>(rk.pid), describeStatus(rk.status).c_str());
    }
    if (firstFailed >= 0) {
      std::string stopped;
      for (int r : stoppedCause) {
        stopped += (stopped.empty() ? "" : ", ") + std::to_string(r);
      }
      if (stopped.empty()) {
        std::fprintf(stderr, "trellis-launch: first failure: rank %d\n",
                     firstFailed);
      } else {
        std::fprintf(stderr,
                     "trellis-launch: first failure: rank %d, after rank(s) "
                     "%s had been stopped (the likely cause)\n",
                     firstFailed, stopped.c_str());
      }
    }
  } else {
    std::fprintf(stderr, "trellis-launch: all %d ranks exited 0 after %.1f s\n",
                 nproc, secs);
  }
  if (timedOut) {
    return 124;
  }
  return ok && !interrupted ? 0 : 1;
}
