#pragma once
// The reducer behind DistributedDataParallel (not installed): gradient
// buckets, the per-parameter autograd hooks that fill them, and the
// end-of-backward step that waits for them (docs/ddp.md, "Buckets").
//
// Threads: forward-side calls come from the thread that runs the module;
// onGradReady and finalize from autograd (the thread that called backward
// for CPU tensors, a device thread for CUDA ones); onContextGradients from
// the thread running a distributed-autograd context's engine run. mu_
// orders them.
//
// Two ways a backward reaches it. A local backward runs the parameters'
// grad accumulators: their post-hooks fill the buckets as gradients come
// and a callback queued on the engine finalizes. A distributed-autograd
// backward never runs the accumulators (the gradients go into the
// context): dist_autograd hands the run's gradients of the parameters to
// onContextGradients, which reduces them all at once and gives back the
// averages, which go into the context instead of .grad.
#include <ATen/core/Tensor.h>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <trellis/collectives/process_group.h>
#include <trellis/collectives/work.h>
#include <trellis/core/mutex.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/dist_autograd/dist_autograd.h>

namespace torch::autograd {
struct Node;
}

namespace trellis::ddp::detail {

// Which parameters go together, in launch order: buckets of one dtype and
// device each, filled in `order` and closed once they hold at least
// `firstCapBytes` (the first bucket of each dtype and device) or
// `capBytes` (the others); then sorted by where their first parameter
// stands in `order`. Pure: tested on its own.
std::vector<std::vector<size_t>> assignBuckets(
    const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
    size_t firstCapBytes, size_t capBytes);

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  struct Param {
    std::string name;  // module path, e.g. "branch.weight"
    at::Tensor tensor;
  };
  // Builds the first buckets (reverse registration order). install() must
  // follow, once the Reducer is owned by a shared_ptr.
  Reducer(std::shared_ptr<collectives::ProcessGroup> group, Options options,
          std::vector<Param> params);
  // Removes the hooks.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Registers the hooks (a post-hook on each parameter's grad accumulator,
  // and dist_autograd's leaf-gradient hook over the parameters).
  void install();

  // From forward, before the module runs: rebuilds the buckets once (after
  // the first armed backward, in rank 0's gradient-ready order) and arms
  // the reducer when `armed`. Throws when the previous armed backward ended
  // before its reduction did (it failed midway). The averaged gradients are
  // multiplied by `gradScale` before they are written back (Join with
  // divideByInitialWorldSize false: world size / ranks still training).
  void beginIteration(bool armed, double gradScale = 1.0);
  // A joined rank's part of one iteration of the others (Join's main
  // hook): the one-time bucket rebuild broadcast when it is due, then one
  // allreduce of zeros per bucket, same sizes and order (the flags tail
  // included), as an armed backward issues them; waits for them.
  void shadowIteration();
  // From forward, after the module ran (findUnusedParameters): the
  // parameters the autograd graph from `outputs` does not reach.
  void findUnused(const std::vector<at::Tensor>& outputs);
  // False once a staticGraph's walk is done (its unused set is reused).
  bool walkNeeded() const;

  // Before the first beginIteration, once.
  void setCommHook(CommHook hook);

  void enterNoSync();
  void exitNoSync();
  bool syncing() const;

  std::vector<std::vector<std::string>> bucketNames() const;

 private:
  struct Bucket {
    std::vector<size_t> params;
    // The parameters' slots, then (last bucket only) one flag per
    // parameter: 1 where this rank had no gradient for it.
    at::Tensor flat;
    // Elements of the parameters' slots (flat's length without the flags).
    int64_t numel = 0;
    size_t pending = 0;
    std::optional<collectives::Work> work;
    // With a comm hook: its future, and (last bucket) the flags' own
    // allreduce.
    std::optional<Future<at::Tensor>> hooked;
    std::optional<collectives::Work> flagsWork;
  };
  struct Slot {
    size_t bucket = 0;
    // The parameter-shaped part of the bucket's flat tensor (shares its
    // memory; not an autograd view).
    at::Tensor view;
    // This iteration's tensor reduced for the parameter, in place: its
    // .grad itself when `direct` (CPU, no hook, a contiguous gradient of
    // the parameter's shape: no copy into the bucket or back), else `view`
    // holding a copy.
    at::Tensor reduced;
    bool direct = false;
  };
  class ReadyHook;

