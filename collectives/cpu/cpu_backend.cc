#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>

#include <trellis/collectives/cpu/algorithms.h>
#include <trellis/collectives/cpu/cpu_backend.h>
#include <trellis/core/mutex.h>

namespace trellis::collectives::detail {

namespace {

constexpr Duration kBackstop = std::chrono::seconds(60);

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<Mesh> mesh, std::optional<HostLayout> hosts,
             std::unique_ptr<HostShm> shm, Duration timeout, AllreduceAlgo algo)
      : mesh_(std::move(mesh)),
        hosts_(std::move(hosts)),
        shm_(std::move(shm)),
        timeout_(timeout),
        algo_(algo) {
    worker_.start("pg-cpu",
                  [this](const std::atomic<bool>& gone) { run(gone); });
  }

  ~CpuBackend() override {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.notifyAll();
    // Ops still queued fail with the mesh's error once it is torn down;
    // abort first so the op running now ends promptly.
    mesh_->abort(Error::cancelled(mesh_->description() +
                                  " was destroyed on rank " +
                                  std::to_string(mesh_->rank())));
    if (worker_.isCurrent()) {
      // A done callback on the worker dropped the group's last owner: the
      // worker will not come back for what is queued, so it fails here.
      std::deque<Item> left;
      {
        MutexLock lock(mu_);
        left.swap(queue_);
      }
      for (auto& item : left) {
        item.done(mesh_->error());
      }
    }
    worker_.finish();  // on the worker: run() returns without touching us
    mesh_.reset();
  }

  bool wantsCuda() const override { return false; }

  StreamJoin enqueue(OpSpec op, Started started, Done done) override {
    {
      MutexLock lock(mu_);
      queue_.push_back({std::move(op), std::move(started), std::move(done)});
    }
    cv_.notifyAll();
    return {};
  }

  void abort(const Error& reason) override { mesh_->abort(reason); }

  // The mesh's sticky error: a desync, a lost peer or a peer's abort that
  // the watchdog should act on even when no op of this rank is running.
  Error poll() override { return mesh_->error(); }

  StreamJoin send(int peer, int64_t tag, DType dtype, const void* data,
                  size_t bytes, Placement /*where*/, Done done) override {
    mesh_->sendTagged(peer, tag, dtype, data, bytes, std::move(done));
    return {};
  }

  StreamJoin recv(int peer, int64_t tag, DType dtype, void* data, size_t bytes,
                  Placement /*where*/, SourceDone done) override {
    mesh_->recvTagged(peer, tag, dtype, data, bytes, std::move(done));
    return {};
  }

 private:
  struct Item {
    OpSpec op;
    Started started;
    Done done;
  };

  void run(const std::atomic<bool>& gone) {
    for (;;) {
      Item item;
      {
        MutexLock lock(mu_);
        while (queue_.empty() && !stopping_) {
          cv_.wait(mu_);
        }
        if (queue_.empty()) {
          return;
        }
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      Error e = mesh_->error();
      if (e.ok()) {
        item.started();
        e = runOne(item.op);
      }
      item.done(e);
      if (gone.load()) {
        return;  // destroyed by that callback: `this` is no more
      }
    }
  }

  Error runOne(OpSpec& op) {
    mesh_->noteStarted(op.fp);
    if (shm_) {
      shm_->noteStarted(op.fp);
    }
    // The watchdog fails an op at the group's timeout, naming the culprit;
    // this deadline is only a backstop should the watchdog itself be stuck.
    AlgoContext c{.mesh = *mesh_,
                  .fp = op.fp,
                  .deadline = Deadline::fromTimeout(timeout_ + kBackstop),
                  .scratch = scratch_,
                  .algo = algo_,
                  .hosts = hosts_ ? &*hosts_ : nullptr,
                  .shm = shm_.get(),
                  .team = {},
                  .teamIndex = -1};
    switch (op.fp.op) {
      case OpType::kAllreduce:
        return allreduce(c, op.data, op.count);
      case OpType::kAllreduceCoalesced:
        return allreduceCoalesced(c, op);
      case OpType::kBroadcast:
        return broadcast(c, op.data, op.count * elementSize(op.fp.dtype));
      case OpType::kReduce:
        return reduce(c, op.data, op.count);
      case OpType::kAllgather:
        return allgather(c, op.inputs[0], op.bytes, op.outputs);
      case OpType::kGather:
        return gather(c, op.inputs[0], op.bytes, op.outputs);
      case OpType::kScatter:
        return scatter(c, op.inputs, op.outputs[0], op.bytes);
      case OpType::kReduceScatter:
        return reduceScatter(c, op.inputs, op.outputs[0], op.count);
      case OpType::kAlltoall:
        return alltoall(c, static_cast<const uint8_t*>(op.inputs[0]),
                        op.inOffsets, op.inLengths,
                        static_cast<uint8_t*>(op.outputs[0]), op.outOffsets,
                        op.outLengths);
      case OpType::kBarrier:
        return barrier(c);
      case OpType::kSend:
      case OpType::kRecv:
        break;
    }
    return Error::internal("cpu backend: op " +
                           std::string(toString(op.fp.op)) +
                           " reached the collective queue");
  }

  Error allreduceCoalesced(AlgoContext& c, OpSpec& op) {
    Pieces tensors{.pieces = {}, .elementSize = elementSize(op.fp.dtype)};
    for (size_t i = 0; i < op.counts.size(); ++i) {
      tensors.pieces.push_back(
          {static_cast<uint8_t*>(op.outputs[i]), op.counts[i]});
    }
    return allreduce(c, tensors, packed_);
  }

  std::unique_ptr<Mesh> mesh_;
  // Set when ranks share hosts and the group agreed on shared memory.
  const std::optional<HostLayout> hosts_;
  const std::unique_ptr<HostShm> shm_;
  const Duration timeout_;
  const AllreduceAlgo algo_;
  // Touched only by the worker thread.
  Scratch scratch_;
  std::vector<uint8_t> packed_;  // allreduceCoalesced's, off one host

  Mutex mu_;
  CondVar cv_;
  std::deque<Item> queue_ TRELLIS_GUARDED_BY(mu_);
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  BackendThread worker_;  // last: started once the rest exists
};

}  // namespace

std::unique_ptr<Backend> createCpuBackend(store::Store& store, int rank,
                                          int size, MeshOptions options) {
  const Duration timeout = options.timeout;
  const Duration initTimeout = options.initTimeout;
  // Both read the environment: a bad value fails before any connection.
  const AllreduceAlgo algo = allreduceAlgoFromEnvironment();
  const std::string hostKey = HostLayout::hostKey(rank);
  auto mesh = Mesh::connect(store, rank, size, std::move(options));
  std::optional<HostLayout> hosts;
  std::unique_ptr<HostShm> shm;
  if (size > 1) {
    HostLayout layout =
        HostLayout::exchange(store, *mesh, hostKey, initTimeout);
    bool everyHost = false;
    if (layout.anyShared()) {
      shm = HostShm::create(store, *mesh, layout, initTimeout, &everyHost);
    }
    if (everyHost) {
      hosts = std::move(layout);
    }
  }
  return std::make_unique<CpuBackend>(std::move(mesh), std::move(hosts),
                                      std::move(shm), timeout, algo);
}

}  // namespace trellis::collectives::detail
