// The c10d rendezvous round, one node's state machine at a time, over an
// in-process HashStore with a made-up clock: joining, the last call, MAX
// closing at once, the waiting list, a stale round, dead members, the
// restart budget, and records that are garbage or from another job.

#include <chrono>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/elastic/rendezvous.h>
#include <trellis/store/hash_store.h>

namespace {

using namespace std::chrono_literals;
using trellis::elastic::decodeRoundRecord;
using trellis::elastic::encodeRoundRecord;
using trellis::elastic::kRoundKey;
using trellis::elastic::Liveness;
using trellis::elastic::nextRound;
using trellis::elastic::RdzvClock;
using trellis::elastic::RoundJoin;
using trellis::elastic::RoundNode;
using trellis::elastic::RoundParams;
using trellis::elastic::RoundPhase;
using trellis::elastic::RoundRecord;
using State = RoundJoin::State;

RoundParams params(int32_t min, int32_t max, int32_t nproc = 2) {
  RoundParams p;
  p.runId = "job7";
  p.nproc = nproc;
  p.minNodes = min;
  p.maxNodes = max;
  p.lastCall = 1s;
  p.maxRestarts = 2;
  return p;
}

// One node: its join machine and the set of nodes it believes dead.
struct Node {
  Node(trellis::store::Store& store, RoundParams p, const std::string& id)
      : join(store, std::move(p), RoundNode{id, "10.0.0." + id.substr(1)},
             [this](const std::string& other) {
               return dead.count(other) != 0;
             }) {}
  std::set<std::string> dead;
  RoundJoin join;
};

RoundRecord stored(trellis::store::Store& store) {
  RoundRecord r;
  EXPECT_TRUE(decodeRoundRecord(store.getString(kRoundKey), &r).ok());
  return r;
}

const RdzvClock::time_point t0{};

TEST(RendezvousRecord, RoundTripsAndNamesTheKeyOfGarbage) {
  RoundRecord r;
  r.runId = "job7";
  r.nproc = 4;
  r.round = 12;
  r.phase = RoundPhase::kClosed;
  r.restarts = 3;
  r.participants = {{"h1:10:ab", "10.0.0.1"}, {"h2:11:cd", "::1"}};
  r.waiting = {"h3:12:ef"};
  r.note = "node x stopped heartbeating";
  RoundRecord back;
  ASSERT_TRUE(decodeRoundRecord(encodeRoundRecord(r), &back).ok());
  EXPECT_EQ(back, r);

  for (const std::string& bad :
       {std::string(""), std::string("hello\n"),
        encodeRoundRecord(r).substr(0, 40), encodeRoundRecord(r) + "round 3\n",
        encodeRoundRecord(r) + "node h1:10:ab 10.0.0.9\n",
        encodeRoundRecord(r) + "bogus 1\n",
        std::string("trellis-rdzv-round 1\nrun a\nnproc 0\nround 0\nphase "
                    "joining\nrestarts 0\nnote x\n"),
        std::string("trellis-rdzv-round 1\nrun a\nnproc 1\nround -1\nphase "
                    "joining\nrestarts 0\nnote x\n"),
        std::string("trellis-rdzv-round 1\nrun a\nnproc 1\nround 0\nphase "
                    "closed\nrestarts 0\nnote x\n")}) {
    RoundRecord out;
    const trellis::Error e = decodeRoundRecord(bad, &out);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.message().find("'trellis/rdzv/round'"), std::string::npos)
        << e.message();
  }
  // Names that would break the line format are refused when encoding.
  RoundRecord spaced = r;
  spaced.participants[0].addr = "10.0.0.1 x";
  EXPECT_THROW((void)encodeRoundRecord(spaced), trellis::InvalidArgumentError);
}

TEST(RendezvousRound, MinJoinedClosesAfterTheLastCall) {
  trellis::store::HashStore store(1s);
  Node a(store, params(2, 3), "a1");
  Node b(store, params(2, 3), "b2");
  EXPECT_EQ(a.join.step(t0), State::kJoined);
  EXPECT_EQ(a.join.step(t0 + 5s), State::kJoined);  // alone: below MIN
  EXPECT_EQ(b.join.step(t0 + 5s), State::kJoined);  // MIN: last call starts
  EXPECT_EQ(stored(store).phase, RoundPhase::kJoining);
  EXPECT_EQ(a.join.step(t0 + 5s + 500ms), State::kJoined);
  EXPECT_EQ(a.join.step(t0 + 6s + 600ms), State::kReady);  // its last call
  EXPECT_EQ(b.join.step(t0 + 6s + 600ms), State::kReady);
  const RoundRecord r = stored(store);
  EXPECT_EQ(r.phase, RoundPhase::kClosed);
  EXPECT_EQ(r.round, 0);
  ASSERT_EQ(r.participants.size(), 2u);
  EXPECT_EQ(a.join.groupRank(), 0);
  EXPECT_EQ(b.join.groupRank(), 1);
  EXPECT_EQ(r.participants[1].addr, "10.0.0.2");
}