  void buildBuckets(const std::vector<size_t>& order) TRELLIS_REQUIRES(mu_);
  void resetIteration() TRELLIS_REQUIRES(mu_);
  void onGradReady(size_t index);
  // A distributed-autograd engine run computed `grads` (parallel to the
  // parameters, undefined where none): reduces them like a local backward
  // and replaces them with the averages.
  void onContextGradients(uint64_t contextId, std::vector<at::Tensor>& grads);
  // The gradient this backward produced for parameter i so far: its .grad,
  // or in a context the run's gradient.
  const at::Tensor& gradOf(size_t index) const TRELLIS_REQUIRES(mu_);
  // `local`: the parameter's autograd hook fired. Otherwise it is counted
  // ready without a gradient (the walk, or the end of backward).
  void markReady(size_t index, bool local) TRELLIS_REQUIRES(mu_);
  // The error for a parameter the walk found unused that got a gradient.
  Error unusedGotGradient(size_t index) const TRELLIS_REQUIRES(mu_);
  void launchReadyBuckets() TRELLIS_REQUIRES(mu_);
  // Issues bucket b's reduction of `buffer` (its slots, or zeros of their
  // size when shadowing) and `flags` (last bucket). Without a hook, one
  // allreduce of the whole bucket: on CPU an allreduceCoalesced (the same
  // op on every rank, a joined one's zeros included) of the slots'
  // `reduced` tensors and the flags when some are gradients reduced in
  // place (`fromSlots`), else of `flat` as one tensor; on CUDA an
  // allreduce of `flat`. With a hook, the hook, then the flags' own allreduce
  // (a hook may change values, the flags must stay exact).
  void launch(size_t b, const at::Tensor& flat, const at::Tensor& flags,
              bool fromSlots) TRELLIS_REQUIRES(mu_);
  // Direct slots of bucket b whose gradients share memory with another
  // one of the bucket or with the bucket itself get a copy in their view
  // instead: reduced in place, overlapping memory would be reduced twice.
  void separateOverlaps(Bucket& b) TRELLIS_REQUIRES(mu_);
  // Waits for bucket b's reduction; the reduced gradients are in its slots.
  void await(Bucket& b) TRELLIS_REQUIRES(mu_);
  // The end of backward (a callback queued on the autograd engine).
  void finalize();
  // finalize's work: the parameters not ready yet count as unused, waits
  // for every bucket, writes the averages back (.grad, or the context's
  // gradients), and raises the unused-parameter error.
  void finalizeLocked() TRELLIS_REQUIRES(mu_);
  // Queues finalize on the engine. A function of its own (not inlined) so
  // that ThreadSanitizer's suppression can name it
  // (tests/tsan_suppressions.cc).
  [[gnu::noinline]] void queueFinalize() TRELLIS_REQUIRES(mu_);
  std::vector<size_t> orderForRebuild() const TRELLIS_REQUIRES(mu_);
  // The one-time rebuild after the first armed backward (a broadcast of
  // rank 0's order), when it is due.
  void rebuildIfPending() TRELLIS_REQUIRES(mu_);
  // An armed backward (or its shadow) ended: the rebuild is due next.
  void endRecording() TRELLIS_REQUIRES(mu_);

  const std::shared_ptr<collectives::ProcessGroup> group_;
  const Options options_;
  const std::vector<Param> params_;
  // CPU parameters: buckets go as allreduceCoalesced (Slot::direct).
  const bool cpu_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hookKeys_;
  dist_autograd::LeafGradientHookHandle contextHook_;

  mutable Mutex mu_;
  std::vector<Bucket> buckets_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Slot> slots_ TRELLIS_GUARDED_BY(mu_);
  at::Tensor flags_ TRELLIS_GUARDED_BY(mu_);  // tail of the last bucket
  size_t nextBucket_ TRELLIS_GUARDED_BY(mu_) = 0;
  std::vector<char> ready_ TRELLIS_GUARDED_BY(mu_);
  std::vector<size_t> walkUnused_ TRELLIS_GUARDED_BY(mu_);
  // staticGraph: the first armed walk's unused set, reused after.
  std::optional<std::vector<size_t>> staticUnused_ TRELLIS_GUARDED_BY(mu_);
  bool armed_ TRELLIS_GUARDED_BY(mu_) = false;
  CommHook hook_ TRELLIS_GUARDED_BY(mu_);
  bool started_ TRELLIS_GUARDED_BY(mu_) = false;  // an iteration began
  double gradScale_ TRELLIS_GUARDED_BY(mu_) = 1.0;
  bool hooksFired_ TRELLIS_GUARDED_BY(mu_) = false;
  // While onContextGradients runs: the run's gradients (read and written
  // instead of .grad).
  std::vector<at::Tensor>* contextGrads_ TRELLIS_GUARDED_BY(mu_) = nullptr;
  // The context whose gradients this iteration reduced (0: none yet).
  uint64_t reducedContext_ TRELLIS_GUARDED_BY(mu_) = 0;
  int noSyncDepth_ TRELLIS_GUARDED_BY(mu_) = 0;
  // Gradient-ready order of the first armed backward, and whether the
  // buckets are still to be rebuilt from it.
  bool recording_ TRELLIS_GUARDED_BY(mu_) = true;
  bool rebuildPending_ TRELLIS_GUARDED_BY(mu_) = false;
  std::vector<size_t> readyOrder_ TRELLIS_GUARDED_BY(mu_);
};

}  // namespace trellis::ddp::detail
