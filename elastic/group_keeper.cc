#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <fcntl.h>
#include <linux/close_range.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <trellis/core/error.h>
#include <trellis/elastic/group_keeper.h>

namespace trellis::elastic {

namespace {

// More groups than any node runs workers; a keeper told of more keeps the
// first ones.
constexpr size_t kMaxGroups = 4096;

// The keeper itself, in the forked child: async-signal-safe calls only.
[[noreturn]] void keep(int readFd) {
  // A terminal's ^C goes to the agent's whole process group: the keeper
  // must outlive it to do its job, and ends only when the pipe closes.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2}) {
    ::sigaction(s, &ignore, nullptr);
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGCHLD, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // Nothing of the agent's but the pipe: a socket held here would outlive
  // the agent.
  if (readFd > 3) {
    ::syscall(SYS_close_range, 3U, static_cast<unsigned>(readFd - 1), 0U);
  }
  ::syscall(SYS_close_range, static_cast<unsigned>(readFd + 1), ~0U, 0U);
  ::prctl(PR_SET_NAME, "elastic-keeper");

  static pid_t groups[kMaxGroups];
  size_t count = 0;
  for (;;) {
    int32_t message = 0;
    const ssize_t n = ::read(readFd, &message, sizeof(message));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n != static_cast<ssize_t>(sizeof(message))) {
      break;  // the agent is gone (or ended: it forgot every group first)
    }
    if (message > 0 && count < kMaxGroups) {
      groups[count++] = message;
    } else if (message < 0) {
      for (size_t i = 0; i < count; ++i) {
        if (groups[i] == -message) {
          groups[i] = groups[--count];
          break;
        }
      }
    }
  }
  for (size_t i = 0; i < count; ++i) {
    ::kill(-groups[i], SIGKILL);
  }
  ::_exit(0);
}

}  // namespace

GroupKeeper::GroupKeeper() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throwError(Error::fromErrno(errno, "elastic-run: the keeper's pipe"));
  }
  pid_ = ::fork();
  if (pid_ < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throwError(Error::fromErrno(err, "elastic-run: forking the keeper"));
  }
  if (pid_ == 0) {
    ::close(fds[1]);
    keep(fds[0]);
  }
  ::close(fds[0]);
  fd_ = fds[1];
}

GroupKeeper::~GroupKeeper() {
  ::close(fd_);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() >= end) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void GroupKeeper::watch(pid_t group) { send(static_cast<int32_t>(group)); }

void GroupKeeper::forget(pid_t group) { send(-static_cast<int32_t>(group)); }

void GroupKeeper::send(int32_t message) {
  // Four bytes to a pipe: one atomic write. A keeper that is gone (killed
  // by someone) makes it fail with EPIPE, which costs only its protection.
  for (;;) {
    const ssize_t n = ::write(fd_, &message, sizeof(message));
    if (n >= 0 || errno != EINTR) {
      return;
    }
  }
}

}  // namespace trellis::elastic
