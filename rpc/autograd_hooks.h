#pragma once

// What the RPC layer knows of distributed autograd (docs/dist_autograd.md).
//
// rpc/ sits below dist_autograd/, so it only carries two ids per message
// (context id, message id) and calls the AutogradHooks that dist_autograd/
// installs on each agent. Everything about graphs, send and receive
// functions and backward lives above.
//
// The ambient context is per thread: dist_autograd::Context sets it for its
// scope, and the agent sets it while a user function runs for a request
// that carried one, so nested calls join the caller's context. Callbacks of
// futures (then(), addDoneCallback) run without it.

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <memory>
#include <vector>

namespace trellis::rpc {

// The calling thread's distributed-autograd context id; 0 = none.
uint64_t currentAutogradContext();

// Sets the calling thread's context id for the scope, restoring the
// previous one after.
class AutogradContextScope {
 public:
  explicit AutogradContextScope(uint64_t contextId);
  ~AutogradContextScope();
  AutogradContextScope(const AutogradContextScope&) = delete;
  AutogradContextScope& operator=(const AutogradContextScope&) = delete;

 private:
  uint64_t previous_;
};

// Connects tensors decoded with requires_grad to the sender's graph
// (Decoder::setGradReceiver).
class GradReceiver {
 public:
  virtual ~GradReceiver() = default;
  // `t` was decoded with requires_grad set and detached from the buffer it
  // views; afterwards it is a non-leaf whose gradient flows back to the
  // sender. May throw: the decoder turns that into its error.
  virtual void attach(at::Tensor& t) = 0;
};

// Installed by dist_autograd/ (one per agent). Called on the threads that
// send and receive; implementations are thread-safe.
class AutogradHooks {
 public:
  virtual ~AutogradHooks() = default;
  // A message in `contextId` is about to go to `peer`. `tensors` are the
  // ones it carries that require grad, in encoding order (maybe none).
  // Returns the message id for the envelope: 0 when there are none, else
  // the id of the send function recorded for them. Throws when the context
  // is not (or no longer) known here; the message is then not sent.
  virtual uint64_t recordSend(uint64_t contextId, int32_t peer,
                              const std::vector<at::Tensor>& tensors) = 0;
  // A message in `contextId` came from `peer`: the context exists here
  // afterwards and knows the peer. Returns the receiver for its tensors
  // when `messageId` != 0, else null. Throws FailedPreconditionError when
  // the context was already released on this worker.
  virtual std::unique_ptr<GradReceiver> recordRecv(uint64_t contextId,
                                                   int32_t peer,
                                                   uint64_t messageId) = 0;
};

}  // namespace trellis::rpc
