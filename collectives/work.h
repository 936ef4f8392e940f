#pragma once
// Work: the handle of one asynchronous collective or point-to-point op
// (docs/collectives.md).
//
// Contract
//  - Every ProcessGroup op returns a Work at once; the op runs in the
//    background, after the ops issued before it on the same group.
//  - The tensors passed to the op are borrowed until the Work completes:
//    do not read outputs or change inputs before then. The Work keeps
//    them alive.
//  - wait() blocks until the op completed and throws its error as a typed
//    exception (TimeoutError, ConnectionError naming the lost rank,
//    FailedPreconditionError for a desync or a peer that gave up,
//    InvalidArgumentError...). The op itself is bounded by its group's
//    timeout, so wait() is bounded too. wait(timeout) additionally gives up
//    after `timeout` with a TimeoutError naming the op; the op then goes on,
//    and the tensors stay borrowed.
//  - nccl (as torch.distributed): wait() blocks the caller's current CUDA
//    stream, not the host. It orders what is put on that stream afterwards
//    after the op and returns at once, throwing only an error the op
//    already has; a later failure reaches the next wait() and the watchdog.
//    ProcessGroupOptions::blockingWait (TRELLIS_NCCL_BLOCKING_WAIT=1) makes
//    it block the host until the GPU finished, as wait(timeout) always
//    does.
//  - isCompleted(), exception() and future() never block. exception() is
//    ok() until the op failed. future() completes with the op's output
//    tensors (the in-place tensor for in-place ops), or its error.
//  - Thread safety: every method may be called from any thread; copies
//    share one op.
#include <ATen/core/Tensor.h>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/future.h>

namespace trellis::collectives {

class Work {
 public:
  Work(Future<std::vector<at::Tensor>> future, std::string description);

  void wait() const;
  void wait(Duration timeout) const;
  [[nodiscard]] bool isCompleted() const;
  [[nodiscard]] Error exception() const;
  const Future<std::vector<at::Tensor>>& future() const { return future_; }
  // "seq 42 allreduce(float32[1048576], sum) on group 'default'"; for a
  // point-to-point op, its peer and tag.
  const std::string& description() const { return description_; }
  // recvAnysource: the rank the message came from, once completed; -1
  // before and for every other op.
  int sourceRank() const;

  // Internal: recvAnysource fills it in.
  struct Source {
    std::atomic<int> rank{-1};
  };
  Work(Future<std::vector<at::Tensor>> future, std::string description,
       std::shared_ptr<Source> source);
  // Internal: nccl's wait() without the host (joins the current stream).
  Work(Future<std::vector<at::Tensor>> future, std::string description,
       std::shared_ptr<Source> source, std::function<Error()> streamWait);

 private:
  Future<std::vector<at::Tensor>> future_;
  std::string description_;
  std::shared_ptr<Source> source_;
  std::function<Error()> streamWait_;
};

}  // namespace trellis::collectives
