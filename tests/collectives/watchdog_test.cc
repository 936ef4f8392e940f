// The watchdog, the flight recorder and the culprit analysis, without
// libtorch: a fake backend whose ops the test starts and ends by hand, and
// the other ranks' progress reports written into a HashStore directly.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <trellis/collectives/flight_recorder.h>
#include <trellis/collectives/flight_report.h>
#include <trellis/collectives/progress.h>
#include <trellis/collectives/watchdog.h>
#include <trellis/core/text.h>
#include <trellis/store/hash_store.h>

namespace trellis::collectives::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

Fingerprint fp(uint64_t seq, OpType op = OpType::kAllreduce,
               uint64_t count = 1024) {
  return {seq, op, DType::kFloat32, ReduceOp::kSum, -1, count};
}

int64_t nowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------
// FlightRecorder

TEST(FlightRecorder, RingKeepsTheLastEntriesWithTheirStates) {
  FlightRecorder r(3);
  const int64_t shape[] = {4, 256};
  std::vector<uint64_t> ids;
  for (uint64_t s = 1; s <= 5; ++s) {
    ids.push_back(r.scheduled(fp(s), -1, 0, shape));
  }
  r.started(ids[0]);
  r.finished(ids[0], Error());
  r.started(ids[1]);
  r.finished(ids[1], Error::connection("rank 2 closed the connection"));
  r.started(ids[2]);
  const auto entries = r.entries();
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].fp.seq, 3u);
  EXPECT_EQ(entries[0].state, OpState::kStarted);
  EXPECT_EQ(entries[1].fp.seq, 4u);
  EXPECT_EQ(entries[1].state, OpState::kScheduled);
  EXPECT_EQ(entries[2].fp.seq, 5u);
  EXPECT_EQ(entries[2].ndim, 2);
  EXPECT_EQ(entries[2].shape[1], 256);
  const Progress p = r.progress();
  EXPECT_EQ(p.startedSeq, 3u);
  EXPECT_EQ(p.completedSeq, 1u);
  EXPECT_TRUE(p.failed);
  EXPECT_EQ(p.started.toString(), "seq 3 allreduce(float32[1024], sum)");
}

TEST(FlightRecorder, AnOpEvictedFromTheRingStillTimesOut) {
  FlightRecorder r(2);
  const uint64_t stuck = r.scheduled(fp(1), -1, 0, {});
  r.started(stuck);
  for (uint64_t s = 2; s <= 10; ++s) {
    (void)r.scheduled(fp(s), -1, 0, {});
  }
  EXPECT_FALSE(r.startedBefore(Clock::now() - 1h).has_value());
  auto late = r.startedBefore(Clock::now() + 1ms);
  ASSERT_TRUE(late.has_value());
  EXPECT_EQ(late->fp.seq, 1u);
  r.finished(stuck, Error());
  EXPECT_FALSE(r.startedBefore(Clock::now() + 1ms).has_value());
  // Capacity 0 records nothing but still tracks what runs.
  FlightRecorder none(0);
  const uint64_t id = none.scheduled(fp(1), -1, 0, {});
  none.started(id);
  EXPECT_TRUE(none.entries().empty());
  EXPECT_TRUE(none.startedBefore(Clock::now() + 1ms).has_value());
}

TEST(FlightRecorder, PointToPointOpsAreDescribedByPeerAndTag) {
  FlightEntry e;
  e.fp = fp(0, OpType::kSend, 4);
  e.peer = 1;
  e.tag = 7;
  EXPECT_EQ(e.describe(), "send(float32[4], to rank 1, tag 7)");
  e.fp.op = OpType::kRecv;
  e.peer = -1;
  EXPECT_EQ(e.describe(), "recv(float32[4], from any rank, tag 7)");
}

