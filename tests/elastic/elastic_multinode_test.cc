// elastic-run with several nodes over the c10d rendezvous, each node an
// agent process of its own: on 127.0.0.1, and in network namespaces this
// test creates (one per node, a veth into a bridge, an address each). The
// etcd rendezvous too, against a real etcd the test starts on loopback
// (etcd_server.h).
// Checked: ranks that are complete and consistent across nodes, a worker
// crash that restarts every node, a SIGKILLed agent whose peers go on
// without it (scale down), a latecomer taken by the next round (scale up),
// an unreachable endpoint, an endpoint no agent can bind, a SIGSTOPped host,
// a node with another --nproc-per-node, a partitioned node, SIGTERM to an
// agent still connecting. Every wait is bounded; the test ends only the
// processes it started (by pid) and removes its namespaces even when it
// fails.

#include <algorithm>
#include <arpa/inet.h>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <netinet/in.h>
#include <set>
#include <sstream>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "../netns_hosts.h"
#include "../port_reservation.h"
#include "../transport/peer_process.h"
#include "elastic_test_util.h"
#include "etcd_server.h"
#include <trellis/core/auth.h>
#include <trellis/core/text.h>
#include <trellis/elastic/agent.h>
#include <trellis/store/tcp_store.h>

using namespace std::chrono_literals;
using trellis::transport::testing::Child;
using trellis::transport::testing::spawnHelper;
using Clock = std::chrono::steady_clock;

using namespace trellis::elastic::testing;
using trellis::elastic::testing::EtcdServer;

