#pragma once
// ProcessGroup: collectives and point-to-point ops among the ranks of a
// group, with torch.distributed's meaning (docs/collectives.md).
//
//   auto pg = trellis::collectives::ProcessGroup::fromEnvironment();
//   auto t = torch::ones({4});
//   pg->allreduce(t).wait();          // t == worldSize everywhere
//
// Contract
//  - create() is collective: every rank of the group calls it with the
//    same backend, world size and store. It returns once every rank is
//    connected, or throws (TimeoutError naming the ranks that never came,
//    InvalidArgumentError when the ranks disagree on the world size).
//  - Every op is asynchronous and returns a Work (work.h). Ops of one group
//    run in the order they were issued, on every rank the same order;
//    groups are independent of each other.
//  - Arguments are checked at the call site and a bad one throws
//    InvalidArgumentError naming it (wrong dtype or device, non-contiguous
//    tensor, rank or root out of range, sizes that do not fit); the group
//    is unharmed. What only the other ranks can know (their sizes, their
//    op) is checked with the first message of the op: a mismatch fails the
//    op on every rank with both sides named (a "desync").
//  - Timeouts: one per group (Options::timeout, default 10 minutes),
//    enforced by the process's watchdog. An op still running that long
//    after it started fails with a TimeoutError naming the op, its
//    sequence number and the likely culprit (the ranks that never entered
//    it, or that stopped reporting), the flight recorder is written, and
//    the group is aborted (every peer fails too, with the same story). In
//    the default watchdog mode the process then exits with code 75
//    (kWatchdogExitCode) so that elastic-run restarts the group;
//    WatchdogMode::kFail only fails the ops.
//  - Errors are sticky per group: after an op failed (timeout, lost rank,
//    desync), every pending and later op of the group fails with the same
//    error. Create a new group to go on.
//  - Supported dtypes: float32, float64, float16, bfloat16, int8, uint8,
//    int32, int64, bool. Tensors must be contiguous CPU tensors for the cpu
//    backend, contiguous CUDA tensors on one device for nccl; nccl runs
//    each op after the work already on the caller's current stream, and
//    that stream after the op (docs/collectives_nccl.md). nccl has no
//    kBand/kBor/kBxor and no recvAnysource (InvalidArgumentError).
//  - Thread safety: ops may be issued from any thread; their order is the
//    order in which the calls were made (serialise the callers if several
//    threads issue ops of one group).
#include <ATen/core/Tensor.h>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/collectives/types.h>
#include <trellis/collectives/work.h>
#include <trellis/core/auth.h>
#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>

namespace trellis::store {
class Store;
}

namespace trellis::collectives {

namespace detail {
// What a backend implements (collectives/backend.h; not installed).
class Backend;
}  // namespace detail

// The longest group name (ProcessGroupOptions::name, with what newGroup()
// appends): the ranks' hellos carry it with a generation number.
inline constexpr size_t kMaxGroupNameBytes = 400;

struct ProcessGroupOptions {
  // Bound on every op, from when it starts running; unset: 10 minutes,
  // like torch.distributed.
  std::optional<Duration> timeout;
  // Bound on forming the group: connecting to the store (fromEnvironment),
  // the connections between ranks, the hosts' shared-memory setup. Unset:
  // `timeout`, as torch's init_process_group. Set it apart when ops get a
  // short timeout (fast failure detection) but ranks may start seconds
  // apart (a loaded machine, a slow file system loading libraries).
  std::optional<Duration> initTimeout;
  // Names the group in errors and logs; unset: "default" for create(),
  // "<parent>.<n>" for newGroup(). At most kMaxGroupNameBytes.
  std::string name;
  // Peers must prove knowledge of this token; unset: TRELLIS_JOB_TOKEN.
  std::optional<auth::JobToken> token;
  // The address this rank listens on (net::chooseLocalAddress's rules).
  std::string localAddress;
  // What the watchdog does after it failed the group (types.h); unset:
  // TRELLIS_WATCHDOG_MODE, else WatchdogMode::kExit.
  std::optional<WatchdogMode> watchdogMode;
  // Where the flight recorder is written when the group fails; unset:
  // TRELLIS_FLIGHT_RECORDER_DIR; empty: nowhere.
  std::optional<std::string> flightRecorderDir;
  // nccl: Work::wait() blocks the host until the GPU finished the op, not
  // only the caller's stream (work.h); unset: TRELLIS_NCCL_BLOCKING_WAIT
  // (0 or 1), else false. No effect on cpu, whose wait() always blocks.
  std::optional<bool> blockingWait;
};

class ProcessGroup {
 public:
  static constexpr Duration kDefaultTimeout = std::chrono::minutes(10);

  // `backend`: "cpu" (tensors on the CPU); "nccl" where built with NCCL.
  // Anything else is an InvalidArgumentError listing what exists.
  static std::shared_ptr<ProcessGroup> create(
      const std::string& backend, std::shared_ptr<store::Store> store, int rank,
      int worldSize, ProcessGroupOptions options = {});