TEST(FlightRecorder, DumpIsJsonWithEveryFieldAndWallClockTimes) {
  FlightRecorder r(10);
  const int64_t shape[] = {1024};
  const uint64_t a = r.scheduled(fp(1), -1, 0, shape);
  r.started(a);
  r.finished(a, Error());
  const uint64_t b = r.scheduled(fp(2, OpType::kBroadcast), -1, 0, shape);
  r.started(b);
  r.finished(b, Error::timeout("bad \xff bytes"));
  const auto dir = std::filesystem::temp_directory_path() /
                   ("trellis-fr-" + std::to_string(getpid()));
  trellis::removeTree(dir);
  GroupInfo g{"default", "default#1", "cpu", 1, 4, 2000ms};
  std::string path;
  ASSERT_TRUE(
      writeDump((dir / "sub").string(), g, r.entries(), "why", &path).ok());
  EXPECT_EQ(path, (dir / "sub" / "default.1-rank1.json").string());
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["group"], "default");
  EXPECT_EQ(j["rank"], 1);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["reason"], "why");
  ASSERT_EQ(j["entries"].size(), 2u);
  const auto& e = j["entries"][1];
  EXPECT_EQ(e["seq"], 2);
  EXPECT_EQ(e["op"], "broadcast");
  EXPECT_EQ(e["state"], "failed");
  EXPECT_EQ(e["shape"], nlohmann::json::array({1024}));
  EXPECT_TRUE(e["error"].is_string());
  const int64_t started = e["started_us"];
  EXPECT_LT(std::abs(started - nowUs()), 60'000'000);
  EXPECT_TRUE(j["entries"][0]["error"].is_null());
  // No temporary file is left behind; a directory that cannot be made is
  // an error naming it.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "sub"),
                          std::filesystem::directory_iterator()),
            1);
  Error err = writeDump("/proc/no/such/dir", g, r.entries(), "why", &path);
  EXPECT_FALSE(err.ok());
  EXPECT_NE(err.message().find("/proc/no/such/dir"), std::string::npos)
      << err.what();
  trellis::removeTree(dir);
}

// ---------------------------------------------------------------------------
// Progress reports and the culprit analysis

RankReport report(uint64_t started, uint64_t completed, int64_t ageMs = 0,
                  const std::string& desc = "") {
  Progress p;
  p.startedSeq = started;
  p.completedSeq = completed;
  p.started = fp(started);
  std::string text = encodeProgress(p, 3, nowUs() - ageMs * 1000);
  RankReport r = decodeProgress(text);
  if (!desc.empty()) {
    r.startedDescription = desc;
  }
  return r;
}

TEST(Progress, RoundTripsAndRejectsEveryMalformedField) {
  Progress p;
  p.startedSeq = 42;
  p.completedSeq = 41;
  p.failed = true;
  p.started = fp(42);
  const RankReport r = decodeProgress(encodeProgress(p, 9, 123456));
  ASSERT_EQ(r.kind, RankReport::Kind::kValid) << r.problem;
  EXPECT_EQ(r.beat, 9u);
  EXPECT_EQ(r.wallUs, 123456);
  EXPECT_EQ(r.startedSeq, 42u);
  EXPECT_EQ(r.completedSeq, 41u);
  EXPECT_TRUE(r.failed);
  EXPECT_EQ(r.startedDescription, "seq 42 allreduce(float32[1024], sum)");
  const std::pair<std::string, std::string> bad[] = {
      {"", "description line"},
      {"hello 1 1 1 1 1 0\n", "does not start"},
      {"trellis-progress 2 1 1 1 1 0\n", "unknown version"},
      {"trellis-progress 1 x 1 1 1 0\n", "bad beat"},
      {"trellis-progress 1 1 1 -1 1 0\n", "bad started seq"},
      {"trellis-progress 1 1 1 1 99999999999999999999999 0\n",
       "bad completed seq"},
      {"trellis-progress 1 1 1 1 1 2\n", "bad failed flag"},
      {"trellis-progress 1 1 1 1 1\n", "bad failed flag"},
      {"trellis-progress 1 1 1 1 1 0 7\n", "trailing"},
      {"trellis-progress 1 1 1 1 1 0\nbad\x01", "control character"},
      {"trellis-progress 1 1 1 1 1 0\n" + std::string(600, 'x'),
       "description over"},
      {std::string(2000, 'x'), "bytes (at most"},
  };
  for (const auto& [text, problem] : bad) {
    const RankReport m = decodeProgress(text);
    EXPECT_EQ(m.kind, RankReport::Kind::kMalformed) << text;
    EXPECT_NE(m.problem.find(problem), std::string::npos)
        << text << " -> " << m.problem;
  }
}

TEST(Progress, RankListsCollapseRuns) {
  EXPECT_EQ(rankList({}), "");
  EXPECT_EQ(rankList({3}), "3");
  EXPECT_EQ(rankList({2, 0, 1, 5, 7, 8}), "0-2, 5, 7-8");
}

const std::string kStuck = "seq 5 allreduce(float32[1024], sum)";