namespace {

// Short timeouts so that every test takes seconds (docs/elastic.md,
// "--rdzv-conf"): a dead node is noticed within 2 s.
const std::string kConf =
    "join_timeout=20,last_call_timeout=1,read_timeout=10,"
    "keep_alive_interval=1,keep_alive_max_attempt=2,exit_barrier_timeout=20";

// One job: a folder its workers share, and its agents.
class Job {
 public:
  Job() {
    static int counter = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("trellis_elastic_mn_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++));
    std::filesystem::create_directories(dir_);
    secret_ = "multinode-test-token-" + std::to_string(::getpid()) +
              "-0123456789abcdef";
    token_ = "TRELLIS_JOB_TOKEN=" + secret_;
  }
  ~Job() {
    agents_.clear();  // SIGKILLs and reaps the agents still there
    trellis::removeTree(dir_);
  }

  // Starts agent `i` (its stderr in <dir>/agent<i>.err); `netns`, when
  // set, runs it inside that namespace.
  void start(int i, std::vector<std::string> flags,
             const std::vector<std::string>& workerArgs,
             const std::string& netns = "",
             const std::vector<std::string>& extraEnv = {}) {
    flags.push_back("--log-dir");
    flags.push_back(dir_ / ("logs" + std::to_string(i)));
    flags.push_back(ELASTIC_TEST_WORKER);
    flags.push_back("--dir");
    flags.push_back(dir_);
    flags.insert(flags.end(), workerArgs.begin(), workerArgs.end());
    std::string program = ELASTIC_RUN;
    if (!netns.empty()) {
      flags.insert(flags.begin(), {"netns", "exec", netns, ELASTIC_RUN});
      program = "/usr/sbin/ip";
    }
    if (agents_.size() <= static_cast<size_t>(i)) {
      agents_.resize(static_cast<size_t>(i) + 1);
    }
    std::vector<std::string> env = {"OMP_NUM_THREADS=1", token_};
    env.insert(env.end(), extraEnv.begin(), extraEnv.end());
    agents_[static_cast<size_t>(i)] =
        spawnHelper(program, flags, env, errPath(i));
  }
  int wait(int i, std::chrono::milliseconds bound = 40s) {
    return agents_[static_cast<size_t>(i)]->wait(
        static_cast<int>(bound.count()));
  }
  Child& agent(int i) { return *agents_[static_cast<size_t>(i)]; }
  std::string err(int i) const { return readFile(errPath(i)); }
  std::string allErr() const {
    std::string all;
    for (size_t i = 0; i < agents_.size(); ++i) {
      all +=
          "--- agent " + std::to_string(i) + ":\n" + err(static_cast<int>(i));
    }
    return all;
  }
  std::filesystem::path dir() const { return dir_; }
  const std::string& secret() const { return secret_; }
  // What --store wrote for `rank` of `restart` (empty when nothing).
  std::map<std::string, std::string> store(int rank, int restart) const {
    return readEnvFile(dir_ / ("store_" + std::to_string(rank) + "_" +
                               std::to_string(restart) + ".txt"));
  }
  std::map<std::string, std::string> env(int rank, int restart) const {
    return readEnvFile(dir_ / ("env_" + std::to_string(rank) + "_" +
                               std::to_string(restart) + ".txt"));
  }
  // Waits (bounded) until `rank` of `restart` has written its environment.
  bool waitEnv(int rank, int restart, std::chrono::milliseconds bound) const {
    const auto path = dir_ / ("env_" + std::to_string(rank) + "_" +
                              std::to_string(restart) + ".txt");
    const auto end = Clock::now() + bound;
    while (!std::filesystem::exists(path)) {
      if (Clock::now() >= end) {
        return false;
      }
      std::this_thread::sleep_for(20ms);
    }
    return true;
  }
  // A loopback port for this job's agents, reserved until the job ends
  // (tests/port_reservation.h: not one the kernel may hand to a test
  // running beside this one before the agents bind it), and the
  // rendezvous endpoint on it.
  uint16_t reservePort() {
    ports_.push_back(std::make_unique<trellis::testing::PortReservation>());
    return static_cast<uint16_t>(ports_.back()->port());
  }
  std::string loopback() {
    return "127.0.0.1:" + std::to_string(reservePort());
  }
  // Which agent hosts the store (said on its stderr), waiting for it.
  int host(int n, std::chrono::milliseconds bound = 10s) const {
    const auto end = Clock::now() + bound;
    while (Clock::now() < end) {
      for (int i = 0; i < n; ++i) {
        if (err(i).find("hosting the c10d rendezvous store") !=
            std::string::npos) {
          return i;
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }

 private:
  std::filesystem::path errPath(int i) const {
    return dir_ / ("agent" + std::to_string(i) + ".err");
  }
  std::filesystem::path dir_;
  std::string secret_;
  std::string token_;
  std::vector<std::unique_ptr<trellis::testing::PortReservation>> ports_;
  std::vector<std::unique_ptr<Child>> agents_;
};

std::vector<std::string> c10d(const std::string& endpoint,
                              const std::string& nnodes, int nproc,
                              const std::string& conf = kConf) {
  return {
      "--nnodes",           nnodes,  "--nproc-per-node", std::to_string(nproc),
      "--rdzv-backend",     "c10d",  "--rdzv-endpoint",  endpoint,
      "--rdzv-id",          "mnjob", "--rdzv-conf",      conf,
      "--monitor-interval", "0.05"};
}

// Every rank 0..nodes*nproc-1 of `restart` wrote an environment that
// agrees with the others'.
void expectConsistentRanks(const Job& job, int nodes, int nproc, int restart) {
  std::set<std::string> ports;
  std::set<std::string> addrs;
  for (int rank = 0; rank < nodes * nproc; ++rank) {
    const auto e = job.env(rank, restart);
    ASSERT_FALSE(e.empty())
        << "rank " << rank << " of restart " << restart << " wrote nothing\n"
        << job.allErr();
    EXPECT_EQ(e.at("RANK"), std::to_string(rank));
    EXPECT_EQ(e.at("LOCAL_RANK"), std::to_string(rank % nproc));
    EXPECT_EQ(e.at("GROUP_RANK"), std::to_string(rank / nproc));
    EXPECT_EQ(e.at("GROUP_WORLD_SIZE"), std::to_string(nodes));
    EXPECT_EQ(e.at("WORLD_SIZE"), std::to_string(nodes * nproc));
    EXPECT_EQ(e.at("LOCAL_WORLD_SIZE"), std::to_string(nproc));
    EXPECT_EQ(e.at("TORCHELASTIC_RUN_ID"), "mnjob");
    EXPECT_EQ(e.at("TORCHELASTIC_RESTART_COUNT"), std::to_string(restart));
    ports.insert(e.at("MASTER_PORT"));
    addrs.insert(e.at("MASTER_ADDR"));
  }
  EXPECT_EQ(ports.size(), 1u);
  EXPECT_EQ(addrs.size(), 1u);
}

// Starts agent i with the scenario's worker arguments (the flags, the
// backend and the host are the caller's).
using StartAgent =
    std::function<void(int agent, const std::vector<std::string>& worker)>;

// Three agents (2:3, one rank each) run; then the agent `pickVictim()`
// names is SIGKILLed. The other two go on in round 1 with 2 nodes within
// the heartbeat bound and a last call, exit 0, and the logs say `why`.
void killedAgentScenario(Job& job, const StartAgent& start,
                         const std::function<int()>& pickVictim,
                         const std::string& why) {
  for (int i = 0; i < 3; ++i) {
    start(i, {"--sleep-first-ms", "30000"});
  }
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(job.waitEnv(rank, 0, 20s)) << job.allErr();
  }
  const int victim = pickVictim();
  ASSERT_GE(victim, 0) << job.allErr();
  const auto killedAt = Clock::now();
  ASSERT_EQ(::kill(job.agent(victim).pid, SIGKILL), 0);  // ours, by pid
  job.wait(victim, 5s);
  ASSERT_TRUE(job.waitEnv(0, 1, 15s)) << job.allErr();
  ASSERT_TRUE(job.waitEnv(1, 1, 5s)) << job.allErr();
  EXPECT_LT(Clock::now() - killedAt, 12s);
  for (int i = 0; i < 3; ++i) {
    if (i != victim) {
      EXPECT_EQ(exitCode(job.wait(i, 20s)), 0) << job.allErr();
    }
  }
  expectConsistentRanks(job, 2, 1, 1);
  EXPECT_NE(job.allErr().find(why), std::string::npos) << job.allErr();
}

// Two agents (2:3) form a group of 2; a third comes later, waits for the
// next round, and that round (a scale up, not a restart) takes all three.
void latecomerScenario(Job& job, const StartAgent& start) {
  for (int i = 0; i < 2; ++i) {
    start(i, {"--sleep-ms", "2500"});
  }
  ASSERT_TRUE(job.waitEnv(1, 0, 20s)) << job.allErr();
  EXPECT_EQ(job.env(1, 0).at("WORLD_SIZE"), "2");
  start(2, {"--sleep-ms", "2500"});
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 3, 1, 0);
  EXPECT_NE(job.allErr().find("on its waiting list"), std::string::npos)
      << job.allErr();
  EXPECT_NE(job.allErr().find("(scale up)"), std::string::npos) << job.allErr();
}

TEST(ElasticMultiNode, ThreeNodesAgreeOnEveryRank) {
  Job job;
  const std::string ep = job.loopback();
  // MAX joined closes the round at once: the long last call never runs.
  const std::string conf =
      "join_timeout=20,last_call_timeout=30,keep_alive_interval=1";
  for (int i = 0; i < 3; ++i) {
    job.start(i, c10d(ep, "2:3", 2, conf), {"--sleep-ms", "200"});
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 20s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 3, 2, 0);
  EXPECT_EQ(job.env(0, 0).at("MASTER_ADDR"), "127.0.0.1");
  // One agent hosts; the two others could not bind the endpoint and say so
  // and why before they join its store. (The host may have said so too:
  // when agents lose the bind race together, one hosts on a later try.)
  int hosts = 0;
  for (int i = 0; i < 3; ++i) {
    if (job.err(i).find("hosting the c10d rendezvous store on " + ep) !=
        std::string::npos) {
      ++hosts;
      continue;
    }
    EXPECT_NE(job.err(i).find("cannot bind the c10d rendezvous endpoint here "
                              "(store server cannot listen on " +
                              ep +
                              ": Address already in use); joining the store "
                              "at " +
                              ep),
              std::string::npos)
        << job.err(i);
  }
  EXPECT_EQ(hosts, 1) << job.allErr();
}

// A loopback port bound, and not listened on, by this test: an agent's
// bind of it fails (the socket lacks SO_REUSEADDR) and a connect to it is
// refused, which is what agents see when they lose the bind race together.
class PortHolder {
 public:
  explicit PortHolder(uint16_t port)
      : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    bound_ = fd_ >= 0 &&
             ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~PortHolder() { release(); }
  PortHolder(const PortHolder&) = delete;
  PortHolder& operator=(const PortHolder&) = delete;
  bool bound() const { return bound_; }
  void release() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_;
  bool bound_ = false;
};

// No agent can bind the endpoint, and nobody answers there: each says it
// could not bind and tries to join. Once the port is free, one of them
// hosts it on a later try and the round forms, long before join_timeout
// (20 s). Agents that only waited to join, as they did before, waited the
// whole join_timeout for a store nobody hosted, and failed; CI saw exactly
// that when two agents lost the bind race together (c10d_rendezvous.cc,
// hostOrJoin).
TEST(ElasticMultiNode, AnEndpointNobodyCouldBindIsHostedOnceItIsFree) {
  Job job;
  const uint16_t port = job.reservePort();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  PortHolder holder(port);
  ASSERT_TRUE(holder.bound()) << "port " << port;
  for (int i = 0; i < 2; ++i) {
    job.start(i, c10d(ep, "2", 1), {"--sleep-ms", "200"});
  }
  const auto said = [&] {
    for (int i = 0; i < 2; ++i) {
      if (job.err(i).find("cannot bind the c10d rendezvous endpoint here") ==
          std::string::npos) {
        return false;
      }
    }
    return true;
  };
  const auto end = Clock::now() + 10s;
  while (!said() && Clock::now() < end) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(said()) << job.allErr();
  std::this_thread::sleep_for(1s);  // a few tries to join, refused
  holder.release();
  const auto freed = Clock::now();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  EXPECT_LT(Clock::now() - freed, 15s) << job.allErr();
  expectConsistentRanks(job, 2, 1, 0);
  const int host = job.host(2);
  ASSERT_GE(host, 0) << job.allErr();
  EXPECT_NE(job.err(host).find("hosting the c10d rendezvous store on " + ep +
                               " (try "),
            std::string::npos)
      << job.allErr();
  EXPECT_NE(job.err(host).find(": nobody answered there before)"),
            std::string::npos)
      << job.allErr();
}

TEST(ElasticMultiNode, AWorkerCrashRestartsEveryNode) {
  Job job;
  const std::string ep = job.loopback();
  auto flags = c10d(ep, "2", 2);
  flags.insert(flags.end(), {"--max-restarts", "1"});
  // --store: the workers meet before rank 3 fails, so every node has
  // started its group (with the agents' store, group rank 1 no longer waits
  // for group rank 0 to publish a master, and could fail round 0 before
  // node 0 has seen it close).
  for (int i = 0; i < 2; ++i) {
    job.start(i, flags,
              {"--store", "--fail-rank", "3", "--fail-restart", "0",
               "--sleep-first-ms", "3000"});
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 2, 2, 1);
  const std::string all = job.allErr();
  EXPECT_NE(all.find("restarting the worker group (restart 1"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("a new rendezvous round opened; stopping the workers"),
            std::string::npos)
      << all;
}

TEST(ElasticMultiNode, TheBudgetSpentOnOneNodeFailsEveryNode) {
  Job job;
  const std::string ep = job.loopback();
  for (int i = 0; i < 2; ++i) {
    job.start(i, c10d(ep, "2", 1), {"--fail-rank", "1", "--sleep-ms", "3000"});
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 1) << job.allErr();
  }
  const std::string all = job.allErr();
  EXPECT_NE(all.find("the job failed"), std::string::npos) << all;
}

TEST(ElasticMultiNode, AKilledAgentIsDroppedAndTheOthersGoOn) {
  Job job;
  auto flags = c10d(job.loopback(), "2:3", 1,
                    "join_timeout=20,last_call_timeout=1,read_timeout=10,"
                    "keep_alive_interval=1,keep_alive_max_attempt=2");
  flags.insert(flags.end(), {"--max-restarts", "1"});
  killedAgentScenario(
      job, [&](int i, const auto& worker) { job.start(i, flags, worker); },
      [&] {
        // Not the store's host: losing it ends the job (docs/elastic.md).
        const int host = job.host(3);
        return host < 0 ? -1 : (host + 1) % 3;
      },
      "sent no heartbeat");
}

// shared/USERS.md 6: a round survives an agent that restarts. The new
// agent (a new node id) waits until its old self is found dead, and the
// next round takes all three again.
TEST(ElasticMultiNode, AnAgentThatRestartsRejoinsTheJob) {
  Job job;
  const std::string ep = job.loopback();
  auto flags = c10d(ep, "2:3", 1);
  flags.insert(flags.end(), {"--max-restarts", "1"});
  const std::vector<std::string> worker = {"--sleep-first-ms", "30000"};
  for (int i = 0; i < 3; ++i) {
    job.start(i, flags, worker);
  }
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(job.waitEnv(rank, 0, 20s)) << job.allErr();
  }
  const int host = job.host(3);
  ASSERT_GE(host, 0) << job.allErr();
  const int victim = (host + 2) % 3;
  ASSERT_EQ(::kill(job.agent(victim).pid, SIGKILL), 0);  // ours, by pid
  job.wait(victim, 5s);
  job.start(victim, flags, worker);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 3, 1, 1);
}

// The port stays held: trying to host and to join again ends at
// join_timeout, and the error names both failures.
TEST(ElasticMultiNode, AnEndpointHeldThroughoutIsNamedAtTheJoinTimeout) {
  Job job;
  const uint16_t port = job.reservePort();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  PortHolder holder(port);
  ASSERT_TRUE(holder.bound()) << "port " << port;
  const auto start = Clock::now();
  job.start(0, c10d(ep, "2", 1, "join_timeout=2"), {});
  EXPECT_EQ(exitCode(job.wait(0, 15s)), 1) << job.err(0);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(
      job.err(0).find("cannot reach the c10d rendezvous endpoint " + ep +
                      " (--rdzv-endpoint) within join_timeout 2s; last try: "),
      std::string::npos)
      << job.err(0);
  EXPECT_NE(job.err(0).find("Connection refused; hosting it here failed too: "
                            "store server cannot listen on " +
                            ep + ": Address already in use"),
            std::string::npos)
      << job.err(0);
}

// The host agent is SIGSTOPped: its port takes connections but never
// answers the handshake, and cannot be bound either. A second agent ends
// at its join_timeout naming both, instead of hanging.
TEST(ElasticMultiNode, AStoppedHostIsNamedAtTheJoinTimeout) {
  Job job;
  const std::string ep = job.loopback();
  job.start(0, c10d(ep, "2", 1, "join_timeout=30"), {});
  ASSERT_EQ(job.host(1), 0) << job.allErr();
  ASSERT_EQ(::kill(job.agent(0).pid, SIGSTOP), 0);  // ours, by pid
  const auto start = Clock::now();
  job.start(1, c10d(ep, "2", 1, "join_timeout=3"), {});
  EXPECT_EQ(exitCode(job.wait(1, 15s)), 1) << job.err(1);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(job.err(1).find("within join_timeout 3s; last try: "),
            std::string::npos)
      << job.err(1);
  EXPECT_NE(job.err(1).find("store handshake: waiting for store server " + ep +
                            " timed out; hosting it here failed too: store "
                            "server cannot listen on " +
                            ep + ": Address already in use"),
            std::string::npos)
      << job.err(1);
  ::kill(job.agent(0).pid, SIGCONT);  // the Job then SIGKILLs it
}

TEST(ElasticMultiNode, ALatecomerIsTakenByTheNextRound) {
  Job job;
  const auto flags = c10d(job.loopback(), "2:3", 1);
  latecomerScenario(
      job, [&](int i, const auto& worker) { job.start(i, flags, worker); });
}

TEST(ElasticMultiNode, AnUnreachableEndpointIsNamedWithinTheJoinTimeout) {
  Job job;
  const std::string ep = job.loopback();  // nobody listens there
  const auto start = Clock::now();
  job.start(0, c10d(ep, "2", 1, "join_timeout=1,is_host=false"), {});
  EXPECT_EQ(exitCode(job.wait(0, 15s)), 1) << job.err(0);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(job.err(0).find("cannot reach the c10d rendezvous endpoint " + ep +
                            " (--rdzv-endpoint) within join_timeout 1s"),
            std::string::npos)
      << job.err(0);
}

TEST(ElasticMultiNode, ANodeWithAnotherNprocIsRefusedByName) {
  Job job;
  const std::string ep = job.loopback();
  job.start(0, c10d(ep, "2", 2, "join_timeout=10"), {});
  ASSERT_EQ(job.host(1), 0) << job.allErr();
  job.start(1, c10d(ep, "2", 3, "join_timeout=10"), {});
  EXPECT_EQ(exitCode(job.wait(1, 15s)), 2) << job.err(1);
  EXPECT_NE(job.err(1).find("--nproc-per-node 3 does not match the job's 2"),
            std::string::npos)
      << job.err(1);
}

TEST(ElasticMultiNode, GarbageInTheRoundRecordIsNamed) {
  Job job;
  const uint16_t port = job.reservePort();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  job.start(0, c10d(ep, "2", 1, "join_timeout=20"), {});
  ASSERT_EQ(job.host(1), 0) << job.allErr();
  // Another client of the store (it knows the token) writes junk.
  trellis::store::TCPStoreOptions o;
  o.port = port;
  o.timeout = 5s;
  o.jobToken = trellis::auth::JobToken::fromString(job.secret());
  trellis::store::TCPStore store(o);
  store.set("trellis/rdzv/round", std::string_view("round 7\nphase ???\n"));
  EXPECT_EQ(exitCode(job.wait(0, 15s)), 1) << job.err(0);
  EXPECT_NE(job.err(0).find("rendezvous record 'trellis/rdzv/round' is not "
                            "valid: line 1 is not 'trellis-rdzv-round 1': "
                            "not a round record"),
            std::string::npos)
      << job.err(0);
}

// ---- The workers' store: the agents' (TORCHELASTIC_USE_AGENT_STORE) ---------

// c10d: the workers use the rendezvous store itself, every rank a client
// (rank 0 serves nothing), under /worker/attempt_<N>/round_<R>; a worker
// crash restarts the group and the store, hosted by an agent, survives it.
TEST(ElasticMultiNode, WorkersUseTheAgentStoreWhichSurvivesARestart) {
  Job job;
  const std::string ep = job.loopback();
  auto flags = c10d(ep, "2", 2);
  flags.insert(flags.end(), {"--max-restarts", "1"});
  for (int i = 0; i < 2; ++i) {
    job.start(i, flags, {"--store", "--fail-rank", "3", "--fail-restart", "0"});
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 40s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 2, 2, 1);
  const std::string port = ep.substr(ep.rfind(':') + 1);
  for (int restart = 0; restart < 2; ++restart) {
    for (int rank = 0; rank < 4; ++rank) {
      const auto e = job.env(rank, restart);
      ASSERT_FALSE(e.empty()) << rank << "/" << restart << job.allErr();
      EXPECT_EQ(e.at("TORCHELASTIC_USE_AGENT_STORE"), "True");
      EXPECT_EQ(e.at("MASTER_ADDR"), "127.0.0.1");
      EXPECT_EQ(e.at("MASTER_PORT"), port);  // the rendezvous endpoint
      const auto st = job.store(rank, restart);
      ASSERT_FALSE(st.empty()) << rank << "/" << restart << job.allErr();
      EXPECT_EQ(st.at("agent"), "1");
      EXPECT_EQ(st.at("server"), "0");  // rank 0 too: the agent serves
      EXPECT_EQ(st.at("seen"), "4");
      EXPECT_EQ(st.at("prefix"), "/worker/attempt_" + std::to_string(restart) +
                                     "/round_" + std::to_string(restart));
    }
  }
  // Attempt 1 sees an empty prefix of its own, and attempt 0's mark where
  // attempt 0 left it: one store across the restart.
  EXPECT_EQ(job.store(0, 0).at("fresh"), "1");
  EXPECT_EQ(job.store(0, 1).at("fresh"), "1");
  EXPECT_EQ(job.store(0, 1).at("survived"), "attempt 0");
  EXPECT_NE(job.allErr().find("(the rendezvous store, shared with the "
                              "workers)"),
            std::string::npos)
      << job.allErr();
}

// torchrun's opt-out: rank 0 serves the workers' store, as with static and
// etcd, and the workers meet there.
TEST(ElasticMultiNode, TorchsOptOutMakesRankZeroServeTheWorkersStore) {
  Job job;
  const std::string ep = job.loopback();
  for (int i = 0; i < 2; ++i) {
    job.start(i, c10d(ep, "2", 2), {"--store"}, "",
              {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"});
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 2, 2, 0);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(job.env(rank, 0).at("TORCHELASTIC_USE_AGENT_STORE"), "False");
    const auto st = job.store(rank, 0);
    ASSERT_FALSE(st.empty()) << rank << job.allErr();
    EXPECT_EQ(st.at("agent"), "0");
    EXPECT_EQ(st.at("server"), rank == 0 ? "1" : "0");
    EXPECT_EQ(st.at("prefix"), "");
    EXPECT_EQ(st.at("seen"), "4");
  }
  EXPECT_NE(job.err(0).find("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
            std::string::npos)
      << job.allErr();
}

// ---- The static rendezvous of several nodes ---------------------------------

std::vector<std::string> staticNode(uint16_t port, int nodeRank, int nproc,
                                    const std::string& conf = kConf) {
  return {"--rdzv-backend",     "static",
          "--nnodes",           "2",
          "--node-rank",        std::to_string(nodeRank),
          "--master-addr",      "127.0.0.1",
          "--master-port",      std::to_string(port),
          "--nproc-per-node",   std::to_string(nproc),
          "--rdzv-id",          "mnjob",
          "--rdzv-conf",        conf,
          "--monitor-interval", "0.05",
          "--max-restarts",     "1"};
}

// Two agents on this host, --node-rank 0 and 1, form one world of four
// ranks: group ranks are the node ranks (whoever joins first), node rank 0
// hosts the agents' store at --master-addr:--master-port, the workers'
// rank 0 serves theirs on another port, and a worker crash on node 1
// restarts both nodes.
TEST(ElasticMultiNode, StaticTwoNodesFormOneWorldAndRestartTogether) {
  Job job;
  const uint16_t port = job.reservePort();
  // Node rank 1 first: it waits for node rank 0's store.
  for (int node : {1, 0}) {
    job.start(node, staticNode(port, node, 2),
              {"--store", "--fail-rank", "3", "--fail-restart", "0",
               "--sleep-first-ms", "2000"});
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 40s)), 0) << job.allErr();
  }
  for (int restart = 0; restart < 2; ++restart) {
    expectConsistentRanks(job, 2, 2, restart);
    for (int rank = 0; rank < 4; ++rank) {
      const auto e = job.env(rank, restart);
      ASSERT_FALSE(e.empty()) << job.allErr();
      // The worker ran under the agent of its node rank (its log folder).
      EXPECT_NE(e.at("TORCHELASTIC_ERROR_FILE")
                    .find("/logs" + std::to_string(rank / 2) + "/"),
                std::string::npos)
          << rank << ": " << e.at("TORCHELASTIC_ERROR_FILE");
      EXPECT_EQ(e.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
      EXPECT_EQ(e.at("MASTER_ADDR"), "127.0.0.1");
      EXPECT_NE(e.at("MASTER_PORT"), std::to_string(port));
      const auto st = job.store(rank, restart);
      ASSERT_FALSE(st.empty()) << rank << "/" << restart << job.allErr();
      EXPECT_EQ(st.at("server"), rank == 0 ? "1" : "0");
      EXPECT_EQ(st.at("seen"), "4");
    }
  }
  EXPECT_NE(job.err(0).find("hosting the static rendezvous store on "
                            "127.0.0.1:" +
                            std::to_string(port)),
            std::string::npos)
      << job.allErr();
  EXPECT_NE(job.allErr().find("a new rendezvous round opened; stopping the "
                              "workers"),
            std::string::npos)
      << job.allErr();
}

// A second node with a --node-rank already taken is refused by name (exit
// status 2); the job of the other two goes on.
TEST(ElasticMultiNode, StaticNodeRankTakenTwiceIsRefused) {
  Job job;
  const uint16_t port = job.reservePort();
  job.start(0, staticNode(port, 0, 1), {"--sleep-ms", "1500"});
  job.start(1, staticNode(port, 1, 1), {"--sleep-ms", "1500"});
  job.start(2, staticNode(port, 1, 1), {"--sleep-ms", "1500"});
  std::vector<int> codes;
  for (int i = 0; i < 3; ++i) {
    codes.push_back(exitCode(job.wait(i, 40s)));
  }
  EXPECT_EQ(codes[0], 0) << job.allErr();
  // One of the two node-rank-1 agents got there first.
  EXPECT_EQ(std::min(codes[1], codes[2]), 0) << job.allErr();
  EXPECT_EQ(std::max(codes[1], codes[2]), 2) << job.allErr();
  EXPECT_NE(job.allErr().find("--node-rank 1 is already taken by another "
                              "node of run 'mnjob'"),
            std::string::npos)
      << job.allErr();
}

// ---- The etcd rendezvous ----------------------------------------------------

std::vector<std::string> etcd(const std::string& endpoint,
                              const std::string& nnodes, int nproc,
                              const std::string& conf = kConf) {
  auto flags = c10d(endpoint, nnodes, nproc, conf);
  flags[5] = "etcd";  // --rdzv-backend
  return flags;
}

class ElasticMultiNodeEtcd : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!haveEtcd()) {
      GTEST_SKIP() << kEtcdBinary << " is not installed (Debian etcd-server)";
    }
    ASSERT_TRUE(server_.start())
        << "etcd did not start; its log is in " << server_.dir();
  }
  EtcdServer server_;
};

