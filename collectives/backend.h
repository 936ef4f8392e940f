#pragma once
// What a ProcessGroup backend implements (not installed; no libtorch). The
// front end (process_group.cc) checks arguments, numbers the ops and turns
// tensors into the raw views of an OpSpec; a backend moves the bytes.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trellis/collectives/cpu/message.h>
#include <trellis/collectives/dtype.h>
#include <trellis/core/error.h>
#include <trellis/core/thread_name.h>

namespace trellis::collectives {

namespace detail {

// One op as views of its tensors' memory, checked by the front end.
struct OpSpec {
  Fingerprint fp;
  // -1: the tensors are on the CPU; else the CUDA device they are all on.
  int device = -1;
  // The caller's current stream on `device` (a cudaStream_t; null: the
  // legacy default stream). nccl orders the op after it, and it after the
  // op. Unused by cpu.
  void* stream = nullptr;
  // In place (allreduce, broadcast, reduce): `count` elements at `data`.
  void* data = nullptr;
  size_t count = 0;
  // Per-rank blocks (allgather, gather, scatter, reduceScatter) of `bytes`
  // each, or the tensors of allreduceCoalesced (counts[i] elements each).
  std::vector<void*> outputs;
  std::vector<const void*> inputs;
  size_t bytes = 0;
  std::vector<size_t> counts;
  // alltoall: block r of the input / output, in bytes.
  std::vector<size_t> inOffsets, inLengths, outOffsets, outLengths;
};

// Where a point-to-point op's memory is: OpSpec's device and stream.
struct Placement {
  int device = -1;
  void* stream = nullptr;
};

class Backend {
 public:
  using Started = std::function<void()>;
  using Done = std::function<void(const Error&)>;
  using SourceDone = std::function<void(const Error&, int source)>;
  // Orders work later put on `stream` (a cudaStream_t of the op's device;
  // null: the legacy default stream) after the op, without blocking the
  // host: what Work::wait() does with the caller's current stream on nccl.
  // Empty where wait() blocks the host instead (cpu; an op that failed at
  // issue).
  using StreamJoin = std::function<Error(void* stream)>;
  virtual ~Backend() = default;
  // Where the op's tensors must be: false for CPU tensors (cpu), true for
  // CUDA tensors (nccl). The front end checks it at the call site.
  virtual bool wantsCuda() const = 0;
  // Runs `op` after every op enqueued before it. `started` fires once when
  // it starts (cpu: the worker picked it up; nccl: it was put on the
  // stream); `done` fires exactly once, after the backend stopped touching
  // the op's memory (nccl: the GPU finished). Neither fires inline under
  // the caller's locks other than the issuing call itself.
  virtual StreamJoin enqueue(detail::OpSpec op, Started started, Done done) = 0;
  // Point to point, outside the collectives' order.
  virtual StreamJoin send(int peer, int64_t tag, detail::DType dtype,
                          const void* data, size_t bytes,
                          detail::Placement where, Done done) = 0;
  // peer < 0: any source (cpu only: nccl fails it).
  virtual StreamJoin recv(int peer, int64_t tag, detail::DType dtype,
                          void* data, size_t bytes, detail::Placement where,
                          SourceDone done) = 0;
  // Called by the watchdog on its thread every tick: completes ops that
  // finished (nccl: queries their events) and returns an error the backend
  // found on its own (nccl: ncclCommGetAsyncError), ok otherwise. Must not
  // block beyond a driver call.
  virtual Error poll() { return Error(); }
  // Fails every pending and later op with `reason` and stops using the
  // network (cpu: tells every peer why; nccl: ncclCommAbort). Idempotent;
  // any thread.
  virtual void abort(const Error& reason) = 0;
};

// A backend's own thread (cpu: the worker; nccl: the completion thread).
// It runs the ops' done callbacks, and one of them may drop the group's
// last owner, so the backend can be destroyed on this very thread, which
// then cannot be joined. finish() joins it from any other thread; on the
// thread itself it marks it gone and detaches it, and the thread's body
// returns without touching the backend once `gone` is set after a callback.
class BackendThread {
 public:
  BackendThread() = default;
  BackendThread(const BackendThread&) = delete;
  BackendThread& operator=(const BackendThread&) = delete;
  ~BackendThread() { finish(); }

  // Runs body(gone) on a new thread named `name` (docs/threads.md).
  template <typename Body>
  void start(std::string name, Body body) {
    thread_ = std::thread([gone = gone_, name = std::move(name),
                           body = std::move(body)]() mutable {
      setThreadName(name);
      body(*gone);
    });
  }
  bool isCurrent() const {
    return thread_.get_id() == std::this_thread::get_id();
  }
  // Idempotent; call once the body was told to stop.
  void finish() {
    if (!thread_.joinable()) {
      return;
    }
    if (isCurrent()) {
      gone_->store(true);
      thread_.detach();
    } else {
      thread_.join();
    }
  }

 private:
  const std::shared_ptr<std::atomic<bool>> gone_ =
      std::make_shared<std::atomic<bool>>(false);
  std::thread thread_;
};

}  // namespace detail

}  // namespace trellis::collectives
