#pragma once

// Ends what the workers started when the agent dies (docs/elastic.md,
// "Workers and their children").
//
// Each worker leads a process group of its own, and gets
// PR_SET_PDEATHSIG(SIGKILL), so the kernel ends it with an agent that is
// SIGKILLed; its own children do not get that signal. The keeper is a small
// process the agent forks before anything else: the agent tells it, over a
// pipe only the agent can write, which worker groups are live, and when
// the pipe closes without a word (the agent is gone, however it died) the
// keeper sends SIGKILL to every group still live and exits. A normal end
// of the agent forgets every group first, so the keeper then kills
// nothing. A worker's child that leaves the group (setsid, setpgid) is not
// followed.
//
// Thread safety: one thread (Agent::run's).

#include <sys/types.h>

namespace trellis::elastic {

class GroupKeeper {
 public:
  // Forks the keeper; throws the errno's Error when it cannot.
  GroupKeeper();
  // Closes the pipe (the keeper kills what is still registered) and reaps
  // the keeper, waiting at most a second.
  ~GroupKeeper();
  GroupKeeper(const GroupKeeper&) = delete;
  GroupKeeper& operator=(const GroupKeeper&) = delete;

  // A worker's process group (its pid) is live: the keeper kills it if the
  // agent dies now. Call right after fork().
  void watch(pid_t group);
  // The worker was reaped and its group stopped: not the keeper's any more.
  void forget(pid_t group);

  pid_t pid() const { return pid_; }

 private:
  void send(int32_t message);

  int fd_ = -1;
  pid_t pid_ = -1;
};

}  // namespace trellis::elastic