TEST(Analysis, ARankThatNeverEnteredIsTheCulprit) {
  std::vector<RankReport> r = {report(5, 4), report(5, 4),
                               report(4, 4, 0, "seq 4 barrier()")};
  const Analysis a = analyse(5, kStuck, 0, r, nowUs(), 1000ms);
  EXPECT_EQ(a.culprits, std::vector<int>{2});
  EXPECT_EQ(a.behindButAlive, std::vector<int>{2});
  EXPECT_EQ(a.summary,
            "likely culprit: rank 2; rank 2 never entered seq 5; it last "
            "started seq 4 barrier(), which completed; ranks 0-1 wait in " +
                kStuck);
}

TEST(Analysis, ARankInsideTheOpThatStoppedReportingIsTheCulprit) {
  std::vector<RankReport> r = {report(5, 4), report(5, 4, 5000), report(5, 4)};
  const Analysis a = analyse(5, kStuck, 0, r, nowUs(), 1000ms);
  EXPECT_EQ(a.culprits, std::vector<int>{1});
  EXPECT_TRUE(a.behindButAlive.empty());
  EXPECT_NE(a.summary.find("likely culprit: rank 1; rank 1 stopped reporting "
                           "50"),
            std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("ms ago, so it is stopped, hung or dead (last "
                           "report: in " +
                           kStuck + ")"),
            std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("ranks 0, 2 wait in"), std::string::npos)
      << a.summary;
}

TEST(Analysis, EveryRankInsideAndReportingBlamesTheOpItself) {
  std::vector<RankReport> r = {report(5, 4), report(5, 4)};
  const Analysis a = analyse(5, kStuck, 1, r, nowUs(), 1000ms);
  EXPECT_TRUE(a.culprits.empty());
  EXPECT_NE(a.summary.find("no rank is missing"), std::string::npos)
      << a.summary;
}

TEST(Analysis, MissingMalformedAndFinishedRanksAreToldApart) {
  std::vector<RankReport> r(5);
  r[0] = report(5, 4);
  // r[1]: missing
  r[2] = decodeProgress("garbage");
  r[3] = report(6, 5, 0, "seq 6 barrier()");
  r[4] = report(0, 0);
  const Analysis a = analyse(5, kStuck, 0, r, nowUs(), 1000ms);
  EXPECT_EQ(a.culprits, (std::vector<int>{1, 4}));
  EXPECT_NE(a.summary.find("rank 1 published no progress"), std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("rank 4 never entered seq 5; it has started no "
                           "collective"),
            std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("rank 2 sent an unreadable progress report"),
            std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("rank 3 completed seq 5 (last started: seq 6 "
                           "barrier())"),
            std::string::npos)
      << a.summary;
  EXPECT_NE(a.summary.find("rank 0 waits in " + kStuck), std::string::npos)
      << a.summary;
}

// ---------------------------------------------------------------------------
// Reading dumps back and comparing ranks (trellis-flight-recorder)

// Rank `rank`'s dump after it ran `ops` (seq 1..n) with the last one in
// `lastState`.
Dump dumpOf(int rank, int size, std::vector<Fingerprint> ops,
            const std::string& lastState) {
  FlightRecorder r(100);
  for (size_t i = 0; i < ops.size(); ++i) {
    const uint64_t id = r.scheduled(ops[i], -1, 0, {});
    const bool last = i + 1 == ops.size();
    if (!last || lastState != "scheduled") {
      r.started(id);
    }
    if (!last || lastState == "completed") {
      r.finished(id, Error());
    } else if (lastState == "failed") {
      r.finished(id, Error::timeout("timed out"));
    }
  }
  GroupInfo g{"default", "default#1", "cpu", rank, size, 1000ms};
  Dump d;
  const Error e = parseDump(toJson(g, r.entries(), "test"), &d);
  EXPECT_TRUE(e.ok()) << e.what();
  d.source = "rank" + std::to_string(rank) + ".json";
  return d;
}

TEST(FlightReport, ParsesWhatTheRecorderWrites) {
  const Dump d = dumpOf(1, 3, {fp(1), fp(2, OpType::kBarrier)}, "started");
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.worldSize, 3);
  EXPECT_EQ(d.groupId, "default#1");
  ASSERT_EQ(d.entries.size(), 2u);
  EXPECT_EQ(d.entries[0].fingerprint(), "allreduce(float32[1024], sum)");
  EXPECT_EQ(d.entries[1].state, "started");
  EXPECT_TRUE(d.entries[1].startedUs.has_value());
  EXPECT_FALSE(d.entries[1].endedUs.has_value());
}

