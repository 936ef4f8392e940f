// Graceful shutdown's group protocol (rpc/quiescence.h) on a HashStore
// alone: workers are threads with scripted counts and probes, no agent.

#include "quiescence.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/store/hash_store.h>

using namespace std::chrono_literals;
namespace q = trellis::rpc::detail;
using trellis::Clock;
using trellis::Code;
using trellis::Deadline;
using trellis::Error;

namespace {

// A worker whose counts the test sets; waitIdle sleeps on a condition
// variable until the test makes it idle.
class FakeWorker : public q::QuiescenceParticipant {
 public:
  q::QuiescenceCounts counts() override {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  void waitIdle(Deadline deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(
        lock, deadline.isNever() ? Clock::now() + 1h : deadline.timePoint(),
        [&] { return counts_.active == 0; });
  }
  trellis::Future<void> probe(int32_t rank) override {
    ++probes_;
    return probeFn_ ? probeFn_(rank) : trellis::makeReadyFuture();
  }
  std::string describe(int32_t rank) override {
    return "worker 'w" + std::to_string(rank) + "' (rank " +
           std::to_string(rank) + ")";
  }

  void set(q::QuiescenceCounts c) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      counts_ = c;
    }
    cv_.notify_all();
  }
  void onProbe(std::function<trellis::Future<void>(int32_t)> fn) {
    probeFn_ = std::move(fn);
  }
  int probes() const { return probes_.load(); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  q::QuiescenceCounts counts_;
  std::function<trellis::Future<void>(int32_t)> probeFn_;
  std::atomic<int> probes_{0};
};

q::QuiescenceOptions options(int32_t rank, int32_t n) {
  q::QuiescenceOptions o;
  o.keyPrefix = "shutdown/";
  o.name = "w" + std::to_string(rank);
  o.rank = rank;
  o.worldSize = n;
  o.quiesceTimeout = 10s;
  o.probeInterval = 50ms;
  o.hostsStore = rank == 0;
  return o;
}

// Runs the protocol for `ranks` on threads; their errors, by rank.
struct Group {
  std::vector<std::thread> threads;
  std::vector<std::optional<Error>> results;
  std::vector<Clock::time_point> ended;
  Group(trellis::store::Store& store, std::vector<FakeWorker>& workers,
        std::vector<q::QuiescenceOptions> opts, std::vector<int32_t> ranks)
      : results(workers.size()), ended(workers.size()) {
    for (int32_t r : ranks) {
      threads.emplace_back([&, r, o = opts[r]] {
        Error e;
        try {
          q::runQuiescence(store, workers[r], o);
        } catch (...) {
          e = trellis::errorFromCurrentException();
        }
        results[r] = e;
        ended[r] = Clock::now();
      });
    }
  }
  void join() {
    for (auto& t : threads) {
      t.join();
    }
    threads.clear();
  }
  ~Group() { join(); }
};

std::vector<q::QuiescenceOptions> optionsFor(int32_t n) {
  std::vector<q::QuiescenceOptions> out;
  for (int32_t r = 0; r < n; ++r) {
    out.push_back(options(r, n));
  }
  return out;
}

TEST(Quiescence, IdleGroupFinishesAndCleansUpItsRounds) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(3);
  for (auto& x : w) {
    x.set({0, 5, 5});  // totals agree: 15 sent, 15 received
  }
  Group run(store, w, optionsFor(3), {0, 1, 2});
  run.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(run.results[r].has_value());
    EXPECT_TRUE(run.results[r]->ok()) << run.results[r]->what();
  }
  // Arrival keys and older rounds are gone: at most the last two rounds'
  // entries, the exit counter and its flag remain.
  EXPECT_LE(store.numKeys(), 3 * 2 + 2);
}

