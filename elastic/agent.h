#pragma once

// The elastic agent for one node (docs/elastic.md, "The agent"): starts the
// node's workers, watches them, restarts the group on a failure while the
// restart budget lasts, and forwards the signals it receives.
//
//   INIT -> RENDEZVOUS -> RUNNING -> SUCCEEDED
//                            |  \-> FAILED      (budget spent, exec failure,
//                            |                   or a signal to the agent)
//                            \-> RESTARTING -> RENDEZVOUS -> RUNNING ...
//
// RENDEZVOUS is a Rendezvous (rendezvous.h): on one node it picks the
// workers' MASTER_PORT (a free port for --standalone, --master-port for a
// static node) and counts restarts itself; with --rdzv-backend c10d (and
// etcd, and static with several nodes) it is a
// round over the store, and the round record decides restarts for every
// node. While RUNNING the agent polls it every --monitor-interval: a new
// round (another node failed, died, or a node waits to join) stops the
// workers and goes back to RENDEZVOUS; workers that all exit 0 wait at the
// exit barrier. TORCHELASTIC_USE_AGENT_STORE is True with c10d (the workers
// use the rendezvous store, under a prefix of their own;
// agentStoreForWorkers in worker_env.h says when not), else False (rank 0
// hosts the workers' store).
//
// Workers: fork + execvp of ElasticOptions::workerArgv with the environment
// of workerEnvironment(); each is the leader of its own process group, gets
// PR_SET_PDEATHSIG(SIGKILL) and checks that the agent is still its parent,
// so none outlives an agent that is SIGKILLed; what a worker started in its
// group goes too (group_keeper.h). A worker inherits stdin, stdout and
// stderr and no other descriptor of the agent's. An exec failure is reported
// through a close-on-exec pipe and ends the run (it would fail every
// attempt): FAILED, exit status kExitExecFailed, naming the program.
//
// Stopping a group: the signal (SIGTERM for a failure, else the one the
// agent received) to every live worker's process group; whoever is still
// there after AgentConfig::stopGrace gets SIGKILL.
//
// Threads: run() is blocking, single-threaded, and installs process-wide
// handlers for SIGTERM, SIGINT, SIGHUP, SIGCHLD and SIGPIPE for its
// duration (restored on return): at most one Agent may run at a time in a
// process. Every wait inside is bounded by a deadline or by a worker's exit.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

#include <trellis/elastic/errors.h>
#include <trellis/elastic/options.h>

namespace trellis::elastic {

enum class AgentState : uint8_t {
  kInit,
  kRendezvous,
  kRunning,
  kRestarting,
  kSucceeded,
  kFailed,
};

// "INIT", "RENDEZVOUS", ...
const char* agentStateName(AgentState state);

// How long stopped workers get between the stop signal and SIGKILL
// (torchrun waits 30 s; a few seconds keeps a restart fast).
inline constexpr std::chrono::milliseconds kDefaultStopGrace{5000};
// elastic-run reads a different grace period (seconds, may be fractional)
// from this variable.
inline constexpr const char* kStopGraceEnvVar = "TRELLIS_ELASTIC_STOP_GRACE_S";

// elastic-run's exit statuses besides 0 (docs/elastic.md, "Exit codes").
inline constexpr int kExitWorkerFailed = 1;  // as torchrun's ChildFailedError
inline constexpr int kExitUsage = 2;         // a bad command line
inline constexpr int kExitExecFailed = 127;  // CMD could not be executed
// A signal to the agent ends it with 128 + the signal's number (143 for
// SIGTERM); torchrun exits 1 there (an uncaught SignalException).
inline constexpr int kExitSignalBase = 128;

struct AgentConfig {
  std::chrono::milliseconds stopGrace = kDefaultStopGrace;
  // The agent's own environment (the base of every worker's).
  Environment env;
  // Where the agent's messages go (the console's stderr by default).
  int logFd = 2;
  // Where tee'd worker lines go on the console.
  int consoleOutFd = 1;
  int consoleErrFd = 2;
};

// How one worker of one attempt ended.
struct WorkerExit {
  int32_t localRank = 0;
  int32_t rank = 0;
  pid_t pid = -1;
  int exitCode = -1;  // set when it exited
  int signal = 0;     // set when a signal ended it
  // Stopped by the agent (a peer failed, or the agent was signalled)
  // rather than ending on its own.
  bool stoppedByAgent = false;
  std::string errorFile;             // its TORCHELASTIC_ERROR_FILE
  std::optional<ErrorRecord> error;  // what it recorded there, if anything
  std::chrono::steady_clock::time_point endedAt{};
  int64_t endedAtUnix = 0;  // the same, in seconds since the epoch

  bool succeeded() const { return signal == 0 && exitCode == 0; }
  // "exited with code 3", "killed by signal 9 (SIGKILL)".
  std::string describe() const;
};

struct AttemptResult {
  int32_t restartCount = 0;
  std::vector<WorkerExit> workers;  // by local rank
  // Index into `workers` of the root cause, as torchrun picks it: the
  // earliest error by the time in its error file; a worker without a file
  // counts by when it ended, and one the agent stopped without a file is
  // not a candidate.
  std::optional<size_t> firstFailure;
};

struct RunResult {
  AgentState state = AgentState::kInit;  // kSucceeded or kFailed
  int exitCode = 0;                      // elastic-run's exit status
  int agentSignal = 0;  // the signal that ended the run, if one did
  std::string runId;
  std::string runLogDir;
  uint16_t masterPort = 0;
  std::vector<AttemptResult> attempts;
  // Why the run failed, in a few lines; empty on success.
  std::string summary;
};

// Throws InvalidArgumentError (naming the flags) for what elastic-run
// cannot do: etcd-v2 (etcd's v2 API; use etcd, its v3 API).
void checkSupported(const ElasticOptions& options);

// Whether the agent runs the c10d rendezvous (not --standalone's one node).
bool usesC10d(const ElasticOptions& options);
// Whether it runs the static rendezvous of several nodes (rendezvous.h,
// makeStaticRendezvous).
bool staticSeveral(const ElasticOptions& options);

// Several c10d, etcd or static nodes must share one job token:
// InvalidArgumentError
// when `env` has no TRELLIS_JOB_TOKEN for such a run (docs/elastic.md,
// "Authentication").
void checkJobToken(const ElasticOptions& options, const Environment& env);

// A TCP port nobody listens on at `host` right now (bound with port 0 and
// released). Another process may take it before rank 0 binds it; the
// window is small and rank 0's failure to bind is loud. Throws the errno's
// exception when `host` cannot be bound.
uint16_t pickFreePort(const std::string& host);

class Agent {
 public:
  Agent(ElasticOptions options, AgentConfig config);
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Runs the job to its end (see the file comment). Never throws for what
  // workers or signals do; throws InvalidArgumentError for options that
  // checkSupported refuses or that the other nodes' round record
  // contradicts (another --nproc-per-node or --rdzv-id), and what the c10d
  // rendezvous throws while no worker runs (an unreachable endpoint, a join
  // timeout, a garbled record).
  RunResult run();

  AgentState state() const { return state_; }

 private:
  void setState(AgentState next);
  void log(const std::string& line) const;

  ElasticOptions options_;
  AgentConfig config_;
  AgentState state_ = AgentState::kInit;
};

}  // namespace trellis::elastic
