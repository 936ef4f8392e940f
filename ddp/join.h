#pragma once
// Join: training on uneven inputs (torch.distributed.algorithms.Join's
// meaning, docs/ddp.md "Join"). A rank that runs out of batches keeps
// issuing the collectives of the ranks still training (it "shadows" them,
// contributing zeros) until every rank has run out; then each Joinable's
// post hook runs, and DDP's makes every rank end with the same parameters.
//
//   trellis::ddp::DistributedDataParallel model(net, pg);
//   trellis::ddp::Join join({&model}, {.divideByInitialWorldSize = true});
//   for (auto& [x, y] : myShard) {       // shards may be uneven
//     opt.zero_grad();
//     torch::mse_loss(model(x), y).backward();
//     opt.step();
//   }
//   join.finish();                        // shadows until all ran out
//
// Contract
//  - Construction is local (no collective): it attaches the Joinables to
//    this Join. finish() is collective: it shadows the others' iterations,
//    one per loop round, and returns once every rank called finish(). A
//    Join destroyed without finish() (an exception left the loop) only
//    detaches: it never communicates nor throws from its destructor, so the
//    other ranks' next collective fails at the group's timeout.
//  - Every iteration, each rank still training calls notify() once, from
//    its first Joinable (DDP does it in forward): an allreduce on the first
//    Joinable's group of 1 from each rank still training and 0 from each
//    joined one. So the first Joinable must run the first collective of an
//    iteration, and the Joinables are listed in the order their collectives
//    run within an iteration (a joined rank runs their main hooks in that
//    order).
//  - throwOnEarlyTermination: as soon as one rank has called finish(),
//    every rank throws FailedPreconditionError with the same message: the
//    joined rank from finish(), the others from their next notify().
//  - enable = false: notify() and finish() issue no collectives (for code
//    that runs with and without uneven inputs).
//  - Thread safety: one thread drives a Join, as it drives the model.
#include <ATen/core/Tensor.h>
#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include <trellis/collectives/process_group.h>

namespace trellis::ddp {

class Join;

// Field order is declaration order, for designated initializers.
struct JoinOptions {
  bool enable = true;
  // Every rank raises as soon as one runs out (for programs that must see
  // every batch on every rank); no shadowing then.
  bool throwOnEarlyTermination = false;
  // DDP under Join: true (default), joined ranks contribute zero gradients
  // and the average still divides by the initial world size (so a step late
  // in training is smaller); false, divide by the number of ranks still
  // training (each step an average over real gradients; costs one multiply
  // of the gradients per step).
  bool divideByInitialWorldSize = true;
};

// What a Joinable does on a joined rank.
struct JoinHook {
  // Once per iteration the others still run: issue this Joinable's
  // collectives of one iteration, in the same order and shapes, with
  // neutral values (zeros for a sum).
  std::function<void()> mainHook;
  // Once, when every rank has joined. isLastJoiner: this rank ran out last
  // (no iteration was shadowed by it); several ranks can be last.
  std::function<void(bool isLastJoiner)> postHook;
  // Optional (last, so that {main, post} still initializes the two
  // above). Once per iteration the others still run, before any
  // Joinable's mainHook: start this Joinable's collectives of the iteration
  // without waiting for them (mainHook then waits). For a Joinable whose
  // collectives run on a group of its own and come, on the ranks still
  // training, before those of an earlier Joinable that its mainHook waits
  // for (SyncBatchNorm's statistics, issued inside DDP's forward, before
  // DDP's backward): without it the joined rank would wait for DDP's
  // buckets while the others wait for its statistics.
  std::function<void()> startHook;
};

// Something that issues collectives every iteration (a DDP model, a
// metrics allreduce). Attach it to a Join to survive uneven inputs.
class Joinable {
 public:
  Joinable() = default;
  Joinable(const Joinable&) = delete;
  Joinable& operator=(const Joinable&) = delete;
  virtual ~Joinable();

  // `options` are the Join's (DDP reads divideByInitialWorldSize).
  virtual JoinHook joinHook(const JoinOptions& options) = 0;
  // Where notify()'s count tensor lives, and over which group (used for the
  // first Joinable of a Join).
  virtual at::Device joinDevice() const = 0;
  virtual std::shared_ptr<collectives::ProcessGroup> joinProcessGroup()
      const = 0;

  // The Join this is attached to, or null.
  Join* join() const { return join_; }

 private:
  friend class Join;
  Join* join_ = nullptr;
};

class Join {
 public:
  // `joinables`: non-null, distinct, none attached to another Join.
  Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  ~Join();
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Called once per iteration by each Joinable on a rank still training.
  // For the first Joinable of its Join: the count allreduce (and, with
  // throwOnEarlyTermination, the throw); for the others nothing is sent.
  // Returns how many ranks are still training in this iteration (this
  // rank included); the group's size when `joinable` is in no Join or the
  // Join is disabled.
  static int notify(Joinable& joinable);

  // This rank ran out of inputs: shadows until every rank has, then runs
  // the post hooks. Once per Join. Throws what the collectives throw, and
  // FailedPreconditionError under throwOnEarlyTermination when a rank was
  // still training.
  void finish();

  const JoinOptions& options() const { return options_; }
  // The ranks still training at the last notify() (the group's size
  // before the first).
  int activeRanks() const { return active_; }

 private:
  int countAllreduce(int contribution);
  [[noreturn]] void throwEarlyTermination(int active) const;

  std::vector<Joinable*> joinables_;
  JoinOptions options_;
  std::shared_ptr<collectives::ProcessGroup> group_;
  at::Device device_;
  int active_ = 0;
  bool finished_ = false;
};

}  // namespace trellis::ddp
