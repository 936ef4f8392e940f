// BufferPool: size classes, reuse, the cache bound, buffers that outlive
// the pool.

#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/core/buffer_pool.h>

namespace trellis {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(BufferPoolTest, SizeClassesRoundUpByAnEighthOfThePowerOfTwo) {
  EXPECT_EQ(BufferPool::sizeClass(kMiB), kMiB);
  EXPECT_EQ(BufferPool::sizeClass(kMiB + 1), 2 * kMiB);  // step >= 1 MiB
  EXPECT_EQ(BufferPool::sizeClass(16 * kMiB), 16 * kMiB);
  EXPECT_EQ(BufferPool::sizeClass(16 * kMiB + 1), 18 * kMiB);
  for (size_t n : {kMiB, 3 * kMiB + 7, 100 * kMiB + 1, 513 * kMiB}) {
    const size_t cls = BufferPool::sizeClass(n);
    EXPECT_GE(cls, n);
    EXPECT_LE(cls - n, n / 8 + kMiB) << n;
  }
}

TEST(BufferPoolTest, AReleasedBufferIsHandedOutAgain) {
  BufferPool pool;
  void* first = nullptr;
  {
    auto b = pool.take(3 * kMiB);
    first = b.get();
    std::memset(b.get(), 1, 3 * kMiB);  // usable over its whole length
    EXPECT_EQ(pool.cachedBytes(), 0u);
  }
  EXPECT_EQ(pool.cachedBytes(), BufferPool::sizeClass(3 * kMiB));
  auto again = pool.take(3 * kMiB - 100);  // same class
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(pool.cachedBytes(), 0u);
}

TEST(BufferPoolTest, LargeBuffersAreAlignedToHugePages) {
  BufferPool pool;
  auto b = pool.take(4 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % (2 * kMiB), 0u);
}

TEST(BufferPoolTest, KeepsAtMostTheCacheBound) {
  BufferPool pool;
  const size_t each = 64 * kMiB;
  {
    std::vector<std::shared_ptr<void>> held;
    for (size_t i = 0; i < BufferPool::kMaxCachedBytes / each + 2; ++i) {
      held.push_back(pool.take(each));
    }
  }
  EXPECT_LE(pool.cachedBytes(), BufferPool::kMaxCachedBytes);
  EXPECT_EQ(pool.cachedBytes(), BufferPool::kMaxCachedBytes / each * each);
}

TEST(BufferPoolTest, BuffersMayOutliveThePool) {
  std::shared_ptr<void> b;
  {
    BufferPool pool;
    b = pool.take(2 * kMiB);
  }
  std::memset(b.get(), 2, 2 * kMiB);
  b.reset();  // returns to the pool's shared state, freed with it
}

}  // namespace
}  // namespace trellis