TEST(RendezvousRound, MaxJoinedClosesAtOnce) {
  trellis::store::HashStore store(1s);
  Node a(store, params(1, 2), "a1");
  Node b(store, params(1, 2), "b2");
  EXPECT_EQ(a.join.step(t0), State::kJoined);
  EXPECT_EQ(b.join.step(t0), State::kReady);  // the MAXth closes it
  EXPECT_EQ(stored(store).phase, RoundPhase::kClosed);
  EXPECT_EQ(a.join.step(t0), State::kReady);  // no last call needed
}

TEST(RendezvousRound, ALatecomerWaitsAndTheNextRoundTakesIt) {
  trellis::store::HashStore store(1s);
  Node a(store, params(1, 3), "a1");
  Node b(store, params(1, 3), "b2");
  Node c(store, params(1, 3), "c3");
  EXPECT_EQ(a.join.step(t0), State::kJoined);
  EXPECT_EQ(b.join.step(t0), State::kJoined);
  EXPECT_EQ(a.join.step(t0 + 2s), State::kReady);
  EXPECT_EQ(c.join.step(t0 + 2s), State::kWaiting);
  EXPECT_EQ(c.join.step(t0 + 3s), State::kWaiting);  // stays, once
  RoundRecord r = stored(store);
  ASSERT_EQ(r.waiting.size(), 1u);
  EXPECT_EQ(r.waiting[0], "c3");
  // A running node opens the next round for it (scale up: not a restart).
  store.set(kRoundKey,
            encodeRoundRecord(nextRound(r, params(1, 3), false, "scale up")));
  EXPECT_EQ(c.join.step(t0 + 4s), State::kJoined);
  r = stored(store);
  EXPECT_EQ(r.round, 1);
  EXPECT_EQ(r.restarts, 0);
  EXPECT_TRUE(r.waiting.empty());
  ASSERT_EQ(r.participants.size(), 1u);
  EXPECT_EQ(r.participants[0].id, "c3");
}

TEST(RendezvousRound, AStaleClosedRoundIsReplacedByItsObserver) {
  trellis::store::HashStore store(1s);
  Node a(store, params(1, 2), "a1");
  EXPECT_EQ(a.join.step(t0), State::kJoined);
  EXPECT_EQ(a.join.step(t0 + 2s), State::kReady);
  // a's agent is gone (its heartbeat stopped); c comes and finds the round.
  Node c(store, params(1, 2), "c3");
  c.dead.insert("a1");
  EXPECT_EQ(c.join.step(t0 + 10s), State::kStart);  // opened round 1
  RoundRecord r = stored(store);
  EXPECT_EQ(r.round, 1);
  EXPECT_EQ(r.restarts, 1);  // a death counts
  EXPECT_NE(r.note.find("a1 stopped heartbeating"), std::string::npos);
  EXPECT_EQ(c.join.step(t0 + 10s), State::kJoined);
}

TEST(RendezvousRound, ADeadMemberIsStruckFromAnOpenRound) {
  trellis::store::HashStore store(1s);
  Node a(store, params(2, 3), "a1");
  Node b(store, params(2, 3), "b2");
  EXPECT_EQ(a.join.step(t0), State::kJoined);
  EXPECT_EQ(b.join.step(t0), State::kJoined);
  b.dead.insert("a1");
  EXPECT_EQ(b.join.step(t0 + 1s), State::kJoined);
  const RoundRecord r = stored(store);
  ASSERT_EQ(r.participants.size(), 1u);
  EXPECT_EQ(r.participants[0].id, "b2");
  // Below MIN again: no last call runs.
  EXPECT_EQ(b.join.step(t0 + 30s), State::kJoined);
}