TEST_F(ElasticMultiNodeEtcd, ThreeNodesAgreeOnEveryRank) {
  Job job;
  const std::string conf =
      "join_timeout=20,last_call_timeout=30,keep_alive_interval=1";
  for (int i = 0; i < 3; ++i) {
    job.start(i, etcd(server_.endpoint(), "2:3", 2, conf),
              {"--sleep-ms", "200"});
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 20s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 3, 2, 0);
  // The round record is where docs/elastic.md says, and says so.
  trellis::elastic::EtcdStoreOptions o;
  o.port = server_.port();
  o.prefix = "";
  o.timeout = 5s;
  trellis::elastic::EtcdStore raw(o);
  const std::string record = raw.getString("/trellis/rdzv/mnjob/round");
  EXPECT_NE(record.find("phase closed"), std::string::npos) << record;
  EXPECT_NE(job.err(0).find("etcd rendezvous at " + server_.endpoint()),
            std::string::npos)
      << job.allErr();
}

TEST_F(ElasticMultiNodeEtcd, AKilledAgentIsDroppedAndTheOthersGoOn) {
  Job job;
  auto flags = etcd(server_.endpoint(), "2:3", 1,
                    "join_timeout=20,last_call_timeout=1,read_timeout=10,"
                    "keep_alive_interval=1,keep_alive_max_attempt=2");
  flags.insert(flags.end(), {"--max-restarts", "1"});
  // Its lease (TTL 2 s) expires, then a 1 s last call.
  killedAgentScenario(
      job, [&](int i, const auto& worker) { job.start(i, flags, worker); },
      [] { return 1; }, "its etcd lease (TTL 2s) expired");
}

