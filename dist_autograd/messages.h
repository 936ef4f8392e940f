#pragma once

// What a peer's distributed-autograd messages claim, checked before they
// touch a context (docs/dist_autograd.md), internal to dist_autograd/ and
// its fuzz target: pure functions, no agent, no engine.

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <string>
#include <vector>

#include <trellis/core/error.h>

namespace trellis::dist_autograd::detail {

// A context id is (creating worker << 48) | counter.
constexpr uint64_t kCounterBits = 48;
constexpr uint64_t kCounterMask = (uint64_t{1} << kCounterBits) - 1;

// "context 2:17"
std::string contextName(uint64_t id);

// A context id from a peer: its creator must be a worker of the group.
// DATA_LOSS naming the id otherwise.
Error checkContextId(uint64_t id, int32_t worldSize);

// What one message sent that required grad, kept by its send function.
struct SentTensors {
  std::vector<std::vector<int64_t>> sizes;
  std::vector<at::ScalarType> dtypes;
};

// The gradients that came back for that message: one per tensor sent, each
// undefined or dense with the sent tensor's shape and dtype.
// InvalidArgument naming the first that is not.
Error checkGradients(const SentTensors& sent,
                     const std::vector<at::Tensor>& grads);

}  // namespace trellis::dist_autograd::detail