TEST(RendezvousRound, TheSpentBudgetFailsTheJobForEveryone) {
  trellis::store::HashStore store(1s);
  RoundParams p = params(1, 1);
  p.maxRestarts = 1;
  Node a(store, p, "a1");
  EXPECT_EQ(a.join.step(t0), State::kReady);
  RoundRecord r = stored(store);
  RoundRecord once = nextRound(r, p, true, "rank 1 exited with code 3");
  EXPECT_EQ(once.phase, RoundPhase::kJoining);
  EXPECT_EQ(once.restarts, 1);
  RoundRecord twice = nextRound(once, p, true, "rank 1 exited with code 3");
  EXPECT_EQ(twice.phase, RoundPhase::kFailed);
  EXPECT_NE(twice.note.find("--max-restarts 1"), std::string::npos);
  store.set(kRoundKey, encodeRoundRecord(twice));
  Node b(store, p, "b2");
  EXPECT_EQ(b.join.step(t0), State::kJobFailed);
}

TEST(RendezvousRound, GarbageAndMismatchesAreNamed) {
  trellis::store::HashStore store(1s);
  store.set(kRoundKey, std::string_view("not a record"));
  Node a(store, params(1, 2), "a1");
  try {
    (void)a.join.step(t0);
    FAIL() << "garbage accepted";
  } catch (const trellis::ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("trellis/rdzv/round"),
              std::string::npos)
        << e.what();
  }

  trellis::store::HashStore good(1s);
  Node first(good, params(1, 2, 2), "a1");
  EXPECT_EQ(first.join.step(t0), State::kJoined);
  Node wrongNproc(good, params(1, 2, 4), "b2");
  try {
    (void)wrongNproc.join.step(t0);
    FAIL() << "a different --nproc-per-node joined";
  } catch (const trellis::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "--nproc-per-node 4 does not match the job's 2"),
              std::string::npos)
        << e.what();
  }
  RoundParams other = params(1, 2, 2);
  other.runId = "job8";
  Node wrongRun(good, other, "c3");
  try {
    (void)wrongRun.join.step(t0);
    FAIL() << "a different --rdzv-id joined";
  } catch (const trellis::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "--rdzv-id 'job8' does not match run 'job7'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(stored(good).participants.size(), 1u);
}

TEST(RendezvousLiveness, ACounterThatStopsMovingIsDeadAfterTheBound) {
  Liveness live(3s);
  live.note("a", 1, t0);
  EXPECT_FALSE(live.dead("a", t0 + 2s));
  live.note("a", 2, t0 + 2s);  // moved: the clock restarts
  EXPECT_FALSE(live.dead("a", t0 + 4s));
  live.note("a", 2, t0 + 4s);
  EXPECT_FALSE(live.dead("a", t0 + 5s));
  EXPECT_TRUE(live.dead("a", t0 + 5s + 1ms));
  EXPECT_FALSE(live.dead("never-seen", t0 + 100s));
  // Absent keys (-1) count as first seen, then not moving.
  live.note("b", -1, t0);
  EXPECT_TRUE(live.dead("b", t0 + 4s));
}

TEST(RendezvousLiveness, ObserveReadsHeartbeatKeys) {
  trellis::store::HashStore store(1s);
  Liveness live(1s);
  (void)store.add(trellis::elastic::heartbeatKey("a"), 1);
  live.observe(store, {"a", "b"}, t0);
  (void)store.add(trellis::elastic::heartbeatKey("a"), 1);
  live.observe(store, {"a", "b"}, t0 + 1500ms);
  EXPECT_FALSE(live.dead("a", t0 + 2s));
  EXPECT_TRUE(live.dead("b", t0 + 2s));
}

// Every key present: one check and one multiGet for all of them (the
// batched path); each counter is still judged on its own.
TEST(RendezvousLiveness, ObserveReadsAllCountersAtOnce) {
  trellis::store::HashStore store(1s);
  Liveness live(1s);
  const auto ka = trellis::elastic::heartbeatKey("a");
  const auto kb = trellis::elastic::heartbeatKey("b");
  (void)store.add(ka, 1);
  (void)store.add(kb, 1);
  live.observe(store, {"a", "b"}, t0);
  (void)store.add(ka, 1);
  live.observe(store, {"a", "b"}, t0 + 1500ms);
  EXPECT_FALSE(live.dead("a", t0 + 2s));
  EXPECT_TRUE(live.dead("b", t0 + 2s));
  // A heartbeat that is not a counter is an error naming its key.
  store.set(kb, std::string_view("garbage"));
  try {
    live.observe(store, {"a", "b"}, t0 + 2s);
    FAIL() << "no exception";
  } catch (const trellis::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find(kb), std::string::npos) << e.what();
  }
}

}  // namespace
