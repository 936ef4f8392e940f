#pragma once

// The request header and the reply of one call, as the agent takes and
// gives them (internal to rpc/, rref/ and dist_autograd/; users call the
// templates of rpc.h and rref.h).
//
// Installed, in namespace detail, only because those templates expand in
// the user's translation unit: rpcAsync<fn>() builds a CallSpec and
// decodes a Reply there, and Agent::call() takes one. Nothing here is API:
// it may change with any release. What rref/ and dist_autograd/ add to a
// call (an RRef to keep the result in, a distributed-autograd context)
// travels as an extension's payload (rpc/extension.h, not installed).

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/core/deadline.h>

namespace trellis::rpc::detail {

// What a request carries besides its arguments.
struct CallSpec {
  // Registered name and signature fingerprint (registry.h).
  std::string_view function;
  uint64_t signature = 0;
  // Unset: the agent's default timeout. Zero: none.
  std::optional<Duration> timeout;
  // An extension's part of the request: its wire id (extension.h) and the
  // bytes the callee's extension of that id reads. 0: none.
  uint32_t extension = 0;
  std::string extensionPayload;
  // Join the calling thread's distributed-autograd context, if any (user
  // calls). Protocol messages (RRef bookkeeping, backward, cleanup) set
  // false.
  bool recordAutograd = true;
  // The reply future is completed on the transport loop thread, which
  // saves a thread hop: for a caller that blocks on it with no callback
  // (rpcSync), and for the library's own calls whose callbacks are short
  // and never block (gradients sent by a backward, context releases,
  // DistributedOptimizer's step, remote()'s confirmation). Never set it
  // for a future users can chain on.
  bool completeOnLoop = false;
  // No reply (envelope field one_way): the callee runs the function and
  // sends nothing back, so neither side wakes for an answer. The future
  // completes once the message is written (or fails when it cannot be);
  // the function's result is dropped and its error is logged on the
  // callee. For the library's notifications whose answer nobody reads
  // (a distributed-autograd context's release); never inside a context.
  bool oneWay = false;
};

// A reply's encoded result, decoded by the caller's template.
struct Reply {
  std::vector<uint8_t> bytes;
  std::vector<at::Tensor> tensors;
  int32_t from = -1;
  // Set when the callee recorded a send function for the result's tensors.
  uint64_t autogradContextId = 0;
  uint64_t autogradMessageId = 0;
};

}  // namespace trellis::rpc::detail
