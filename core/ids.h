#pragma once

// Short hierarchical object ids for logs: "agent.w3.pipe7".
//
// Each object that creates children owns an IdAllocator seeded with its own
// id; children take `alloc.next("pipe")`. Thread-safe.

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace trellis {

class IdAllocator {
 public:
  explicit IdAllocator(std::string parentId) : parent_(std::move(parentId)) {}
  // "<parent>.<kind><n>" with n counting from 0 per allocator.
  std::string next(std::string_view kind) {
    const uint64_t n = counter_.fetch_add(1, std::memory_order_relaxed);
    std::string id;
    id.reserve(parent_.size() + kind.size() + 8);
    if (!parent_.empty()) {
      id += parent_;
      id += '.';
    }
    id += kind;
    id += std::to_string(n);
    return id;
  }
  const std::string& parentId() const { return parent_; }

 private:
  const std::string parent_;
  std::atomic<uint64_t> counter_{0};
};

// A process-wide allocator for top-level objects ("ctx0", "store1", ...).
IdAllocator& rootIds();

}  // namespace trellis
