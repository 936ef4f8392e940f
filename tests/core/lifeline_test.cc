#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

#include <trellis/core/lifeline.h>

namespace trellis {
namespace {

using namespace std::chrono_literals;

TEST(LifelineTest, RunsBodiesUntilCut) {
  Lifeline line;
  int ran = 0;
  EXPECT_TRUE(line.run([&] { ++ran; }));
  EXPECT_TRUE(line.run([&] { EXPECT_TRUE(line.run([&] { ++ran; })); }));
  EXPECT_EQ(ran, 2);
  EXPECT_FALSE(line.isCut());
  EXPECT_TRUE(line.cut(Deadline::after(1s)));
  EXPECT_TRUE(line.isCut());
  EXPECT_FALSE(line.run([&] { ++ran; }));
  EXPECT_EQ(ran, 2);
  EXPECT_TRUE(line.cut(Deadline::after(1s)));  // idempotent
}

TEST(LifelineTest, ABodyThatThrowsStillEndsItsRun) {
  Lifeline line;
  EXPECT_THROW(line.run([] { throw std::runtime_error("body"); }),
               std::runtime_error);
  EXPECT_TRUE(line.cut(Deadline::after(0ms)));
}

// cut() returns only once the body running on another thread has returned,
// and no body starts after it began.
TEST(LifelineTest, CutWaitsForTheBodyRunningNow) {
  Lifeline line;
  std::promise<void> entered;
  std::promise<void> letGo;
  std::atomic<bool> bodyDone{false};
  std::thread runner([&] {
    line.run([&] {
      entered.set_value();
      letGo.get_future().wait_for(10s);
      bodyDone = true;
    });
  });
  ASSERT_EQ(entered.get_future().wait_for(10s), std::future_status::ready);
  auto cut = std::async(std::launch::async, [&] {
    const bool ok = line.cut(Deadline::after(10s));
    return ok && bodyDone.load();
  });
  // Negative check: 100 ms for a wrong early return to show.
  EXPECT_EQ(cut.wait_for(100ms), std::future_status::timeout);
  EXPECT_FALSE(line.run([] {}));  // cut already refuses
  letGo.set_value();
  EXPECT_TRUE(cut.get());
  runner.join();
}

TEST(LifelineTest, CutGivesUpAtItsDeadline) {
  Lifeline line;
  std::promise<void> entered;
  std::promise<void> letGo;
  std::thread runner([&] {
    line.run([&] {
      entered.set_value();
      letGo.get_future().wait_for(10s);
    });
  });
  ASSERT_EQ(entered.get_future().wait_for(10s), std::future_status::ready);
  EXPECT_FALSE(line.cut(Deadline::after(20ms)));
  letGo.set_value();
  runner.join();
  EXPECT_TRUE(line.cut(Deadline::after(0ms)));
}

// A guarded callback outlives its owner's line: once cut it does nothing,
// and what it captured goes when it does.
TEST(LifelineTest, GuardedCallbackDoesNothingOnceCut) {
  auto line = std::make_shared<Lifeline>();
  auto captured = std::make_shared<int>(0);
  std::weak_ptr<int> weak = captured;
  std::function<void(int, const std::string&)> cb = Lifeline::guard(
      line,
      [captured](int n, const std::string& s) { *captured += n + s.size(); });
  captured.reset();
  cb(1, "ab");
  EXPECT_EQ(*weak.lock(), 3);
  EXPECT_TRUE(line->cut(Deadline::after(1s)));
  line.reset();
  cb(1, "ab");  // the callback holds the line: no use after free
  EXPECT_EQ(*weak.lock(), 3);
  cb = nullptr;
  EXPECT_TRUE(weak.expired());
}

}  // namespace
}  // namespace trellis
