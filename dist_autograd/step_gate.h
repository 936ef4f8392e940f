#pragma once

// StepGate: on one worker, serialises optimizer steps against the
// distributed-autograd contexts whose graphs still need the current
// parameter values (docs/dist_autograd.md, "Steps and backward passes").
// Internal to dist_autograd/; one per agent (the Container owns it).
//
// Readers and writers
//  - A context *reads* here while a user request of it runs here
//    (admit .. requestDone) or while a send function it recorded here
//    waits for its gradients (sendRecorded .. sendAnswered / sendsDropped),
//    until it is released here (release).
//  - A *writer* is an optimizer step for some context. beginWrite
//    completes once every reading context is one that is itself writing
//    (its own context included: a context steps after its backward, so
//    what it still "reads" is a send whose gradient will never come). It
//    fails with DEADLINE_EXCEEDED at its deadline, naming the contexts that
//    still read, and with CANCELLED when the gate is destroyed.
//  - Writer preference: from beginWrite until its endWrite (or its
//    failure), a request of a context that does not read here is held:
//    admit returns a pending future. Requests of contexts that read are
//    never held (their backward may be what the writer waits for), and
//    protocol messages never come here. When a writer ends, every request
//    held at that moment is admitted at once, even if other writers wait
//    (they then wait for those readers): neither side starves.
//
// Cost: admit on the fast path (no writer) is one lock, counter updates and
// a copy of a shared, already completed future; nothing is allocated.
//
// Thread safety: every method may be called from any thread. Futures are
// completed without the gate's lock held, on the calling thread of the
// method that let them through (or the gate's timer thread at a deadline).

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/core/future.h>
#include <trellis/core/mutex.h>

namespace trellis::rpc {
class Agent;
}

namespace trellis::dist_autograd::detail {

// One context's standing on one worker. Fields are guarded by the gate's
// mutex; only the gate touches them.
struct GateSlot {
  explicit GateSlot(uint64_t contextId) : id(contextId) {}
  const uint64_t id;

  uint32_t running = 0;       // admitted requests not yet done
  uint32_t pendingSends = 0;  // send functions waiting for a gradient
  uint32_t writing = 0;       // steps of this context waiting or running
  bool released = false;
  // Intrusive list of reading slots (no allocation per request).
  GateSlot* prev = nullptr;
  GateSlot* next = nullptr;
  bool listed = false;

  bool reading() const {
    return !released && (running > 0 || pendingSends > 0);
  }
};

class StepGate {
 public:
  // `worker` names this worker in error messages.
  explicit StepGate(std::string worker);
  // Fails every held request and waiting writer with CANCELLED.
  ~StepGate();
  StepGate(const StepGate&) = delete;
  StepGate& operator=(const StepGate&) = delete;

  // ---- readers ----
  // A user request of `slot`'s context is about to run. Completed future:
  // admitted (running was counted). Pending: held behind a writer; it
  // completes when admitted (counted then) or fails at `deadline`
  // (DEADLINE_EXCEEDED, not counted). A released slot fails at once with
  // FAILED_PRECONDITION.
  Future<void> admit(const std::shared_ptr<GateSlot>& slot, Deadline deadline);
  // The admitted request finished (its result encoded).
  void requestDone(GateSlot& slot);
  // A send function with tensors was recorded / got its first gradient and
  // the engine run for it here finished / `n` will never get one.
  void sendRecorded(GateSlot& slot);
  void sendAnswered(GateSlot& slot);
  void sendsDropped(GateSlot& slot, uint32_t n);
  // The context was released here: it reads no more, whatever it counted.
  void release(GateSlot& slot);

  // ---- writers ----
  // See the contract above; `what` prefixes the timeout error
  // ("step of context 1:4").
  Future<void> beginWrite(const std::shared_ptr<GateSlot>& slot,
                          Deadline deadline, std::string what);
  // The step that beginWrite let through has finished.
  void endWrite(GateSlot& slot);

  // Tests and diagnostics.
  struct Counts {
    size_t reading = 0;
    size_t writers = 0;
    size_t held = 0;
  };
  Counts counts() const;

 private:
  struct Held {
    std::shared_ptr<GateSlot> slot;
    Promise<void> promise;
    Deadline deadline;
  };
  struct Writer {
    std::shared_ptr<GateSlot> slot;
    Promise<void> promise;
    Deadline deadline;
    Clock::time_point since;
    std::string what;
  };
  using Completions = std::vector<std::pair<Promise<void>, Error>>;

  // Apply a change to `s` and keep the list and counters in step.
  template <typename F>
  void change(GateSlot& s, F&& f, Completions& done) TRELLIS_REQUIRES(mu_);
  bool writersMayGo() const TRELLIS_REQUIRES(mu_);
  // "context 1:3, context 2:5": the reading contexts that are not writing.
  std::string describeReaders() const TRELLIS_REQUIRES(mu_);
  void letWritersGo(Completions& done) TRELLIS_REQUIRES(mu_);
  void admitHeld(Completions& done) TRELLIS_REQUIRES(mu_);
  // A writer left (done or failed).
  void endWriter(Completions& done) TRELLIS_REQUIRES(mu_);
  static void complete(Completions& done);
  void ensureTimer() TRELLIS_REQUIRES(mu_);
  void timerLoop();

  const std::string worker_;
  mutable Mutex mu_;
  GateSlot* head_ TRELLIS_GUARDED_BY(mu_) = nullptr;  // the reading slots
  size_t reading_ TRELLIS_GUARDED_BY(mu_) = 0;        // slots in that list
  // Of those, the ones with writing > 0.
  size_t readingWriting_ TRELLIS_GUARDED_BY(mu_) = 0;
  size_t writers_ TRELLIS_GUARDED_BY(mu_) = 0;  // waiting + running
  std::vector<Held> held_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Writer> waiting_ TRELLIS_GUARDED_BY(mu_);  // not yet let through
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  CondVar timerCv_;
  // Started under mu_ while !stopping_; joined by the destructor once
  // stopping_ is set, when nothing starts it any more.
  std::thread timer_;
};

// `agent`'s gate and the slot of `contextId` there (null when the context
// is not alive on that worker); dist_autograd.cc. Throws
// FailedPreconditionError when the agent has no dist_autograd support.
struct GateRef {
  StepGate* gate = nullptr;
  std::shared_ptr<GateSlot> slot;
};
GateRef gateOf(rpc::Agent& agent, uint64_t contextId);

}  // namespace trellis::dist_autograd::detail