TEST(FlightReport, NamesTheRankThatNeverEnteredAndTheMissingFile) {
  const auto a = fp(1), b = fp(2, OpType::kBarrier), c = fp(3);
  const Report r = compareDumps({dumpOf(0, 4, {a, b, c}, "started"),
                                 dumpOf(1, 4, {a, b, c}, "started"),
                                 dumpOf(3, 4, {a, b}, "completed")});
  EXPECT_TRUE(r.problem);
  EXPECT_NE(r.text.find("no file from rank 2"), std::string::npos) << r.text;
  EXPECT_NE(r.text.find("first collective not entered by every rank: seq 3 "
                        "allreduce(float32[1024], sum); never entered by "
                        "rank 3 (rank 3 last recorded seq 2 barrier(), "
                        "completed)"),
            std::string::npos)
      << r.text;
  EXPECT_NE(r.text.find("likely culprit: rank 3"), std::string::npos) << r.text;
}

TEST(FlightReport, NamesBothSidesOfADisagreementAndAStuckCollective) {
  const auto a = fp(1);
  Fingerprint other = fp(2, OpType::kBroadcast);
  other.root = 1;
  const Report desync = compareDumps(
      {dumpOf(0, 2, {a, fp(2)}, "failed"), dumpOf(1, 2, {a, other}, "failed")});
  EXPECT_TRUE(desync.problem);
  EXPECT_NE(desync.text.find("first disagreement at seq 2: rank 0 called "
                             "allreduce(float32[1024], sum); rank 1 called "
                             "broadcast(float32[1024], root 1)"),
            std::string::npos)
      << desync.text;
  const Report stuck = compareDumps({dumpOf(0, 2, {a, fp(2)}, "started"),
                                     dumpOf(1, 2, {a, fp(2)}, "completed")});
  EXPECT_NE(stuck.text.find("did not complete everywhere: seq 2 "
                            "allreduce(float32[1024], sum): rank 0 started; "
                            "rank 1 completed"),
            std::string::npos)
      << stuck.text;
  const Report fine = compareDumps(
      {dumpOf(0, 2, {a}, "completed"), dumpOf(1, 2, {a}, "completed")});
  EXPECT_FALSE(fine.problem) << fine.text;
  EXPECT_NE(fine.text.find("completed seq 1 to 1"), std::string::npos);
}

TEST(FlightReport, MalformedDumpsAreRefusedNamingTheField) {
  const std::pair<std::string, std::string> bad[] = {
      {"{", "not valid JSON"},
      {"[]", "not a JSON object"},
      {R"({"version":2})", "version 2"},
      {R"({"version":1,"group":7})", "'group' must be a string"},
      {R"({"version":1,"group":"g","group_id":"g#1","backend":"cpu",
          "host":"h","reason":"r","world_size":2,"rank":2})",
       "'rank' must be in [0, 1]"},
      {R"({"version":1,"group":"g","group_id":"g#1","backend":"cpu",
          "host":"h","reason":"r","world_size":2,"rank":0,"pid":1,
          "entries":[{"id":1}]})",
       "entries[0]: field 'seq' is missing"},
      {R"({"version":1,"group":"g","group_id":"g#1","backend":"cpu",
          "host":"h","reason":"r","world_size":2,"rank":0,"pid":1,
          "entries":[{"id":1,"seq":1,"op":"x","dtype":"x","reduce_op":"x",
          "count":1,"root":-1,"peer":-1,"tag":0,"state":"lost"}]})",
       "'state' must be one of"},
  };
  for (const auto& [text, problem] : bad) {
    Dump d;
    const Error e = parseDump(text, &d);
    EXPECT_FALSE(e.ok()) << text;
    EXPECT_NE(e.message().find(problem), std::string::npos)
        << text << " -> " << e.message();
  }
}

// ---------------------------------------------------------------------------
// The watchdog over a fake backend