TEST(Quiescence, WaitsForMessagesInFlightToLand) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(2);
  w[0].set({1, 1, 0});  // a call out, not answered
  w[1].set({0, 0, 0});  // the request has not arrived yet
  Group run(store, w, optionsFor(2), {0, 1});
  // Negative check: 100 ms (two probe intervals) for a wrong early end to
  // show; nothing here can end it rightly.
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(run.results[0].has_value());
  EXPECT_FALSE(run.results[1].has_value());
  w[1].set({0, 1, 1});  // received and answered
  w[0].set({0, 1, 1});  // reply received
  run.join();
  EXPECT_TRUE(run.results[0]->ok()) << run.results[0]->what();
  EXPECT_TRUE(run.results[1]->ok()) << run.results[1]->what();
}

TEST(Quiescence, AWorkerThatIsGoneFailsTheOthersAtOnceNamingIt) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(3);
  for (int r = 0; r < 2; ++r) {
    w[r].onProbe([](int32_t rank) {
      return rank == 2 ? trellis::makeErrorFuture<void>(
                             Error::connection("connection refused"))
                       : trellis::makeReadyFuture();
    });
  }
  const auto start = Clock::now();
  Group run(store, w, optionsFor(3), {0, 1});  // w2 never comes
  run.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(run.results[r]->ok());
    EXPECT_EQ(run.results[r]->code(), Code::kUnavailable);
    const std::string what = run.results[r]->message();
    EXPECT_NE(what.find("worker 'w2' (rank 2) has not entered shutdown and "
                        "is gone: connection refused"),
              std::string::npos)
        << what;
    // Promptly: well before the store's 10 s timeout (a hang bound).
    EXPECT_LT(run.ended[r] - start, 5s);
  }
}

// The worker that hosts the store finds w2 gone first; w1's own probe of
// w2 has not come back yet. The host used to close the store at once, and
// w1 then failed with "store server closed the connection", naming nobody.
// Now the host publishes what it found and keeps the store up until w1 has
// read it; w1 fails with the same finding.
TEST(Quiescence, TheFirstWorkerToFindOneGoneTellsTheOthers) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(3);
  w[0].onProbe([](int32_t rank) {
    return rank == 2 ? trellis::makeErrorFuture<void>(
                           Error::connection("connection refused"))
                     : trellis::makeReadyFuture();
  });
  trellis::Promise<void> slow;  // w1's probe of w2: still out
  w[1].onProbe([&](int32_t rank) {
    return rank == 2 ? slow.getFuture() : trellis::makeReadyFuture();
  });
  const auto start = Clock::now();
  Group run(store, w, optionsFor(3), {0, 1});  // w2 never comes
  run.join();
  ASSERT_FALSE(run.results[1]->ok());
  EXPECT_EQ(run.results[1]->code(), Code::kUnavailable);
  EXPECT_EQ(run.results[1]->message(),
            "rpc shutdown of 'w1': worker 'w2' (rank 2) has not entered "
            "shutdown and is gone: connection refused (found by worker "
            "'w0')");
  EXPECT_EQ(run.results[0]->message(),
            "rpc shutdown of 'w0': worker 'w2' (rank 2) has not entered "
            "shutdown and is gone: connection refused");
  // The host returned only once w1 had read the verdict.
  EXPECT_TRUE(store.check({"shutdown/seen/1"}));
  EXPECT_LT(run.ended[1] - start, 5s);  // before the store's 10 s timeout
  slow.setError(Error::cancelled("test over"));
}

TEST(Quiescence, AWorkerThatDoesNotAnswerFailsTheOthersWithATimeout) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(2);
  trellis::Promise<void> hung;  // a probe answered late, with a timeout
  w[0].onProbe([&](int32_t) { return hung.getFuture(); });
  Group run(store, w, optionsFor(2), {0});
  // Negative check: while the probe is out, nothing may end the wait; 200
  // ms for a wrong early end to show.
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(run.results[0].has_value());
  hung.setError(Error::timeout("ping timed out after 1s"));
  run.join();
  EXPECT_EQ(run.results[0]->code(), Code::kDeadlineExceeded);
  EXPECT_NE(run.results[0]->message().find(
                "'w1' (rank 1) has not entered shutdown and does not answer"),
            std::string::npos)
      << run.results[0]->message();
  EXPECT_EQ(w[0].probes(), 1);  // one probe in flight at a time
}

