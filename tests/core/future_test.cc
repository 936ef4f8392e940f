#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <trellis/core/future.h>

namespace trellis {
namespace {

using namespace std::chrono_literals;

TEST(FutureTest, ValueAfterSet) {
  Promise<int> p;
  auto f = p.getFuture();
  EXPECT_FALSE(f.completed());
  EXPECT_TRUE(p.setValue(7));
  EXPECT_TRUE(f.completed());
  EXPECT_TRUE(f.hasValue());
  EXPECT_EQ(f.wait(), 7);
  EXPECT_EQ(f.value(), 7);
}

TEST(FutureTest, ErrorThrowsTypedException) {
  Promise<std::string> p;
  auto f = p.getFuture();
  p.setError(Error::connection("worker 'ps' died"));
  EXPECT_TRUE(f.hasError());
  EXPECT_EQ(f.error().code(), Code::kUnavailable);
  EXPECT_THROW(f.wait(), ConnectionError);
  EXPECT_THROW(f.value(), ConnectionError);
}

TEST(FutureTest, SecondCompletionIsIgnored) {
  Promise<int> p;
  EXPECT_TRUE(p.setValue(1));
  EXPECT_FALSE(p.setValue(2));
  EXPECT_FALSE(p.setError(Error::internal("late")));
  EXPECT_EQ(p.getFuture().value(), 1);
}

TEST(FutureTest, SetErrorWithOkErrorStillFails) {
  Promise<int> p;
  p.setError(Error());
  EXPECT_EQ(p.getFuture().error().code(), Code::kInternal);
}

TEST(FutureTest, WaitWithTimeoutThrowsTimeoutError) {
  Promise<int> p;
  auto f = p.getFuture();
  const auto start = Clock::now();
  try {
    f.wait(30ms);
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("not completed within 30ms"),
              std::string::npos)
        << e.what();
  }
  EXPECT_GE(Clock::now() - start, 30ms);
  EXPECT_FALSE(f.waitFor(1ms));
  EXPECT_THROW(f.wait(Deadline::after(5ms)), TimeoutError);
  p.setValue(3);
  EXPECT_TRUE(f.waitFor(0ms));
  EXPECT_EQ(f.wait(10ms), 3);
}

TEST(FutureTest, ValueBeforeCompletionIsAnError) {
  Promise<int> p;
  EXPECT_THROW(p.getFuture().value(), FailedPreconditionError);
}

TEST(FutureTest, WaitWakesWhenCompletedFromAnotherThread) {
  Promise<int> p;
  auto f = p.getFuture();
  std::thread t([p]() mutable {
    std::this_thread::sleep_for(10ms);
    p.setValue(42);
  });
  EXPECT_EQ(f.wait(5s), 42);
  t.join();
}

TEST(FutureTest, DroppedPromiseFailsTheFuture) {
  Future<int> f;
  {
    Promise<int> p;
    f = p.getFuture();
    Promise<int> copy = p;  // copies share ownership
  }
  ASSERT_TRUE(f.completed());
  EXPECT_THROW(f.wait(), CancelledError);
  EXPECT_NE(f.error().message().find("promise destroyed"), std::string::npos);
}

TEST(FutureTest, CopyOfPromiseKeepsItAlive) {
  Future<int> f;
  Promise<int> keep;
  {
    Promise<int> p;
    f = p.getFuture();
    keep = p;
  }
  EXPECT_FALSE(f.completed());
  keep.setValue(5);
  EXPECT_EQ(f.value(), 5);
}

// Promise copies are counted in the future's state (one allocation per
// promise): moves hand the count on, assignment gives up the old promise,
// and only the last copy of a promise that was never kept breaks it.
TEST(FutureTest, PromiseMovesAndAssignmentsCountCopiesExactly) {
  Promise<int> a;
  auto fa = a.getFuture();
  Promise<int> moved = std::move(a);  // `a` no longer owns a copy
  Promise<int> b;
  auto fb = b.getFuture();
  const Promise<int>& same = moved;
  moved = same;  // self-assignment keeps it
  EXPECT_FALSE(fa.completed());
  Promise<int> other = b;
  b = std::move(moved);  // b's old promise lives on in `other`
  EXPECT_FALSE(fb.completed());
  other = b;  // the last copy of fb's promise goes: broken
  ASSERT_TRUE(fb.completed());
  EXPECT_EQ(fb.error().code(), Code::kCancelled);
  EXPECT_FALSE(fa.completed());
  EXPECT_TRUE(other.setValue(3));
  EXPECT_EQ(fa.value(), 3);
  // A kept promise is not broken when its copies go.
  {
    Promise<int> kept = other;
    b = Promise<int>();
  }
  other = Promise<int>();
  EXPECT_EQ(fa.value(), 3);
}

TEST(FutureTest, LastOfManyCopiesDroppedOnManyThreadsBreaksItOnce) {
  for (int round = 0; round < 50; ++round) {
    std::vector<Promise<int>> copies(8);
    auto f = copies[0].getFuture();
    for (auto& c : copies) {
      c = copies[0];
    }
    std::atomic<int> calls{0};
    f.addDoneCallback([&](const Future<int>&) { ++calls; });
    EXPECT_FALSE(f.completed());
    std::vector<std::thread> threads;
    for (auto& c : copies) {
      threads.emplace_back(
          [c = std::move(c)]() mutable { Promise<int> gone = std::move(c); });
    }
    for (auto& t : threads) {
      t.join();
    }
    ASSERT_TRUE(f.completed());
    EXPECT_EQ(f.error().code(), Code::kCancelled);
    EXPECT_EQ(calls.load(), 1);
  }
}

TEST(FutureTest, CallbacksRunInTheOrderTheyWereAdded) {
  Promise<int> p;
  auto f = p.getFuture();
  std::vector<int> order;
  for (int i = 0; i < 5; ++i) {
    f.addDoneCallback([&order, i](const Future<int>&) { order.push_back(i); });
  }
  auto g = f.then([&order](int v) {
    order.push_back(5);
    return v;
  });
  p.setValue(1);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(g.value(), 1);
}

TEST(FutureTest, CallbackAfterCompletionRunsInline) {
  auto f = makeReadyFuture(9);
  int seen = 0;
  f.addDoneCallback([&](const Future<int>& done) { seen = done.value(); });
  EXPECT_EQ(seen, 9);
}

TEST(FutureTest, CallbackRunsOnceOnCompletingThreadNotUnderLock) {
  Promise<int> p;
  auto f = p.getFuture();
  std::atomic<int> calls{0};
  std::thread::id ranOn;
  f.addDoneCallback([&](const Future<int>& done) {
    ++calls;
    ranOn = std::this_thread::get_id();
    // Re-entering the same future from its callback must not deadlock.
    EXPECT_EQ(done.value(), 1);
    done.addDoneCallback([&](const Future<int>&) { ++calls; });
    EXPECT_TRUE(done.waitFor(0ms));
  });
  std::thread t([&] { p.setValue(1); });
  t.join();
  EXPECT_EQ(calls.load(), 2);
  EXPECT_NE(ranOn, std::this_thread::get_id());
}

TEST(FutureTest, ThrowingCallbackDoesNotStopOthers) {
  Promise<void> p;
  auto f = p.getFuture();
  int after = 0;
  f.addDoneCallback(
      [](const Future<void>&) { throw std::runtime_error("boom"); });
  f.addDoneCallback([&](const Future<void>&) { ++after; });
  EXPECT_TRUE(p.setValue());
  EXPECT_EQ(after, 1);
  EXPECT_NO_THROW(f.wait());
}

TEST(FutureTest, RacingCompletersAndCallbacksEachCallbackExactlyOnce) {
  for (int round = 0; round < 50; ++round) {
    Promise<int> p;
    auto f = p.getFuture();
    std::atomic<int> calls{0};
    std::atomic<int> wins{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
      threads.emplace_back([&, i]() mutable {
        for (int k = 0; k < 25; ++k) {
          f.addDoneCallback([&](const Future<int>&) { ++calls; });
        }
        if (i % 2 == 0 ? p.setValue(i) : p.setError(Error::internal("x"))) {
          ++wins;
        }
      });
    }
    for (auto& t : threads) {
      t.join();
    }
    EXPECT_EQ(wins.load(), 1);
    EXPECT_EQ(calls.load(), 100);
  }
}

TEST(FutureTest, ThenChainsValues) {
  Promise<int> p;
  auto f = p.getFuture()
               .then([](const int& v) { return v * 2; })
               .then([](const int& v) { return std::to_string(v); });
  p.setValue(21);
  EXPECT_EQ(f.wait(), "42");
}

TEST(FutureTest, ThenSkipsOnErrorAndPropagatesIt) {
  Promise<int> p;
  bool ran = false;
  auto f = p.getFuture().then([&](const int& v) {
    ran = true;
    return v;
  });
  p.setError(Error::timeout("rpc to 'ps' timed out"));
  EXPECT_FALSE(ran);
  EXPECT_THROW(f.wait(), TimeoutError);
  EXPECT_EQ(f.error().message(), "rpc to 'ps' timed out");
}

TEST(FutureTest, ThenExceptionBecomesError) {
  auto f = makeReadyFuture(1).then(
      [](const int&) -> int { throw std::invalid_argument("bad row"); });
  EXPECT_EQ(f.error().code(), Code::kUnknown);
  EXPECT_NE(f.error().message().find("bad row"), std::string::npos);
  auto g = makeReadyFuture(1).then([](const int&) -> int {
    throw NotFoundError(Error::notFound("no such key"));
  });
  EXPECT_THROW(g.wait(), NotFoundError);
}

// torch's Future.then passes the future: accepted too, and then the
// callback also runs on an error (and can recover from it).
TEST(FutureTest, ThenTakesTheFutureTorchStyle) {
  Promise<int> ok;
  auto doubled =
      ok.getFuture().then([](const Future<int>& f) { return f.value() * 2; });
  ok.setValue(21);
  EXPECT_EQ(doubled.wait(), 42);

  Promise<int> failed;
  auto recovered = failed.getFuture().then([](const Future<int>& f) {
    return f.hasError() ? std::string("fallback: ") + f.error().message()
                        : std::string("value");
  });
  failed.setError(Error::connection("ps gone"));
  EXPECT_EQ(recovered.wait(), "fallback: ps gone");

  Promise<int> rethrown;
  auto passed = rethrown.getFuture().then(
      [](const Future<int>& f) { return f.value() + 1; });
  rethrown.setError(Error::timeout("slow"));
  EXPECT_THROW(passed.wait(), TimeoutError);

  Promise<void> done;
  int seen = 0;
  auto v = done.getFuture().then(
      [&](const Future<void>& f) { seen = f.hasError() ? -1 : 1; });
  done.setValue();
  v.wait();
  EXPECT_EQ(seen, 1);
}

TEST(FutureTest, ThenFlattensReturnedFuture) {
  Promise<int> inner;
  auto f = makeReadyFuture(1).then([&](const int& v) {
    return inner.getFuture().then([v](const int& w) { return v + w; });
  });
  EXPECT_FALSE(f.completed());
  inner.setValue(10);
  EXPECT_EQ(f.wait(), 11);

  Promise<int> failing;
  auto g =
      makeReadyFuture(1).then([&](const int&) { return failing.getFuture(); });
  failing.setError(Error::connection("gone"));
  EXPECT_THROW(g.wait(), ConnectionError);
}

TEST(FutureTest, VoidFutures) {
  Promise<void> p;
  int steps = 0;
  auto f = p.getFuture().then([&] { ++steps; }).then([&] {
    ++steps;
    return 3;
  });
  p.setValue();
  EXPECT_EQ(f.wait(), 3);
  EXPECT_EQ(steps, 2);
  EXPECT_NO_THROW(makeReadyFuture().wait());
  EXPECT_THROW(makeErrorFuture<void>(Error::auth("no")).wait(), AuthError);
}

TEST(FutureTest, CollectAllNeverFailsAndKeepsOrder) {
  Promise<int> a, b, c;
  auto all = collectAll<int>({a.getFuture(), b.getFuture(), c.getFuture()});
  c.setValue(3);
  a.setError(Error::internal("a failed"));
  EXPECT_FALSE(all.completed());
  b.setValue(2);
  const auto& done = all.wait();
  ASSERT_EQ(done.size(), 3u);
  EXPECT_TRUE(done[0].hasError());
  EXPECT_EQ(done[1].value(), 2);
  EXPECT_EQ(done[2].value(), 3);
  EXPECT_TRUE(collectAll<int>({}).completed());
}

TEST(FutureTest, WaitAllReturnsValuesInOrder) {
  std::vector<Future<int>> futures;
  std::vector<Promise<int>> promises(5);
  for (auto& p : promises) {
    futures.push_back(p.getFuture());
  }
  std::thread t([&] {
    for (int i = 4; i >= 0; --i) {
      promises[i].setValue(i * 10);
    }
  });
  auto values = waitAll(futures, Deadline::after(5s));
  t.join();
  EXPECT_EQ(values, (std::vector<int>{0, 10, 20, 30, 40}));
}

TEST(FutureTest, WaitAllThrowsFirstErrorWithoutWaitingForTheRest) {
  Promise<int> slow, failing;
  std::vector<Future<int>> futures{slow.getFuture(), failing.getFuture()};
  failing.setError(Error::connection("worker 2 died"));
  EXPECT_THROW(waitAll(futures, Deadline::after(5s)), ConnectionError);
  EXPECT_FALSE(slow.completed());
}

TEST(FutureTest, WaitAllTimesOut) {
  Promise<void> never;
  std::vector<Future<void>> futures{never.getFuture(), makeReadyFuture()};
  EXPECT_THROW(waitAll(futures, Deadline::after(20ms)), TimeoutError);
}

}  // namespace
}  // namespace trellis