class FakeBackend final : public Backend {
 public:
  bool wantsCuda() const override { return false; }
  StreamJoin enqueue(OpSpec, Started, Done) override { return {}; }
  StreamJoin send(int, int64_t, DType, const void*, size_t, Placement,
                  Done) override {
    return {};
  }
  StreamJoin recv(int, int64_t, DType, void*, size_t, Placement,
                  SourceDone) override {
    return {};
  }
  Error poll() override {
    std::unique_lock<std::mutex> lock(mu_);
    ++polls_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !stall_; });
    return pollError_;
  }
  void abort(const Error& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(reason);
    cv_.notify_all();
  }

  void setPollError(Error e) {
    std::lock_guard<std::mutex> lock(mu_);
    pollError_ = std::move(e);
  }
  void stall(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    stall_ = on;
    cv_.notify_all();
  }
  // Waits (bounded) for the first abort and returns it.
  Error awaitAbort(std::chrono::milliseconds bound = 10s) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, bound, [&] { return !aborts_.empty(); })) {
      return Error();
    }
    return aborts_.front();
  }
  size_t aborts() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborts_.size();
  }
  void awaitPolls(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, 10s, [&] { return polls_ >= n; }));
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  Error pollError_;
  bool stall_ = false;
  int polls_ = 0;
  std::vector<Error> aborts_;
};

struct ExitCatcher {
  std::mutex mu;
  std::vector<int> codes;
  Watchdog::Hooks hooks() {
    return {[this](int code) {
      std::lock_guard<std::mutex> lock(mu);
      codes.push_back(code);
    }};
  }
  std::vector<int> get() {
    std::lock_guard<std::mutex> lock(mu);
    return codes;
  }
};

struct Harness {
  std::shared_ptr<store::HashStore> store =
      std::make_shared<store::HashStore>();
  std::shared_ptr<FakeBackend> backend = std::make_shared<FakeBackend>();
  std::shared_ptr<FlightRecorder> recorder =
      std::make_shared<FlightRecorder>(100);
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("trellis-wd-" + std::to_string(getpid()) + "-" +
                      std::to_string(reinterpret_cast<uintptr_t>(this))))
                        .string();

  WatchedGroup group(int rank, int size, std::chrono::milliseconds timeout,
                     WatchdogMode mode) {
    WatchedGroup g;
    g.info = {"default", "default#1", "cpu", rank, size, timeout};
    g.mode = mode;
    g.dumpDir = dir;
    g.store = store;
    g.backend = backend;
    g.recorder = recorder;
    return g;
  }
  ~Harness() { trellis::removeTree(dir); }
};

WatchdogConfig fastConfig() {
  WatchdogConfig c;
  c.interval = 20ms;
  c.heartbeatTimeout = 60s;
  c.storeTimeout = 2s;
  c.storeLinger = 100ms;
  return c;
}

