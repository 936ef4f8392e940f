#pragma once

// One attempt of elastic-run's worker group, once its workers are started
// (agent.h, "RUNNING"): the agent's wait for them, the stop on a failure,
// a signal or news from the rendezvous, and the summary of a failed job.
// Internal to elastic/ (not installed).
//
// Thread safety: the agent's thread only.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <trellis/elastic/agent.h>
#include <trellis/elastic/group_keeper.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/elastic/worker_process.h>

namespace trellis::elastic {

struct AttemptWatch {
  const ElasticOptions& options;
  const AgentConfig& config;
  Rendezvous& rdzv;
  GroupKeeper& keeper;
  LogFn log;
  int signalFd = -1;  // the read end of the agent's signal self-pipe
  // In and out: the first signal the agent got (0: none).
  int& agentSignal;
};

struct WatchEnd {
  // Every worker's exit, error file read; firstFailure the root cause.
  AttemptResult attempt;
  bool groupRestart = false;  // another node opened a new round
  bool jobFailed = false;     // the round record says the job failed
  std::optional<std::string> rdzvLost;
};

// Waits until every worker of `workers` is reaped (or given up on 10 s
// after SIGKILL), copying tee'd output as it comes. The first failure, a
// signal to the agent (forwarded; a second one sends SIGKILL), a new round
// or a failed job elsewhere stops the others: SIGTERM (or the signal), then
// SIGKILL after AgentConfig::stopGrace. `execFailed`: a worker could not be
// started; the others are killed at once.
WatchEnd watchAttempt(std::vector<Worker>& workers, bool execFailed,
                      int32_t restartCount, const AttemptWatch& ctx);

// See AttemptResult::firstFailure.
std::optional<size_t> rootCause(const std::vector<WorkerExit>& workers);

// elastic-run's summary of a job that failed after `attempt`.
std::string failureSummary(const AttemptResult& attempt, int32_t maxRestarts,
                           const std::string& runLogDir);

// "SIGTERM", or "signal 42".
std::string signalName(int sig);

}  // namespace trellis::elastic