TEST_F(ElasticMultiNodeEtcd, AnUnreachableEtcdIsNamedWithinTheJoinTimeout) {
  Job job;
  const std::string ep = job.loopback();  // nobody listens there
  const auto start = Clock::now();
  job.start(0, etcd(ep, "2", 1, "join_timeout=1"), {});
  EXPECT_EQ(exitCode(job.wait(0, 15s)), 1) << job.err(0);
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(job.err(0).find("cannot reach the etcd rendezvous endpoint " + ep +
                            " (--rdzv-endpoint) within join_timeout 1s"),
            std::string::npos)
      << job.err(0);
}

TEST_F(ElasticMultiNodeEtcd, AnEtcdThatGoesAwayStopsTheJobByName) {
  Job job;
  for (int i = 0; i < 2; ++i) {
    job.start(i, etcd(server_.endpoint(), "2", 1),
              {"--sleep-first-ms", "30000"});
  }
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(job.waitEnv(rank, 0, 20s)) << job.allErr();
  }
  const auto killedAt = Clock::now();
  server_.kill();
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(exitCode(job.wait(i, 20s)), 0) << job.allErr();
  }
  EXPECT_LT(Clock::now() - killedAt, 15s);
  const std::string err = job.err(0);
  EXPECT_NE(err.find("lost the rendezvous"), std::string::npos) << err;
  EXPECT_NE(err.find("etcd " + server_.endpoint()), std::string::npos) << err;
}

