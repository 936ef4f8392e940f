#pragma once

// One call to start a worker of a distributed job (docs/job.md): what
// torch.distributed users write as init_process_group + init_rpc.
//
//   auto job = trellis::init({.rpcName = isServer ? "ps" : "trainer" + id,
//                             .groupRanks = trainerRanks});
//   auto model = trellis::ddp::DistributedDataParallel(net, job.group());
//   ...
//   job.shutdown();   // or let `job` go out of scope
//
// init():
//  1. installs the error-file handler (elastic/errors.h): an exception that
//     escapes main, or any thread, is written to TORCHELASTIC_ERROR_FILE,
//     so elastic-run's summary shows its message, and the process exits 1;
//  2. reads the launcher's variables (WorkerEnv: elastic-run, torchrun,
//     srun, mpirun) and checks them against what the program expects
//     (InitOptions::worldSize, groupRanks);
//  3. connects the job's store (rank 0 serves it, or the launcher does:
//     store/worker_store.h);
//  4. checks, through the store, that every rank starts the same way (RPC
//     on every rank or on none, distinct worker names, the same group
//     ranks and backend), naming the ranks that differ or never came;
//  5. starts RPC under `rpcName` (when set) and the default process group
//     over `groupRanks` (every rank when empty).
// Every wait of start-up is bounded by one InitOptions::initTimeout.
//
// Job::shutdown() (or ~Job) ends the worker's part: a graceful RPC
// shutdown (collective over every rank), the group released, then the exit
// barrier: every rank leaves its exit code in the store, and rank 0, which
// may serve the store, leaves last, once every rank is past the store.
//
// Errors: init() and shutdown() throw trellis exceptions (core/error.h)
// whose messages start with "trellis::init" / "trellis::Job::shutdown" and
// say which option or variable to change. InitOptions' members carry "{}"
// so that GCC 12's -Wmissing-field-initializers stays quiet about the ones
// a designated initializer leaves out. A Job is used from the thread that
// made it; group() and store() are safe to share.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/collectives/process_group.h>
#include <trellis/core/deadline.h>
#include <trellis/core/worker_env.h>
#include <trellis/rpc/agent.h>
#include <trellis/store/store.h>

namespace trellis {

namespace store {
class TCPStoreServer;
}  // namespace store

struct InitOptions {
  // This worker's RPC name ("ps0", "trainer1"). Empty: no RPC. RPC spans
  // every rank of the job, so either every rank sets one or none does.
  std::string rpcName{};
  // Whether to create the default process group (Job::group()).
  bool processGroup = true;
  // The job ranks in the default group; empty: every rank. The group's rank
  // i is groupRanks[i] (as ProcessGroup::newGroup). Every rank passes the
  // same list; ranks outside it get no group.
  std::vector<int> groupRanks{};
  // The group's backend: "cpu" or "nccl" (where built with NCCL).
  std::string backend = "cpu";
  // The number of processes the program expects; unset: whatever the
  // launcher started. A mismatch fails at once, naming both.
  std::optional<int32_t> worldSize{};
  // Bound on every RPC call and collective op (RpcOptions::defaultTimeout,
  // ProcessGroupOptions::timeout); unset: their own defaults (60 s for a
  // call, 10 minutes for an op, as torch.distributed).
  std::optional<Duration> timeout{};
  // Bound on start-up as a whole: connecting the store, meeting the other
  // ranks, RPC's rendezvous, forming the group. Unset: kDefaultInitTimeout.
  std::optional<Duration> initTimeout{};
  // How long rank 0 waits in the exit barrier for the others to finish;
  // unset: kDefaultExitTimeout (torchrun's exit barrier).
  std::optional<Duration> exitTimeout{};
  // Further RPC and group settings. init() fills in the store, the job
  // token (unless set here), the timeouts above and, for the group, its
  // name ("default"; unless set here).
  rpc::RpcOptions rpc{};
  collectives::ProcessGroupOptions group{};
};

inline constexpr Duration kDefaultInitTimeout = std::chrono::minutes(2);
inline constexpr Duration kDefaultExitTimeout = std::chrono::minutes(5);

class Job {
 public:
  Job(Job&&) noexcept;
  Job& operator=(Job&&) = delete;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  // Calls shutdown() when it was not called. It never throws: a failure is
  // printed to stderr (call shutdown() to see it as an exception). While an
  // exception unwinds the stack, RPC is closed at once instead of
  // gracefully, this rank's exit code is 1, and rank 0 does not wait.
  ~Job();

  const WorkerEnv& env() const { return env_; }
  int32_t rank() const { return env_.rank; }
  int32_t worldSize() const { return env_.worldSize; }

  // The default process group; throws FailedPreconditionError on a rank
  // outside InitOptions::groupRanks or when none was asked for.
  const std::shared_ptr<collectives::ProcessGroup>& group() const;
  bool inGroup() const { return group_ != nullptr; }
  // The job ranks of the group, in group-rank order.
  const std::vector<int>& groupRanks() const { return groupRanks_; }

  // A store for the program's own keys (under "user/"), alive until
  // shutdown() returns.
  const std::shared_ptr<store::Store>& store() const { return userStore_; }

  // Ends this worker's part in the job (see the top of this file) and
  // returns the job's exit code as far as this rank knows it: on rank 0,
  // the first non-zero code any rank left (`exitCode` when all left 0), on
  // the others `exitCode`. Throws what failed: RPC's graceful shutdown (a
  // peer gone), a rank that never reached the exit barrier within
  // exitTimeout (named). Idempotent: a second call returns the first
  // call's result and throws nothing.
  int shutdown(int exitCode = 0);

 private:
  friend Job init(InitOptions options);
  Job() = default;
  void stop(int exitCode, bool graceful);
  // Leaves this rank's exit code; on rank 0, when `wait`, waits for every
  // rank's and returns the job's.
  int exitBarrier(int exitCode, bool wait);

  WorkerEnv env_;
  Duration exitTimeout_{};
  std::shared_ptr<store::TCPStoreServer> server_;
  std::shared_ptr<store::Store> store_;
  std::shared_ptr<store::Store> userStore_;
  std::shared_ptr<collectives::ProcessGroup> group_;
  std::vector<int> groupRanks_;
  bool rpcStarted_ = false;
  bool moved_ = false;
  std::optional<int> result_;
};

// Starts this worker (see the top of this file). Throws
// InvalidArgumentError for a bad option or launcher variable,
// TimeoutError naming the ranks that did not come within initTimeout,
// FailedPreconditionError when the ranks disagree on how to start, and
// what connecting the store, RPC or the group throws.
Job init(InitOptions options = {});

}  // namespace trellis