TEST(Watchdog, TimeoutNamesTheRankThatNeverEnteredDumpsAndFailsTheGroup) {
  Harness h;
  ExitCatcher exits;
  Watchdog w(fastConfig(), exits.hooks());
  // Rank 1 reports from time to time and never entered seq 2; rank 2 is
  // in it with us.
  std::atomic<bool> stop{false};
  std::thread peers([&] {
    for (uint64_t beat = 1; !stop; ++beat) {
      Progress behind;
      behind.startedSeq = 1;
      behind.completedSeq = 1;
      behind.started = fp(1, OpType::kBarrier);
      h.store->set("progress/1", encodeProgress(behind, beat, nowUs()));
      Progress with;
      with.startedSeq = 2;
      with.completedSeq = 1;
      with.started = fp(2);
      h.store->set("progress/2", encodeProgress(with, beat, nowUs()));
      std::this_thread::sleep_for(10ms);  // a live rank's reporting pace
    }
  });
  const int64_t shape[] = {1024};
  const uint64_t done =
      h.recorder->scheduled(fp(1, OpType::kBarrier), -1, 0, {});
  h.recorder->started(done);
  h.recorder->finished(done, Error());
  const auto start = Clock::now();
  const uint64_t id = h.recorder->scheduled(fp(2), -1, 0, shape);
  h.recorder->started(id);
  auto handle = w.watch(h.group(0, 3, 300ms, WatchdogMode::kExit));
  const Error e = h.backend->awaitAbort();
  const auto took = Clock::now() - start;
  stop = true;
  peers.join();
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.code(), Code::kDeadlineExceeded);
  const std::string m = e.message();
  EXPECT_NE(m.find("seq 2 allreduce(float32[1024], sum) on group 'default' "
                   "timed out on rank 0"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("likely culprit: rank 1; rank 1 never entered seq 2; it "
                   "last started seq 1 barrier(), which completed"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("ranks 0, 2 wait in seq 2"), std::string::npos) << m;
  EXPECT_NE(m.find("[flight recorder: " + h.dir + "/default.1-rank0.json]"),
            std::string::npos)
      << m;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
  EXPECT_TRUE(std::filesystem::exists(h.dir + "/default.1-rank0.json"));
  // The other ranks learn of it through the store.
  EXPECT_EQ(h.store->getString("abort").rfind(
                "4 rank 0 gave up on the group: seq 2 allreduce", 0),
            0u)
      << h.store->getString("abort");
  // Exit mode ends the process once, with the documented code.
  const auto until = Clock::now() + 10s;
  while (exits.get().empty() && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(exits.get(), std::vector<int>{kWatchdogExitCode});
  EXPECT_EQ(h.backend->aborts(), 1u);
}

TEST(Watchdog, BackendErrorFailsTheGroupAndFailModeKeepsTheProcess) {
  Harness h;
  ExitCatcher exits;
  Watchdog w(fastConfig(), exits.hooks());
  auto handle = w.watch(h.group(1, 2, 60000ms, WatchdogMode::kFail));
  h.backend->awaitPolls(2);
  h.backend->setPollError(Error::connection("rank 0 closed the connection"));
  const Error e = h.backend->awaitAbort();
  EXPECT_NE(e.message().find("rank 0 closed the connection"), std::string::npos)
      << e.what();
  // The group is done with: no second abort; no exit in fail mode.
  std::this_thread::sleep_for(
      100ms);  // several ticks in which nothing may happen
  EXPECT_EQ(h.backend->aborts(), 1u);
  EXPECT_TRUE(exits.get().empty());
  EXPECT_TRUE(std::filesystem::exists(h.dir + "/default.1-rank1.json"));
}

TEST(Watchdog, AFailedGroupsStoreOutlivesTheGroupForTheLinger) {
  // Rank 0 under fromEnvironment() hosts the store in its group's store: a
  // program that drops the group as soon as wait() raises must not take the
  // store from the ranks still reading why.
  Harness h;
  WatchdogConfig c = fastConfig();
  c.storeLinger = 2s;  // long: the check right after the drop must not race it
  Watchdog w(c);
  std::weak_ptr<store::HashStore> weak = h.store;
  auto handle = w.watch(h.group(0, 2, 60000ms, WatchdogMode::kFail));
  h.backend->awaitPolls(2);
  // Taken before the failure: the hold runs from the failure on, so it
  // ends no sooner than the hold after this.
  const auto failed = Clock::now();
  h.backend->setPollError(Error::connection("rank 1 closed the connection"));
  ASSERT_FALSE(h.backend->awaitAbort().ok());
  handle.reset();
  h.store.reset();
  EXPECT_FALSE(weak.expired());
  // Released within a few ticks of the linger's end, not before.
  const auto until = failed + 10s;
  while (!weak.expired() && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(weak.expired());
  EXPECT_GE(Clock::now() - failed, 2s);
}

TEST(Watchdog, StopWaitsOutTheLingerThenLetsTheStoreGo) {
  Harness h;
  WatchdogConfig c = fastConfig();
  c.storeLinger = 300ms;
  std::weak_ptr<store::HashStore> weak = h.store;
  auto w = std::make_unique<Watchdog>(c);
  auto handle = w->watch(h.group(0, 2, 60000ms, WatchdogMode::kFail));
  const auto failed = Clock::now();  // before the failure, as above
  h.backend->setPollError(Error::connection("rank 1 closed the connection"));
  ASSERT_FALSE(h.backend->awaitAbort().ok());
  handle.reset();
  h.store.reset();
  w->stop();
  EXPECT_GE(Clock::now() - failed, 300ms);
  EXPECT_TRUE(weak.expired());
}

TEST(Watchdog, ARankInNoOpFailsWhenAnotherPublishedTheAbort) {
  Harness h;
  Watchdog w(fastConfig());
  const uint64_t id = h.recorder->scheduled(fp(1), -1, 0, {});
  h.recorder->started(id);
  h.recorder->finished(id, Error());
  auto handle = w.watch(h.group(2, 3, 60000ms, WatchdogMode::kFail));
  h.backend->awaitPolls(2);
  const RankReport r = decodeProgress(h.store->getString("progress/2"));
  ASSERT_EQ(r.kind, RankReport::Kind::kValid) << r.problem;
  EXPECT_EQ(r.completedSeq, 1u);
  h.store->set("abort", "4 rank 0 gave up on the group: seq 2 timed out");
  const Error e = h.backend->awaitAbort();
  EXPECT_EQ(e.code(), Code::kDeadlineExceeded) << e.what();
  EXPECT_EQ(e.message().rfind("group 'default': rank 0 gave up on the group: "
                              "seq 2 timed out",
                              0),
            0u)
      << e.what();
  const std::string path = h.dir + "/default.1-rank2.json";
  ASSERT_TRUE(std::filesystem::exists(path));
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in);
  EXPECT_NE(j["reason"].get<std::string>().find("rank 0 gave up"),
            std::string::npos);
}

TEST(Watchdog, AMalformedAbortValueStillFailsTheGroupAsAborted) {
  Harness h;
  Watchdog w(fastConfig());
  auto handle = w.watch(h.group(1, 2, 60000ms, WatchdogMode::kFail));
  h.store->set("abort", "99 \x01 garbage");
  const Error e = h.backend->awaitAbort();
  EXPECT_EQ(e.code(), Code::kAborted) << e.what();
  EXPECT_NE(e.message().find("garbage"), std::string::npos);
}

TEST(Watchdog, AStuckWatchdogIsReportedAsSuchNotAsAStuckCollective) {
  Harness h;
  ExitCatcher exits;
  WatchdogConfig c = fastConfig();
  c.heartbeatTimeout = 200ms;
  Watchdog w(c, exits.hooks());
  h.backend->stall(true);  // poll() blocks, as a hung driver call would
  auto handle = w.watch(h.group(0, 2, 60000ms, WatchdogMode::kExit));
  const auto until = Clock::now() + 10s;
  while (exits.get().empty() && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(exits.get(), std::vector<int>{kWatchdogStuckExitCode});
  const std::string report = w.stuckReport();
  EXPECT_NE(report.find("watchdog stuck for"), std::string::npos) << report;
  EXPECT_NE(report.find("in backend poll of group 'default'"),
            std::string::npos)
      << report;
  EXPECT_EQ(h.backend->aborts(), 0u);
  EXPECT_TRUE(std::filesystem::exists(h.dir + "/default.1-rank0.json"));
  h.backend->stall(false);
}

TEST(Watchdog, EnvironmentKnobsAreCheckedAndNamed) {
  setenv("TRELLIS_WATCHDOG_MODE", "sometimes", 1);
  try {
    (void)watchdogModeFromEnvironment();
    ADD_FAILURE() << "a bad mode must be refused";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("TRELLIS_WATCHDOG_MODE='sometimes'"),
              std::string::npos)
        << e.what();
  }
  setenv("TRELLIS_WATCHDOG_MODE", "fail", 1);
  EXPECT_EQ(watchdogModeFromEnvironment(), WatchdogMode::kFail);
  unsetenv("TRELLIS_WATCHDOG_MODE");
  EXPECT_EQ(watchdogModeFromEnvironment(), WatchdogMode::kExit);
  setenv("TRELLIS_WATCHDOG_INTERVAL_MS", "5", 1);
  EXPECT_THROW(WatchdogConfig::fromEnvironment(), InvalidArgumentError);
  setenv("TRELLIS_WATCHDOG_INTERVAL_MS", "250", 1);
  EXPECT_EQ(WatchdogConfig::fromEnvironment().interval, 250ms);
  unsetenv("TRELLIS_WATCHDOG_INTERVAL_MS");
  setenv("TRELLIS_FLIGHT_RECORDER_ENTRIES", "12x", 1);
  EXPECT_THROW(flightRecorderEntriesFromEnvironment(), InvalidArgumentError);
  unsetenv("TRELLIS_FLIGHT_RECORDER_ENTRIES");
  EXPECT_EQ(flightRecorderEntriesFromEnvironment(),
            FlightRecorder::kDefaultCapacity);
  setenv("TRELLIS_NCCL_BLOCKING_WAIT", "yes", 1);
  EXPECT_THROW((void)blockingWaitFromEnvironment(), InvalidArgumentError);
  setenv("TRELLIS_NCCL_BLOCKING_WAIT", "1", 1);
  EXPECT_TRUE(blockingWaitFromEnvironment());
  unsetenv("TRELLIS_NCCL_BLOCKING_WAIT");
  EXPECT_FALSE(blockingWaitFromEnvironment());
}

}  // namespace
}  // namespace trellis::collectives::detail