// Hosts in network namespaces: one per node, each with a veth into a
// bridge in one more namespace and an address of its own. Removed, with
// everything in them, when the test ends (also when it fails).
struct Hosts : trellis::testing::NetnsHosts {
  explicit Hosts(int n) : NetnsHosts(n, "trle", 78) {}
};

TEST(ElasticMultiNodeNetns, TwoHostsRendezvousAcrossTheirOwnAddresses) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to create network namespaces";
  }
  Hosts hosts(2);
  ASSERT_TRUE(hosts.ok()) << "could not create the namespaces";
  Job job;
  const std::string ep = hosts.address(0) + ":29400";
  for (int i = 0; i < 2; ++i) {
    job.start(i, c10d(ep, "2", 2), {"--sleep-ms", "200"}, hosts.host(i));
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 30s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 2, 2, 0);
  // The store's host is group rank 0 (it joined first) or not; either
  // way the master is a node's own address on the bridge.
  const std::string master = job.env(0, 0).at("MASTER_ADDR");
  EXPECT_TRUE(master == hosts.address(0) || master == hosts.address(1))
      << master;
  EXPECT_NE(job.err(0).find("hosting the c10d rendezvous store on " + ep),
            std::string::npos)
      << job.allErr();
}

// The same three events across hosts, over each backend: agent i runs on
// host i + 1 of four; with etcd, etcd has host 0 to itself (started there
// through `ip netns exec`); with c10d, agent 0 serves the store (the
// endpoint is its host's address, which no other agent can bind).
class ElasticNetns : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root to create network namespaces";
    }
    if (isEtcd() && !haveEtcd()) {
      GTEST_SKIP() << kEtcdBinary << " is not installed (Debian etcd-server)";
    }
    hosts_ = std::make_unique<Hosts>(4);
    ASSERT_TRUE(hosts_->ok()) << "could not create the namespaces";
    if (isEtcd()) {
      server_ =
          std::make_unique<EtcdServer>(hosts_->host(0), hosts_->address(0));
      ASSERT_TRUE(server_->start())
          << "etcd did not start; its log is in " << server_->dir();
    }
  }

  bool isEtcd() const { return GetParam() == "etcd"; }

  std::vector<std::string> flags(const std::string& conf) const {
    return isEtcd() ? etcd(server_->endpoint(), "2:3", 1, conf)
                    : c10d(hosts_->address(1) + ":29400", "2:3", 1, conf);
  }

  void start(Job& job, int agent, const std::vector<std::string>& f,
             const std::vector<std::string>& worker) const {
    job.start(agent, f, worker, hosts_->host(agent + 1));
  }

  // Fast failure detection: a 2 s heartbeat bound (or lease) and a 1 s
  // last call. Store calls give up after 10 s: long enough for the
  // survivors on a loaded machine (at 4 s one failed once under the
  // sanitizer suite running beside it), short enough for the cut-off
  // node to give up within its test's wait.
  static constexpr const char* kFast =
      "join_timeout=20,last_call_timeout=1,read_timeout=10,"
      "keep_alive_interval=1,keep_alive_max_attempt=2";

  // What the survivors log about a node that vanished.
  std::string vanishedNote() const {
    return isEtcd() ? "its etcd lease (TTL 2s) expired" : "sent no heartbeat";
  }

  // Destroyed in reverse: etcd first, then the namespaces.
  std::unique_ptr<Hosts> hosts_;
  std::unique_ptr<EtcdServer> server_;
};

