#include <thread>

#include <gtest/gtest.h>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>

namespace trellis {
namespace {

using namespace std::chrono_literals;

TEST(DeadlineTest, Never) {
  const Deadline d = Deadline::never();
  EXPECT_TRUE(d.isNever());
  EXPECT_FALSE(d.expired());
  EXPECT_EQ(d.remaining(), Duration::max());
}

TEST(DeadlineTest, AfterExpires) {
  const Deadline d = Deadline::after(20ms);
  EXPECT_FALSE(d.expired());
  EXPECT_LE(d.remaining(), Duration(20ms));
  std::this_thread::sleep_for(30ms);
  EXPECT_TRUE(d.expired());
  EXPECT_EQ(d.remaining(), Duration::zero());
}

TEST(DeadlineTest, NonPositiveAfterIsExpired) {
  EXPECT_TRUE(Deadline::after(0ms).expired());
  EXPECT_TRUE(Deadline::after(-5ms).expired());
}

TEST(DeadlineTest, HugeAfterIsNever) {
  EXPECT_TRUE(Deadline::after(Duration::max()).isNever());
}

TEST(DeadlineTest, ZeroTimeoutMeansNoTimeout) {
  EXPECT_TRUE(Deadline::fromTimeout(0ms).isNever());
  EXPECT_FALSE(Deadline::fromTimeout(1s).isNever());
  EXPECT_THROW(Deadline::fromTimeout(-1ms), InvalidArgumentError);
}

TEST(DeadlineTest, Earliest) {
  const Deadline a = Deadline::after(1s);
  const Deadline b = Deadline::after(1h);
  EXPECT_EQ(earliest(a, b), a);
  EXPECT_EQ(earliest(Deadline::never(), b), b);
}

TEST(DeadlineTest, FormatDuration) {
  EXPECT_EQ(formatDuration(0ms), "none");
  EXPECT_EQ(formatDuration(250ms), "250ms");
  EXPECT_EQ(formatDuration(1500ms), "1.5s");
  EXPECT_EQ(formatDuration(20us), "20us");
  EXPECT_EQ(formatDuration(150s), "2m30s");
  EXPECT_EQ(formatDuration(Duration::max()), "forever");
}

}  // namespace
}  // namespace trellis
