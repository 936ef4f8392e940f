#pragma once

// BufferPool: large receive buffers, kept and reused (no libtorch; rpc/
// wraps them as tensors).
//
// Touching fresh pages runs at ~0.4 GB/s on these machines against ~20 GB/s
// for memory already mapped (DESIGN.md, "Facts about these machines"), and
// glibc hands any block above 32 MiB back to the kernel on free, so a
// receive path that allocates per message is page-fault bound. The pool
// keeps buffers per size class and hands them out again.
//
// Contract
//  - take(length) returns a buffer of at least `length` bytes (length >=
//    kMinPooledBytes; smaller buffers are the caller's business). Sizes are
//    rounded up to 1/8 of their power of two (at most 12.5% waste), so
//    similar sizes share a class.
//  - The buffer goes back to the pool when the last copy of the returned
//    shared_ptr dies, up to kMaxCachedBytes held in all; beyond that it is
//    freed. Buffers may outlive the pool (their deleters share the pool's
//    state).
//  - Buffers of 2 MiB and more are aligned to 2 MiB and advised onto
//    transparent huge pages (granted where THP is "always" or "madvise").
//  - Thread-safe. Throws std::bad_alloc when memory runs out.

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace trellis {

class BufferPool {
 public:
  static constexpr size_t kMinPooledBytes = size_t{1} << 20;
  static constexpr size_t kMaxCachedBytes = size_t{512} << 20;

  BufferPool() = default;
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  std::shared_ptr<void> take(size_t length);

  // The size class `length` is rounded up to (its buffer's capacity).
  static size_t sizeClass(size_t length);
  // Bytes held for reuse now (tests, monitoring).
  size_t cachedBytes() const;

 private:
  struct Shared {
    // Guards `free` and `cachedBytes`: the buffers kept for reuse.
    mutable std::mutex mu;
    std::map<size_t, std::vector<void*>> free;
    size_t cachedBytes = 0;
    void give(void* p, size_t cls);
    ~Shared();
  };
  // Shared with the deleters of buffers that may outlive the pool.
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

}  // namespace trellis
