#include <c10/util/StringUtil.h>

#include <trellis/dist_autograd/messages.h>

namespace trellis::dist_autograd::detail {

std::string contextName(uint64_t id) {
  return "context " + std::to_string(id >> kCounterBits) + ":" +
         std::to_string(id & kCounterMask);
}

Error checkContextId(uint64_t id, int32_t worldSize) {
  if ((id >> kCounterBits) >= static_cast<uint64_t>(worldSize)) {
    return Error::protocol("distributed-autograd " + contextName(id) +
                           " names a creator outside the group of " +
                           std::to_string(worldSize) + " workers");
  }
  return Error();
}

Error checkGradients(const SentTensors& sent,
                     const std::vector<at::Tensor>& grads) {
  if (grads.size() != sent.sizes.size()) {
    return Error::invalidArgument(
        std::to_string(grads.size()) + " gradients for a message that sent " +
        std::to_string(sent.sizes.size()) + " tensors requiring grad");
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    if (!g.defined()) {
      continue;
    }
    if (g.sizes() != at::IntArrayRef(sent.sizes[i]) ||
        g.scalar_type() != sent.dtypes[i] || g.is_sparse()) {
      return Error::invalidArgument(
          "gradient " + std::to_string(i) + " has shape " +
          c10::str(g.sizes()) + " and dtype " +
          std::string(c10::toString(g.scalar_type())) +
          ", the tensor sent had " +
          c10::str(at::IntArrayRef(sent.sizes[i])) + " and " +
          std::string(c10::toString(sent.dtypes[i])));
    }
  }
  return Error();
}

}  // namespace trellis::dist_autograd::detail
