#pragma once

// What the RPC layer knows of distributed autograd (docs/dist_autograd.md).
//
// rpc/ sits below dist_autograd/, so it only carries two ids per message
// (context id, message id) and lets dist_autograd/'s agent extension record
// them (onSend / onReceive in rpc/extension.h, internal). Everything about
// graphs, send and receive functions and backward lives above. What stays
// here is what the installed templates and dist_autograd.h need: the
// calling thread's context and the receiver a decoder attaches tensors to.
//
// The ambient context is per thread: dist_autograd::Context sets it for its
// scope, and the agent sets it while a user function runs for a request
// that carried one, so nested calls join the caller's context. Callbacks of
// futures (then(), addDoneCallback) run without it.

#include <ATen/core/Tensor.h>
#include <cstdint>

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

}  // namespace trellis::rpc