TEST_P(ElasticNetns, AKilledAgentIsDroppedAndTheOthersGoOn) {
  Job job;
  auto f = flags(kFast);
  f.insert(f.end(), {"--max-restarts", "1"});
  killedAgentScenario(
      job, [&](int i, const auto& worker) { start(job, i, f, worker); },
      [] { return 2; },  // not the c10d store's host
      vanishedNote());
}

TEST_P(ElasticNetns, ALatecomerOnAnotherHostIsTakenByTheNextRound) {
  Job job;
  const auto f = flags("join_timeout=20,last_call_timeout=1");
  latecomerScenario(
      job, [&](int i, const auto& worker) { start(job, i, f, worker); });
}

TEST_P(ElasticNetns, APartitionedHostIsDroppedAfterTheHeartbeatBound) {
  Job job;
  auto f = flags(kFast);
  f.insert(f.end(), {"--max-restarts", "1"});
  for (int i = 0; i < 3; ++i) {
    start(job, i, f, {"--sleep-first-ms", "30000"});
  }
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_TRUE(job.waitEnv(rank, 0, 20s)) << job.allErr();
  }
  const auto cutAt = Clock::now();
  ASSERT_TRUE(hosts_->partition(3));  // agent 2's host
  ASSERT_TRUE(job.waitEnv(0, 1, 15s)) << job.allErr();
  ASSERT_TRUE(job.waitEnv(1, 1, 5s)) << job.allErr();
  EXPECT_LT(Clock::now() - cutAt, 12s);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(exitCode(job.wait(i, 20s)), 0) << job.allErr();
  }
  expectConsistentRanks(job, 2, 1, 1);
  // The cut-off node gives up on its own (its store calls time out).
  EXPECT_NE(exitCode(job.wait(2, 30s)), 0) << job.allErr();
}