  // The torchrun way: RANK and WORLD_SIZE from the environment, the store
  // at MASTER_ADDR:MASTER_PORT (rank 0 hosts it, or the launcher when
  // TORCHELASTIC_USE_AGENT_STORE=True: store/worker_store.h),
  // TRELLIS_JOB_TOKEN.
  static std::shared_ptr<ProcessGroup> fromEnvironment(
      const std::string& backend = "cpu", ProcessGroupOptions options = {});

  // A group whose last owner is dropped inside a point-to-point op's
  // callback (which runs on the transport's loop thread) finishes its
  // teardown on a thread of its own. This waits until every such teardown
  // is done; false when some were not within `timeout`. For a program (or
  // test) about to exit, like rpc::Agent::awaitDeferredTeardowns.
  static bool awaitDeferredTeardowns(Duration timeout);

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  Duration timeout() const { return timeout_; }
  const std::string& backendName() const { return backend_; }

  // A subgroup of `ranks` (ranks of this group, any order, no repeats).
  // Collective over THIS group: every rank calls it with the same list, in
  // the same order relative to its other newGroup calls. Returns nullptr
  // on ranks outside `ranks`. The subgroup's rank i is ranks[i].
  std::shared_ptr<ProcessGroup> newGroup(std::vector<int> ranks,
                                         ProcessGroupOptions options = {});

  // In place: every rank's `tensor` ends as the reduction over all ranks.
  Work allreduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum);
  // Several tensors (one dtype) reduced as one op.
  Work allreduceCoalesced(std::vector<at::Tensor> tensors,
                          ReduceOp op = ReduceOp::kSum);
  // In place: every rank's `tensor` ends equal to the root's.
  Work broadcast(at::Tensor tensor, int root = 0);
  // In place on the root; other ranks' tensors are left unchanged.
  Work reduce(at::Tensor tensor, int root = 0, ReduceOp op = ReduceOp::kSum);
  // outputs[r] receives rank r's `input`; outputs.size() == size().
  Work allgather(std::vector<at::Tensor> outputs, at::Tensor input);
  // `output` (size() * input.numel() elements) receives the inputs in rank
  // order: torch's all_gather_into_tensor.
  Work allgatherIntoTensor(at::Tensor output, at::Tensor input);
  // On the root, outputs[r] receives rank r's input; elsewhere `outputs`
  // must be empty.
  Work gather(std::vector<at::Tensor> outputs, at::Tensor input, int root = 0);
  // The root sends inputs[r] to rank r's `output`; elsewhere `inputs` must
  // be empty.
  Work scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root = 0);
  // `output` receives the reduction over all ranks of their inputs[rank].
  Work reduceScatter(at::Tensor output, std::vector<at::Tensor> inputs,
                     ReduceOp op = ReduceOp::kSum);
  // `input` has size() * output.numel() elements: block r of every rank
  // reduced into rank r's `output` (torch's reduce_scatter_tensor).
  Work reduceScatterTensor(at::Tensor output, at::Tensor input,
                           ReduceOp op = ReduceOp::kSum);
  // Block r of `input` goes to rank r; block r of `output` comes from rank
  // r. Blocks are slices along dim 0: equal (splits empty) or of the given
  // sizes (each split list has size() entries summing to dim 0).
  Work alltoall(at::Tensor output, at::Tensor input,
                std::vector<int64_t> outputSplits = {},
                std::vector<int64_t> inputSplits = {});
  // Completes once every rank reached it.
  Work barrier();
  // Point to point, matched by (source, tag) in posting order; outside the
  // collectives' order (a send completes once its data left).
  Work send(at::Tensor tensor, int dst, int64_t tag = 0);
  Work recv(at::Tensor tensor, int src, int64_t tag = 0);
  // From whichever rank sends first with `tag`; Work::sourceRank() says who.
  Work recvAnysource(at::Tensor tensor, int64_t tag = 0);

 private:
  struct Op;
  // The flight recorder and the watchdog's handle (process_group.cc).
  struct Monitoring;
  ProcessGroup(std::string backend, std::string name, int rank, int size,
               Duration timeout, std::shared_ptr<store::Store> store,
               std::shared_ptr<detail::Backend> impl,
               ProcessGroupOptions options);
  // send (peer >= 0), recv (peer >= 0) or recvAnysource (peer < 0).
  Work p2p(bool isSend, int peer, int64_t tag, const at::Tensor& tensor,
           const std::string& what);
  Work enqueue(Op op);

  const std::string backend_;
  const std::string name_;
  const int rank_;
  const int size_;
  const Duration timeout_;
  std::shared_ptr<store::Store> store_;
  std::shared_ptr<detail::Backend> impl_;
  std::unique_ptr<Monitoring> monitoring_;
  ProcessGroupOptions options_;
  Mutex issueMu_;
  uint64_t nextSeq_ TRELLIS_GUARDED_BY(issueMu_) = 1;
  int subgroups_ TRELLIS_GUARDED_BY(issueMu_) = 0;
};

}  // namespace trellis::collectives
