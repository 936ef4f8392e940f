#pragma once

// Internal: whether a peer process has gone away, for the channels that
// read a peer's memory by its pid (cma, cuda_ipc). Not installed.
//
// A copy from a peer's memory that fails is asked about the peer only
// after the failure: a peer process that is gone (exited, killed, a zombie
// not yet reaped, or already in its exit) took its memory with it, which
// is the peer leaving (UNAVAILABLE), not a lying record (DATA_LOSS;
// docs/transport.md, "Errors"). A pid reused by a new process since reads
// as alive, so the answer errs towards the stricter error.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <climits>

namespace trellis::transport {

// True when no process `pid` runs any more in this PID namespace, or it is
// a zombie, or it has begun to exit (the kernel's PF_EXITING). Any thread;
// leaves errno as it was. A process that merely unmapped some memory is
// not gone.
inline bool processGone(uint64_t pid) {
  if (pid == 0 || pid > static_cast<uint64_t>(INT_MAX)) {
    return false;
  }
  const int saved = errno;
  bool gone = false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    gone = true;
  } else {
    // A zombie, and a process in its exit, still answer kill(); their
    // state in /proc says what they are.
    char path[48];
    std::snprintf(path, sizeof(path), "/proc/%llu/stat",
                  static_cast<unsigned long long>(pid));
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      gone = errno == ENOENT || errno == ESRCH;
    } else {
      char buf[512];
      const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
      const int readErr = errno;
      ::close(fd);
      if (n <= 0) {
        gone = n == 0 || readErr == ESRCH;
      } else {
        buf[n] = '\0';
        // "pid (comm) state ppid pgrp session tty_nr tpgid flags ...";
        // comm may hold anything, ')' included: the last ')' ends it.
        const char* p = std::strrchr(buf, ')');
        char state = 0;
        unsigned long long flags = 0;
        if (p != nullptr && std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %llu",
                                        &state, &flags) == 2) {
          constexpr unsigned long long kPfExiting = 0x4;
          gone = state == 'Z' || state == 'X' || state == 'x' ||
                 (flags & kPfExiting) != 0;
        }
      }
    }
  }
  errno = saved;
  return gone;
}

}  // namespace trellis::transport