INSTANTIATE_TEST_SUITE_P(Backends, ElasticNetns,
                         ::testing::Values("c10d", "etcd"),
                         [](const auto& info) { return info.param; });

// True once process `pid` has a handler for `sig` (SigCgt in
// /proc/<pid>/status).
bool catches(pid_t pid, int sig) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigCgt:", 0) == 0) {
      return ((std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1) != 0;
    }
  }
  return false;
}

// An agent that waits to connect to its rendezvous store (join_timeout 60
// s, nobody there) gets SIGTERM: it stops within about a second (the
// connect looks for a signal between slices of join_timeout) and exits
// 128 + 15, naming the signal, instead of waiting out join_timeout. One
// case per way of connecting: c10d joining (is_host=false), c10d trying to
// host a port something else holds (is_host unset), a static node rank 1
// whose node rank 0 never comes, etcd with nothing at the endpoint.
class SigtermWhileConnecting : public ::testing::TestWithParam<std::string> {};

TEST_P(SigtermWhileConnecting, StopsTheAgentWithinAboutASecond) {
  Job job;
  const uint16_t port = job.reservePort();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  const std::string conf = "join_timeout=60";
  PortHolder holder(port);  // bound, never listening: connects are refused
  ASSERT_TRUE(holder.bound()) << "port " << port;
  std::vector<std::string> flags;
  if (GetParam() == "c10d_join") {
    flags = c10d(ep, "2", 1, conf + ",is_host=false");
  } else if (GetParam() == "c10d_host_or_join") {
    flags = c10d(ep, "2", 1, conf);
  } else if (GetParam() == "static") {
    flags = staticNode(port, 1, 1, conf);
  } else {
    flags = etcd(ep, "2", 1, conf);
  }
  job.start(0, flags, {});
  const auto end = Clock::now() + 10s;
  while (!catches(job.agent(0).pid, SIGTERM) && Clock::now() < end) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(catches(job.agent(0).pid, SIGTERM)) << job.err(0);
  std::this_thread::sleep_for(1500ms);  // well into the connect
  const auto signalledAt = Clock::now();
  ASSERT_EQ(::kill(job.agent(0).pid, SIGTERM), 0);  // ours, by pid
  EXPECT_EQ(exitCode(job.wait(0, 15s)), 128 + SIGTERM) << job.err(0);
  EXPECT_LT(Clock::now() - signalledAt, 3s) << job.err(0);
  EXPECT_NE(
      job.err(0).find("stopped by SIGTERM while connecting to the rendezvous"),
      std::string::npos)
      << job.err(0);
}

INSTANTIATE_TEST_SUITE_P(Backends, SigtermWhileConnecting,
                         ::testing::Values("c10d_join", "c10d_host_or_join",
                                           "static", "etcd"),
                         [](const auto& info) { return info.param; });

}  // namespace
