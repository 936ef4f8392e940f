#pragma once

// The id of an RRef, and of each fork of it: (creator worker, a counter of
// that worker), unique in the group (docs/rref.md).

#include <cstdint>

namespace trellis::rpc {

struct RRefId {
  uint32_t worker = 0;
  uint64_t local = 0;
};

}  // namespace trellis::rpc
