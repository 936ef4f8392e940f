// The nccl backend (docs/collectives_nccl.md; contract in nccl_backend.h
// and backend.h). Kept in one file of about 1000 lines on purpose: the op
// mapping, the communicators' lifecycle and the completion and abort paths
// share one lock order (launchMu_ before mu_) and one sticky-error rule,
// which are easiest to check when they sit side by side. Run on one GPU
// only (groups of one rank; docs/collectives_nccl.md, "Status").
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cuda_runtime.h>
#include <functional>
#include <map>
#include <memory>
#include <nccl.h>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <trellis/collectives/dtype.h>
#include <trellis/collectives/nccl/nccl_backend.h>
#include <trellis/core/deadline.h>
#include <trellis/core/mutex.h>
#include <trellis/store/store.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "the nccl backend needs NCCL 2.10 or newer (ncclAvg, ncclBfloat16)"
#endif
// Non-blocking communicators (NCCL 2.14): init, finalize and abort never
// hang a thread, and any call may answer ncclInProgress (see settle()).
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
#define TRELLIS_NCCL_NONBLOCKING 1
#endif

namespace trellis::collectives::detail {

namespace {

// How often a thread waiting for NCCL's progress looks again.
constexpr auto kSettleInterval = std::chrono::microseconds(200);
// The completion thread's pause between queries of the oldest pending op's
// end event: it starts at nothing (a yield) and doubles up to this while the
// op runs, so wait() learns of a short op within microseconds and a long one
// costs at most this much host latency at a few thousand queries a second.
constexpr auto kCompletionPollMax = std::chrono::microseconds(100);

std::string cudaText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

Code ncclCode(ncclResult_t r) {
  switch (r) {
    case ncclSystemError:
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    case ncclRemoteError:
#endif
      return Code::kUnavailable;
    default:
      return Code::kInternal;
  }
}

ncclDataType_t ncclType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt8:
      return ncclInt8;
    case DType::kUInt8:
    case DType::kBool:  // one byte, 0 or 1: see ncclOp
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  return ncclUint8;
}

// Bool travels as uint8 (0 false, anything else true): or is max, and is
// min, as the cpu backend's kernels (types.h). The front end refuses the
// bitwise ops NCCL lacks.
bool ncclOp(DType d, ReduceOp op, ncclRedOp_t* out) {
  if (d == DType::kBool) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
      case ReduceOp::kMax:
        *out = ncclMax;
        return true;
      case ReduceOp::kProduct:
      case ReduceOp::kMin:
        *out = ncclMin;
        return true;
      default:
        return false;
    }
  }
  switch (op) {
    case ReduceOp::kSum:
      *out = ncclSum;
      return true;
    case ReduceOp::kAvg:  // integers: sum, then NCCL's integer division
      *out = ncclAvg;
      return true;
    case ReduceOp::kProduct:
      *out = ncclProd;
      return true;
    case ReduceOp::kMin:
      *out = ncclMin;
      return true;
    case ReduceOp::kMax:
      *out = ncclMax;
      return true;
    default:
      return false;
  }
}