TEST(Quiescence, ArrivalHasNoLimitWhileTheMissingWorkerAnswers) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(2);
  auto opts = optionsFor(2);
  Group first(store, w, opts, {0});
  // Several probes pass (counted, not guessed from a sleep); w1 answers
  // every one, and w0 keeps waiting.
  const auto until = Clock::now() + 10s;
  while (w[0].probes() < 3 && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_GE(w[0].probes(), 3);
  EXPECT_FALSE(first.results[0].has_value());
  Group second(store, w, opts, {1});
  first.join();
  second.join();
  EXPECT_TRUE(first.results[0]->ok()) << first.results[0]->what();
  EXPECT_TRUE(second.results[1]->ok()) << second.results[1]->what();
}

TEST(Quiescence, ArrivalTimeoutNamesTheWorkersThatNeverCame) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(4);
  auto opts = optionsFor(4);
  for (auto& o : opts) {
    o.arrivalTimeout = 300ms;
  }
  Group run(store, w, opts, {0, 2});
  run.join();
  for (int r : {0, 2}) {
    EXPECT_EQ(run.results[r]->code(), Code::kDeadlineExceeded);
    const std::string what = run.results[r]->message();
    EXPECT_NE(what.find("not every worker entered shutdown within 300ms"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("missing: worker 'w1' (rank 1), worker 'w3' (rank 3)"),
              std::string::npos)
        << what;
  }
}

TEST(Quiescence, BusyWorkerAtTheDeadlineIsNamed) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(2);
  auto opts = optionsFor(2);
  for (auto& o : opts) {
    o.quiesceTimeout = 300ms;
  }
  w[1].set({2, 7, 5});  // two calls that never end
  Group run(store, w, opts, {0, 1});
  run.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(run.results[r]->code(), Code::kDeadlineExceeded);
    EXPECT_NE(run.results[r]->message().find("did not become idle within"),
              std::string::npos)
        << run.results[r]->message();
  }
  // w0 saw w1's round entry before w1's deadline stopped it publishing.
  EXPECT_NE(run.results[0]->message().find(
                "calls still in flight on worker 'w1' (rank 1) (2)"),
            std::string::npos)
      << run.results[0]->message();
}

TEST(Quiescence, WorkerThatStopsTakingPartIsNamed) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(3);
  auto opts = optionsFor(3);
  for (auto& o : opts) {
    o.quiesceTimeout = 300ms;
  }
  // w2 arrives (its key is there) and then never publishes a round: it
  // died after entering shutdown.
  store.set("shutdown/0/2", std::string_view("arrived"));
  Group run(store, w, opts, {0, 1});
  run.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(run.results[r]->code(), Code::kDeadlineExceeded);
    EXPECT_NE(run.results[r]->message().find(
                  "no longer taking part: worker 'w2' (rank 2)"),
              std::string::npos)
        << run.results[r]->message();
  }
}

TEST(Quiescence, MalformedRoundEntryIsAProtocolErrorNamingTheWorker) {
  trellis::store::HashStore store(10s);
  std::vector<FakeWorker> w(2);
  store.set("shutdown/0/1", std::string_view("arrived"));
  store.set("shutdown/1/1", std::string_view("1 2 -3"));
  Group run(store, w, optionsFor(2), {0});
  run.join();
  EXPECT_EQ(run.results[0]->code(), Code::kDataLoss);
  EXPECT_NE(run.results[0]->message().find(
                "malformed round entry of worker 'w1' (rank 1)"),
            std::string::npos)
      << run.results[0]->message();
}

}  // namespace