// Makes `device` current on the calling thread while it lives, and puts
// back the one that was, if it differs.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      previous_ = -1;
    }
    if (previous_ != device) {
      error_ = cudaSetDevice(device);
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) {
      (void)cudaSetDevice(previous_);  // nothing to do about a failure here
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// One device's communicator and what its ops need. `comm`, `aborted` and
// the scratch are touched under the backend's launchMu_; the rest is set
// once before the object is published.
struct DeviceComm {
  int device = -1;
  int index = 0;  // the n-th communicator this rank made in the group
  ncclComm_t comm = nullptr;
  bool aborted = false;
  cudaStream_t stream = nullptr;  // the internal stream
  cudaEvent_t ready = nullptr;    // recorded on the caller's stream
  void* scratch = nullptr;
  size_t scratchBytes = 0;
  std::string label;  // "group 'g' rank 1, communicator 0 on cuda:1"

  // Frees the CUDA objects (not the communicator); never blocks the host.
  void releaseCuda() {
    DeviceGuard g(device);
    if (scratch != nullptr) {
      (void)cudaFreeAsync(scratch, stream);
    }
    if (ready != nullptr) {
      (void)cudaEventDestroy(ready);
    }
    if (stream != nullptr) {
      (void)cudaStreamDestroy(stream);
    }
    scratch = nullptr;
    ready = nullptr;
    stream = nullptr;
  }
};

class NcclBackend final : public Backend {
 public:
  using Issue = std::function<Error(DeviceComm&)>;

  NcclBackend(std::shared_ptr<store::Store> store, int rank, int size,
              MeshOptions options)
      : store_(std::move(store)),
        rank_(rank),
        size_(size),
        timeout_(options.timeout),
        description_(options.description + " rank " + std::to_string(rank)) {
    completer_.start("pg-nccl-done", [this](const std::atomic<bool>& gone) {
      completeLoop(gone);
    });
  }

  ~NcclBackend() override {
    stopCompleter();
    bool busy = false;
    {
      MutexLock lock(mu_);
      busy = !pending_.empty() && !aborted_;
    }
    if (busy) {
      abort(Error::cancelled(description_ + ": the nccl backend was "
                                            "destroyed with ops pending"));
    } else {
      destroyComms();
    }
    MutexLock lock(mu_);
    for (auto& [device, c] : comms_) {
      c->releaseCuda();
    }
    for (auto& [device, events] : freeEvents_) {
      for (cudaEvent_t ev : events) {
        (void)cudaEventDestroy(ev);
      }
    }
  }

  bool wantsCuda() const override { return true; }

  StreamJoin enqueue(OpSpec op, Started started, Done done) override {
    const int device = op.device;
    void* stream = op.stream;
    return launch(
        device, stream,
        [this, op = std::move(op)](DeviceComm& c) { return runOp(op, c); },
        std::move(started), std::move(done));
  }

  // NCCL matches a pair's sends and receives in issue order; it has no
  // tags, so `tag` is not used (as torch's nccl backend).
  StreamJoin send(int peer, int64_t /*tag*/, DType /*dtype*/, const void* data,
                  size_t bytes, Placement where, Done done) override {
    return launch(
        where.device, where.stream,
        [this, peer, data, bytes](DeviceComm& c) {
          return settle(
              c, ncclSend(data, bytes, ncclUint8, peer, c.comm, c.stream),
              "ncclSend");
        },
        nullptr, std::move(done));
  }

  StreamJoin recv(int peer, int64_t /*tag*/, DType /*dtype*/, void* data,
                  size_t bytes, Placement where, SourceDone done) override {
    if (peer < 0) {
      done(Error::invalidArgument(description_ +
                                  ": receive from any source is not "
                                  "supported by nccl"),
           -1);
      return {};
    }
    return launch(
        where.device, where.stream,
        [this, peer, data, bytes](DeviceComm& c) {
          return settle(
              c, ncclRecv(data, bytes, ncclUint8, peer, c.comm, c.stream),
              "ncclRecv");
        },
        nullptr,
        [peer, done = std::move(done)](const Error& e) { done(e, peer); });
  }

  // The completion thread completes the ops (completeLoop); the watchdog
  // only collects the errors it or NCCL found.
  Error poll() override {
    Error found;
    {
      MutexLock lock(mu_);
      if (aborted_) {
        return Error();  // abort() failed every op already
      }
      found = error_;
    }
    if (found.ok()) {
      found = asyncErrors();
    }
    return found;
  }

  void abort(const Error& reason) override {
    std::vector<Pending> failed;
    {
      MutexLock lock(mu_);
      if (aborted_) {
        return;
      }
      aborted_ = true;
      abortReason_ = reason;
      aborting_.store(true);
      failed.swap(pending_);
      completerWake_.notifyAll();
      // Their events may still be recorded; destroyed with the backend.
      for (auto& p : failed) {
        recycleLocked(p.end);
      }
    }
    // The ops fail first: their error must not wait for ncclCommAbort,
    // which may wait for the device. The caller's stream still waits for
    // each op's end, so memory it frees is reused only after the kernels
    // exited.
    for (auto& p : failed) {
      p.done(reason);
    }
    MutexLock lock(launchMu_);
    for (DeviceComm* c : commList()) {
      if (c->comm != nullptr && !c->aborted) {
        (void)ncclCommAbort(c->comm);  // the reason is what matters
        c->aborted = true;
        c->comm = nullptr;
      }
    }
  }

 private:
  // An op's end event, shared with the Works that may join a stream to it
  // (StreamJoin): recycled into freeEvents_ when the op completes if no Work
  // holds it, else destroyed by the last one.
  struct EndEvent {
    int device = -1;
    cudaEvent_t event = nullptr;
    EndEvent(int d, cudaEvent_t e) : device(d), event(e) {}
    EndEvent(const EndEvent&) = delete;
    EndEvent& operator=(const EndEvent&) = delete;
    ~EndEvent() {
      if (event != nullptr) {
        (void)cudaEventDestroy(event);  // nothing to do about a failure
      }
    }
  };

  struct Pending {
    int device = -1;
    std::shared_ptr<EndEvent> end;
    Done done;
  };

  // Returns the op's end event to the pool unless a Work still holds it.
  void recycleLocked(std::shared_ptr<EndEvent>& end) TRELLIS_REQUIRES(mu_) {
    if (end && end.use_count() == 1) {
      freeEvents_[end->device].push_back(end->event);
      end->event = nullptr;
    }
    end.reset();
  }

  // What Work::wait() calls with the caller's current stream.
  static StreamJoin joinTo(std::shared_ptr<EndEvent> end,
                           std::string description) {
    return [end = std::move(end),
            description = std::move(description)](void* stream) -> Error {
      DeviceGuard g(end->device);
      if (g.error() != cudaSuccess) {
        return Error::internal(description + ": cudaSetDevice(" +
                               std::to_string(end->device) +
                               ") failed: " + cudaText(g.error()));
      }
      const cudaError_t e =
          cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), end->event, 0);
      return e == cudaSuccess ? Error()
                              : Error::internal(description +
                                                ": cudaStreamWaitEvent "
                                                "failed: " +
                                                cudaText(e));
    };
  }

  // The completion thread: completes pending ops in issue order as their end
  // events fire, so Work::wait() returns as soon as the GPU finished (not at
  // the watchdog's next tick). It sleeps while nothing is pending, and stops
  // querying once a query failed (poll() reports that) or the backend was
  // aborted. `gone` is set by the destructor: a done callback may drop the
  // last owner of the backend, which is then destroyed on this thread.
  void completeLoop(const std::atomic<bool>& gone) {
    int current = -1;
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      std::vector<Done> finished;
      {
        MutexLock lock(mu_);
        while (!stopping_ && (pending_.empty() || aborted_ || !error_.ok())) {
          completerWake_.wait(mu_);
          pause = std::chrono::microseconds(0);
        }
        if (stopping_) {
          return;
        }
        reapLocked(current, finished);
      }
      for (auto& done : finished) {
        done(Error());
      }
      if (gone.load()) {
        return;  // destroyed by a callback above: `this` is no more
      }
      if (!finished.empty()) {
        pause = std::chrono::microseconds(0);
        continue;
      }
      if (pause.count() == 0) {
        std::this_thread::yield();
        pause = std::chrono::microseconds(1);
      } else {
        std::this_thread::sleep_for(pause);
        pause =
            std::min<std::chrono::microseconds>(pause * 2, kCompletionPollMax);
      }
    }
  }

  // Moves the done callbacks of the leading pending ops whose end events
  // fired into `finished`, in issue order; a failed query becomes the
  // sticky error.
  void reapLocked(int& current, std::vector<Done>& finished)
      TRELLIS_REQUIRES(mu_) {
    auto it = pending_.begin();
    for (; it != pending_.end(); ++it) {
      if (it->device != current) {
        // This thread's own: made current for good (no restore), so no
        // context is ever made on a device this rank does not use.
        if (cudaError_t e = cudaSetDevice(it->device); e != cudaSuccess) {
          error_ = Error::internal(description_ + ": cudaSetDevice(" +
                                   std::to_string(it->device) +
                                   ") failed: " + cudaText(e));
          break;
        }
        current = it->device;
      }
      const cudaError_t q = cudaEventQuery(it->end->event);
      if (q == cudaErrorNotReady) {
        break;  // the ops after it are ordered after it on the stream
      }
      if (q != cudaSuccess) {
        error_ = Error::internal(description_ + ": cudaEventQuery on cuda:" +
                                 std::to_string(it->device) +
                                 " failed: " + cudaText(q));
        break;
      }
      recycleLocked(it->end);
      finished.push_back(std::move(it->done));
    }
    pending_.erase(pending_.begin(), it);
  }

  void stopCompleter() {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    completerWake_.notifyAll();
    completer_.finish();  // on it: completeLoop returns without touching us
  }

  Error stickyError() {
    MutexLock lock(mu_);
    return aborted_ ? abortReason_ : error_;
  }

  void setSticky(const Error& e) {
    MutexLock lock(mu_);
    if (error_.ok()) {
      error_ = e;
    }
  }

  std::vector<DeviceComm*> commList() {
    MutexLock lock(mu_);
    std::vector<DeviceComm*> list;
    for (auto& [device, c] : comms_) {
      list.push_back(c.get());
    }
    return list;
  }

  Error cudaFailure(cudaError_t e, const std::string& call,
                    const DeviceComm& c) const {
    return Error::internal(c.label + ": " + call + " failed: " + cudaText(e));
  }

  Error ncclFailure(ncclResult_t r, const std::string& call,
                    const DeviceComm& c) const {
    std::string message =
        c.label + ": " + call + " failed: " + ncclGetErrorString(r);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    if (c.comm != nullptr) {
      const char* last = ncclGetLastError(c.comm);
      if (last != nullptr && *last != '\0') {
        message += " (" + std::string(last) + ")";
      }
    }
#endif
    return Error(ncclCode(r), std::move(message));
  }

  // The result of an NCCL call on `c`; ncclInProgress (non-blocking
  // communicators) is waited out, bounded by the group's timeout and by
  // abort().
  Error settle(DeviceComm& c, ncclResult_t r, const std::string& call) {
    const Deadline deadline = Deadline::fromTimeout(timeout_);
    while (r == ncclInProgress) {
      if (aborting_.load()) {
        return Error::cancelled(c.label + ": aborted while " + call +
                                " was in progress");
      }
      if (deadline.expired()) {
        return Error::timeout(c.label + ": " + call +
                              " still in progress after " +
                              formatDuration(timeout_));
      }
      std::this_thread::sleep_for(kSettleInterval);
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c.comm, &state);
      r = q != ncclSuccess ? q : state;
    }
    return r == ncclSuccess ? Error() : ncclFailure(r, call, c);
  }

  // NCCL calls inside a group answer at ncclGroupEnd; `calls` runs between
  // ncclGroupStart and ncclGroupEnd, and the group is always closed.
  template <typename Calls>
  Error grouped(DeviceComm& c, Calls&& calls) {
    if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) {
      return ncclFailure(r, "ncclGroupStart", c);
    }
    Error first = calls();
    Error end = settle(c, ncclGroupEnd(), "ncclGroupEnd");
    return first.ok() ? end : first;
  }

  Error inGroup(DeviceComm& c, ncclResult_t r, const char* call) {
    return r == ncclSuccess ? Error() : ncclFailure(r, call, c);
  }

  Error copy(DeviceComm& c, void* dst, const void* src, size_t bytes) {
    if (dst == src || bytes == 0) {
      return Error();
    }
    const cudaError_t e =
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c.stream);
    return e == cudaSuccess ? Error() : cudaFailure(e, "cudaMemcpyAsync", c);
  }

  // Grows the scratch buffer, stream-ordered: no device-wide sync, which
  // could deadlock against a peer still to join an earlier collective.
  Error ensureScratch(DeviceComm& c, size_t bytes) {
    if (c.scratchBytes >= bytes) {
      return Error();
    }
    if (c.scratch != nullptr) {
      if (cudaError_t e = cudaFreeAsync(c.scratch, c.stream);
          e != cudaSuccess) {
        return cudaFailure(e, "cudaFreeAsync", c);
      }
      c.scratch = nullptr;
      c.scratchBytes = 0;
    }
    if (cudaError_t e = cudaMallocAsync(&c.scratch, bytes, c.stream);
        e != cudaSuccess) {
      return cudaFailure(
          e, "cudaMallocAsync(" + std::to_string(bytes) + " bytes)", c);
    }
    c.scratchBytes = bytes;
    return Error();
  }

  Error runOp(const OpSpec& op, DeviceComm& c) {
    const DType dtype = op.fp.dtype;
    const ncclDataType_t t = ncclType(dtype);
    ncclRedOp_t r = ncclSum;
    switch (op.fp.op) {
      case OpType::kAllreduce:
      case OpType::kAllreduceCoalesced:
      case OpType::kReduce:
      case OpType::kReduceScatter:
        if (!ncclOp(dtype, op.fp.reduceOp, &r)) {
          return Error::internal(c.label + ": ReduceOp " +
                                 std::string(toString(op.fp.reduceOp)) +
                                 " reached the nccl backend");
        }
        break;
      default:
        break;
    }
    // Empty tensors (the same on every rank): no NCCL call, which could
    // refuse their null pointers.
    if (op.fp.count == 0 && op.fp.op != OpType::kBarrier &&
        op.fp.op != OpType::kAlltoall) {
      return Error();
    }
    switch (op.fp.op) {
      case OpType::kAllreduce:
        return settle(
            c,
            ncclAllReduce(op.data, op.data, op.count, t, r, c.comm, c.stream),
            "ncclAllReduce");
      case OpType::kAllreduceCoalesced:
        return grouped(c, [&] {
          for (size_t i = 0; i < op.outputs.size(); ++i) {
            if (op.counts[i] == 0) {
              continue;
            }
            Error e =
                inGroup(c,
                        ncclAllReduce(op.outputs[i], op.outputs[i],
                                      op.counts[i], t, r, c.comm, c.stream),
                        "ncclAllReduce");
            if (!e.ok()) {
              return e;
            }
          }
          return Error();
        });
      case OpType::kBroadcast:
        return settle(
            c,
            ncclBroadcast(op.data, op.data, op.count * elementSize(dtype),
                          ncclUint8, op.fp.root, c.comm, c.stream),
            "ncclBroadcast");
      case OpType::kReduce:
        return settle(c,
                      ncclReduce(op.data, op.data, op.count, t, r, op.fp.root,
                                 c.comm, c.stream),
                      "ncclReduce");
      case OpType::kAllgather:
        return allgather(op, c);
      case OpType::kGather:
        return gather(op, c);
      case OpType::kScatter:
        return scatter(op, c);
      case OpType::kReduceScatter:
        return reduceScatter(op, c, t, r);
      case OpType::kAlltoall:
        return alltoall(op, c);
      case OpType::kBarrier:
        // A one-byte allreduce: done on every rank once all reached it.
        if (Error e = ensureScratch(c, 1); !e.ok()) {
          return e;
        }
        return settle(c,
                      ncclAllReduce(c.scratch, c.scratch, 1, ncclUint8, ncclMax,
                                    c.comm, c.stream),
                      "ncclAllReduce (barrier)");
      case OpType::kSend:
      case OpType::kRecv:
        break;
    }
    return Error::internal(c.label + ": op " + std::string(toString(op.fp.op)) +
                           " reached the collective queue");
  }

  // Into the outputs when they are one buffer in rank order (as from
  // allgatherIntoTensor), else through the scratch buffer.
  Error allgather(const OpSpec& op, DeviceComm& c) {
    auto* base = static_cast<uint8_t*>(op.outputs[0]);
    bool contiguous = true;
    for (size_t i = 0; i < op.outputs.size(); ++i) {
      contiguous = contiguous && op.outputs[i] == base + i * op.bytes;
    }
    if (!contiguous) {
      if (Error e = ensureScratch(c, op.bytes * static_cast<size_t>(size_));
          !e.ok()) {
        return e;
      }
      base = static_cast<uint8_t*>(c.scratch);
    }
    if (Error e = settle(c,
                         ncclAllGather(op.inputs[0], base, op.bytes, ncclUint8,
                                       c.comm, c.stream),
                         "ncclAllGather");
        !e.ok() || contiguous) {
      return e;
    }
    for (size_t i = 0; i < op.outputs.size(); ++i) {
      if (Error e = copy(c, op.outputs[i], base + i * op.bytes, op.bytes);
          !e.ok()) {
        return e;
      }
    }
    return Error();
  }

  Error gather(const OpSpec& op, DeviceComm& c) {
    const int root = op.fp.root;
    if (rank_ == root) {
      if (Error e = copy(c, op.outputs[static_cast<size_t>(root)], op.inputs[0],
                         op.bytes);
          !e.ok()) {
        return e;
      }
    }
    return grouped(c, [&] {
      if (rank_ != root) {
        return inGroup(
            c,
            ncclSend(op.inputs[0], op.bytes, ncclUint8, root, c.comm, c.stream),
            "ncclSend (gather)");
      }
      for (int p = 0; p < size_; ++p) {
        if (p == root) {
          continue;
        }
        Error e = inGroup(c,
                          ncclRecv(op.outputs[static_cast<size_t>(p)], op.bytes,
                                   ncclUint8, p, c.comm, c.stream),
                          "ncclRecv (gather)");
        if (!e.ok()) {
          return e;
        }
      }
      return Error();
    });
  }

  Error scatter(const OpSpec& op, DeviceComm& c) {
    const int root = op.fp.root;
    if (rank_ == root) {
      if (Error e = copy(c, op.outputs[0], op.inputs[static_cast<size_t>(root)],
                         op.bytes);
          !e.ok()) {
        return e;
      }
    }
    return grouped(c, [&] {
      if (rank_ != root) {
        return inGroup(c,
                       ncclRecv(op.outputs[0], op.bytes, ncclUint8, root,
                                c.comm, c.stream),
                       "ncclRecv (scatter)");
      }
      for (int p = 0; p < size_; ++p) {
        if (p == root) {
          continue;
        }
        Error e = inGroup(c,
                          ncclSend(op.inputs[static_cast<size_t>(p)], op.bytes,
                                   ncclUint8, p, c.comm, c.stream),
                          "ncclSend (scatter)");
        if (!e.ok()) {
          return e;
        }
      }
      return Error();
    });
  }

  // From the inputs when they are one buffer in rank order (as from
  // reduceScatterTensor), else packed into the scratch buffer first.
  Error reduceScatter(const OpSpec& op, DeviceComm& c, ncclDataType_t t,
                      ncclRedOp_t r) {
    const size_t bytes = op.count * elementSize(op.fp.dtype);
    const auto* base = static_cast<const uint8_t*>(op.inputs[0]);
    bool contiguous = true;
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      contiguous = contiguous && op.inputs[i] == base + i * bytes;
    }
    if (!contiguous) {
      if (Error e = ensureScratch(c, bytes * static_cast<size_t>(size_));
          !e.ok()) {
        return e;
      }
      auto* packed = static_cast<uint8_t*>(c.scratch);
      for (size_t i = 0; i < op.inputs.size(); ++i) {
        if (Error e = copy(c, packed + i * bytes, op.inputs[i], bytes);
            !e.ok()) {
          return e;
        }
      }
      base = packed;
    }
    return settle(c,
                  ncclReduceScatter(base, op.outputs[0], op.count, t, r, c.comm,
                                    c.stream),
                  "ncclReduceScatter");
  }

  // Every pair posts one send and one receive per op, empty blocks
  // included, so the pairs always match.
  Error alltoall(const OpSpec& op, DeviceComm& c) {
    const auto* in = static_cast<const uint8_t*>(op.inputs[0]);
    auto* out = static_cast<uint8_t*>(op.outputs[0]);
    const auto self = static_cast<size_t>(rank_);
    if (Error e = copy(c, out + op.outOffsets[self], in + op.inOffsets[self],
                       op.inLengths[self]);
        !e.ok()) {
      return e;
    }
    return grouped(c, [&] {
      for (int p = 0; p < size_; ++p) {
        const auto i = static_cast<size_t>(p);
        if (p == rank_) {
          continue;
        }
        Error e = inGroup(c,
                          ncclSend(in + op.inOffsets[i], op.inLengths[i],
                                   ncclUint8, p, c.comm, c.stream),
                          "ncclSend (alltoall)");
        if (e.ok()) {
          e = inGroup(c,
                      ncclRecv(out + op.outOffsets[i], op.outLengths[i],
                               ncclUint8, p, c.comm, c.stream),
                      "ncclRecv (alltoall)");
        }
        if (!e.ok()) {
          return e;
        }
      }
      return Error();
    });
  }

  // The device of an op without tensors (barrier): the one this group
  // used last, else the calling thread's current device.
  int defaultDevice() {
    int d = lastDevice_.load();
    if (d < 0 && cudaGetDevice(&d) != cudaSuccess) {
      d = 0;
    }
    return d;
  }

  // The communicator of `device`, made on first use (collective over the
  // group). Its store exchange and init happen outside launchMu_, so poll()
  // and abort() never wait for them.
  Error commFor(int device, DeviceComm** out) {
    {
      MutexLock lock(mu_);
      if (auto it = comms_.find(device); it != comms_.end()) {
        *out = it->second.get();
        return Error();
      }
    }
    MutexLock init(initMu_);
    {
      MutexLock lock(mu_);
      if (auto it = comms_.find(device); it != comms_.end()) {
        *out = it->second.get();
        return Error();
      }
    }
    auto c = std::make_unique<DeviceComm>();
    c->device = device;
    c->index = nextComm_++;
    c->label = description_ + ", communicator " + std::to_string(c->index) +
               " on cuda:" + std::to_string(device);
    Error e = makeComm(*c);
    if (!e.ok()) {
      c->releaseCuda();
      return e;
    }
    MutexLock lock(mu_);
    if (aborted_) {
      (void)ncclCommAbort(c->comm);  // made while the group was aborted
      c->comm = nullptr;
      c->releaseCuda();
      return abortReason_;
    }
    *out = c.get();
    comms_[device] = std::move(c);
    return Error();
  }

  Error makeComm(DeviceComm& c) {
    DeviceGuard g(c.device);
    if (g.error() != cudaSuccess) {
      return cudaFailure(g.error(),
                         "cudaSetDevice(" + std::to_string(c.device) + ")", c);
    }
    if (cudaError_t e =
            cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return cudaFailure(e, "cudaStreamCreateWithFlags", c);
    }
    if (cudaError_t e =
            cudaEventCreateWithFlags(&c.ready, cudaEventDisableTiming);
        e != cudaSuccess) {
      return cudaFailure(e, "cudaEventCreateWithFlags", c);
    }
    // Numbered, not named after the device: rank r on cuda:r still meets
    // the others under one key.
    const std::string key = "nccl/comm/" + std::to_string(c.index) + "/id";
    ncclUniqueId id;
    try {
      if (rank_ == 0) {
        if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
          return ncclFailure(r, "ncclGetUniqueId", c);
        }
        store_->set(key, std::span<const uint8_t>(
                             reinterpret_cast<const uint8_t*>(&id), sizeof id));
      } else {
        store_->wait(
            {key},
            std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
        const store::Bytes bytes = store_->get(key);
        if (bytes.size() != sizeof id) {
          return Error::protocol(c.label +
                                 ": the ncclUniqueId in the store "
                                 "has " +
                                 std::to_string(bytes.size()) + " bytes, not " +
                                 std::to_string(sizeof id));
        }
        std::memcpy(&id, bytes.data(), sizeof id);
      }
    } catch (...) {
      return errorFromCurrentException().withContext(
          c.label + ": exchanging the ncclUniqueId through the store");
    }
    ncclResult_t r = ncclSuccess;
#ifdef TRELLIS_NCCL_NONBLOCKING
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    r = ncclCommInitRankConfig(&c.comm, size_, id, rank_, &config);
    Error e = c.comm == nullptr ? ncclFailure(r, "ncclCommInitRankConfig", c)
                                : settle(c, r, "ncclCommInitRankConfig");
#else
    r = ncclCommInitRank(&c.comm, size_, id, rank_);
    Error e =
        r == ncclSuccess ? Error() : ncclFailure(r, "ncclCommInitRank", c);
#endif
    if (!e.ok() && c.comm != nullptr) {
      (void)ncclCommAbort(c.comm);  // the init's error is what matters
      c.comm = nullptr;
    }
    return e;
  }

  // Orders the op after the caller's stream, puts it on the internal
  // stream, and orders the caller's stream after it. Never blocks the host
  // beyond the communicator's first use and NCCL's in-progress answers.
  // Returns the op's StreamJoin; empty where it failed at issue (`done`
  // has then fired with the error).
  StreamJoin launch(int device, void* callerStream, const Issue& issue,
                    Started started, Done done) {
    if (Error e = stickyError(); !e.ok()) {
      done(e);
      return {};
    }
    if (device < 0) {
      device = defaultDevice();
    }
    DeviceComm* c = nullptr;
    if (Error e = commFor(device, &c); !e.ok()) {
      setSticky(e);
      done(e);
      return {};
    }
    lastDevice_.store(device);
    auto caller = static_cast<cudaStream_t>(callerStream);
    cudaEvent_t end = nullptr;
    Error e;
    {
      MutexLock lock(launchMu_);
      if (c->aborted || aborting_.load()) {
        e = stickyError();
      } else {
        e = launchLocked(*c, caller, issue, &end);
      }
    }
    if (!e.ok()) {
      if (end != nullptr) {
        MutexLock lock(mu_);
        freeEvents_[device].push_back(end);
      }
      if (aborting_.load()) {
        e = stickyError();  // aborted meanwhile: the reason, as for others
      } else {
        setSticky(e);
      }
      done(e);
      return {};
    }
    if (started) {
      started();
    }
    auto shared = std::make_shared<EndEvent>(device, end);
    StreamJoin join = joinTo(shared, c->label);
    Error abortedWith;
    {
      MutexLock lock(mu_);
      if (aborted_) {
        abortedWith = abortReason_;
      } else {
        pending_.push_back({device, std::move(shared), std::move(done)});
        completerWake_.notifyAll();
      }
    }
    if (!abortedWith.ok()) {
      done(abortedWith);
    }
    return join;
  }

  Error launchLocked(DeviceComm& c, cudaStream_t caller, const Issue& issue,
                     cudaEvent_t* end) {
    DeviceGuard g(c.device);
    if (g.error() != cudaSuccess) {
      return cudaFailure(g.error(),
                         "cudaSetDevice(" + std::to_string(c.device) + ")", c);
    }
    {
      MutexLock lock(mu_);
      auto& free = freeEvents_[c.device];
      if (!free.empty()) {
        *end = free.back();
        free.pop_back();
      }
    }
    if (*end == nullptr) {
      if (cudaError_t e = cudaEventCreateWithFlags(end, cudaEventDisableTiming);
          e != cudaSuccess) {
        *end = nullptr;
        return cudaFailure(e, "cudaEventCreateWithFlags", c);
      }
    }
    if (cudaError_t e = cudaEventRecord(c.ready, caller); e != cudaSuccess) {
      return cudaFailure(e, "cudaEventRecord (caller's stream)", c);
    }
    if (cudaError_t e = cudaStreamWaitEvent(c.stream, c.ready, 0);
        e != cudaSuccess) {
      return cudaFailure(e, "cudaStreamWaitEvent (internal stream)", c);
    }
    if (Error e = issue(c); !e.ok()) {
      return e;
    }
    if (cudaError_t e = cudaEventRecord(*end, c.stream); e != cudaSuccess) {
      return cudaFailure(e, "cudaEventRecord (internal stream)", c);
    }
    if (cudaError_t e = cudaStreamWaitEvent(caller, *end, 0);
        e != cudaSuccess) {
      return cudaFailure(e, "cudaStreamWaitEvent (caller's stream)", c);
    }
    return Error();
  }

  // Polls each communicator's asynchronous error, unless a launch holds
  // them now (then next tick: a launch never waits longer than the
  // timeout, and a started op is bounded by the watchdog anyway).
  Error asyncErrors() {
    const std::vector<DeviceComm*> list = commList();
    if (!launchMu_.tryLock()) {
      return Error();
    }
    Error found;
    for (DeviceComm* c : list) {
      if (c->comm == nullptr || c->aborted) {
        continue;
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c->comm, &state);
      const ncclResult_t r = q != ncclSuccess ? q : state;
      if (r != ncclSuccess && r != ncclInProgress) {
        found = ncclFailure(r, "the communicator (ncclCommGetAsyncError)", *c);
        break;
      }
    }
    launchMu_.unlock();
    if (!found.ok()) {
      setSticky(found);
    }
    return found;
  }

  // No op pending: every communicator is flushed and freed, each bounded
  // by the timeout (then aborted).
  void destroyComms() {
    MutexLock lock(launchMu_);
    for (DeviceComm* c : commList()) {
      if (c->comm == nullptr || c->aborted) {
        continue;
      }
#ifdef TRELLIS_NCCL_NONBLOCKING
      if (!settle(*c, ncclCommFinalize(c->comm), "ncclCommFinalize").ok()) {
        (void)ncclCommAbort(c->comm);  // destroying: nobody to tell
        c->comm = nullptr;
        continue;
      }
#endif
      (void)ncclCommDestroy(c->comm);  // destroying: nobody to tell
      c->comm = nullptr;
    }
  }

  const std::shared_ptr<store::Store> store_;
  const int rank_;
  const int size_;
  const Duration timeout_;
  const std::string description_;  // "group 'g' rank 1"

  // Serialises every NCCL call on the communicators (launches, the
  // asynchronous-error check, abort, destroy). Taken before mu_.
  Mutex launchMu_;
  // Serialises making communicators (store exchange and init).
  Mutex initMu_;
  int nextComm_ TRELLIS_GUARDED_BY(initMu_) = 0;
  std::atomic<bool> aborting_{false};
  std::atomic<int> lastDevice_{-1};

  Mutex mu_;
  std::map<int, std::unique_ptr<DeviceComm>> comms_ TRELLIS_GUARDED_BY(mu_);
  std::map<int, std::vector<cudaEvent_t>> freeEvents_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Pending> pending_ TRELLIS_GUARDED_BY(mu_);
  Error error_ TRELLIS_GUARDED_BY(mu_);  // sticky: first launch/CUDA error
  bool aborted_ TRELLIS_GUARDED_BY(mu_) = false;
  Error abortReason_ TRELLIS_GUARDED_BY(mu_);
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  CondVar completerWake_;    // with mu_: an op is pending, abort, or stop
  BackendThread completer_;  // last: started once the rest exists
};

}  // namespace

std::unique_ptr<Backend> createNcclBackend(std::shared_ptr<store::Store> store,
                                           int rank, int size,
                                           MeshOptions options) {
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    throwError(Error(Code::kFailedPrecondition,
                     options.description +
                         ": the nccl backend needs a CUDA device; "
                         "cudaGetDeviceCount failed: " +
                         cudaText(e)));
  }
  if (devices == 0) {
    throwError(Error(Code::kFailedPrecondition,
                     options.description +
                         ": the nccl backend needs a CUDA device; none is "
                         "visible"));
  }
  return std::make_unique<NcclBackend>(std::move(store), rank, size,
                                       std::move(options));
}

}  // namespace trellis::collectives::detail
