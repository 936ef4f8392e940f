#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>
#include <trellis/elastic/worker_env.h>

namespace trellis::elastic {
namespace {

using ::testing::HasSubstr;

constexpr const char* kToken = "0123456789abcdef-token";

ElasticOptions twoPerNode() {
  ElasticOptions o;
  o.minNodes = 2;
  o.maxNodes = 2;
  o.nprocPerNode = 2;
  o.maxRestarts = 3;
  o.role = "trainer";
  o.rdzvBackend = RdzvBackend::kC10d;
  return o;
}

RendezvousOutcome node(int32_t groupRank) {
  RendezvousOutcome r;
  r.groupRank = groupRank;
  r.groupWorldSize = 2;
  r.rankOffset = 2 * groupRank;
  r.worldSize = 4;
  r.masterAddr = "10.0.0.1";
  r.masterPort = 29500;
  r.restartCount = 1;
  r.runId = "job42";
  r.useAgentStore = true;
  r.runLogDir = "/tmp/logs/job42_ab";
  r.jobToken = auth::JobToken::fromString(kToken);
  return r;
}

Environment expected(int32_t groupRank, int32_t localRank) {
  const std::string rank = std::to_string(2 * groupRank + localRank);
  const std::string local = std::to_string(localRank);
  return {
      {"PATH", "/usr/bin"},
      {"RANK", rank},
      {"LOCAL_RANK", local},
      {"WORLD_SIZE", "4"},
      {"LOCAL_WORLD_SIZE", "2"},
      {"GROUP_RANK", std::to_string(groupRank)},
      {"GROUP_WORLD_SIZE", "2"},
      {"ROLE_RANK", rank},
      {"ROLE_WORLD_SIZE", "4"},
      {"ROLE_NAME", "trainer"},
      {"MASTER_ADDR", "10.0.0.1"},
      {"MASTER_PORT", "29500"},
      {"TORCHELASTIC_RESTART_COUNT", "1"},
      {"TORCHELASTIC_MAX_RESTARTS", "3"},
      {"TORCHELASTIC_RUN_ID", "job42"},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_ERROR_FILE",
       "/tmp/logs/job42_ab/attempt_1/" + local + "/error.json"},
      {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
      {"OMP_NUM_THREADS", "1"},
      {"TRELLIS_JOB_TOKEN", kToken},
  };
}

TEST(WorkerEnvironment, TwoNodesTimesTwoProcesses) {
  const Environment agent = {{"PATH", "/usr/bin"}};
  for (int32_t g = 0; g < 2; ++g) {
    for (int32_t l = 0; l < 2; ++l) {
      SCOPED_TRACE("node " + std::to_string(g) + " local " + std::to_string(l));
      EXPECT_EQ(workerEnvironment(twoPerNode(), node(g), l, agent),
                expected(g, l));
    }
  }
}

TEST(WorkerEnvironment, TheAgentStoreGivesTheRoundForTheKeyPrefix) {
  RendezvousOutcome o = node(1);
  o.round = 5;
  const Environment env = workerEnvironment(twoPerNode(), o, 0, {});
  EXPECT_EQ(env.at("TRELLIS_RDZV_ROUND"), "5");
  const WorkerEnv w = WorkerEnv::fromVariables(
      [&](const char* name) -> std::optional<std::string> {
        const auto it = env.find(name);
        return it == env.end() ? std::nullopt
                               : std::optional<std::string>(it->second);
      });
  EXPECT_TRUE(w.master.agentStore);
  EXPECT_EQ(w.master.keyPrefix, "/worker/attempt_1/round_5");
  // Rank 0 serves: no round, and none inherited from the agent either.
  o.useAgentStore = false;
  const Environment own =
      workerEnvironment(twoPerNode(), o, 0, {{"TRELLIS_RDZV_ROUND", "9"}});
  EXPECT_EQ(own.count("TRELLIS_RDZV_ROUND"), 0u);
  EXPECT_EQ(own.at("TORCHELASTIC_USE_AGENT_STORE"), "False");
}

TEST(WorkerEnvironment, WhenTheWorkersUseTheAgentStore) {
  ElasticOptions c10d = twoPerNode();
  c10d.workerArgv = {"./train", "--epochs", "3"};
  std::string note;
  EXPECT_TRUE(agentStoreForWorkers(c10d, {}, &note));
  EXPECT_EQ(note, "");
  // torchrun's opt-out ("1" only, as torch).
  EXPECT_FALSE(agentStoreForWorkers(
      c10d, {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}}, &note));
  EXPECT_THAT(note, HasSubstr("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"));
  EXPECT_TRUE(agentStoreForWorkers(
      c10d, {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0"}}));
  // Python workers: PyTorch's TCPStore cannot talk to ours.
  for (const char* argv0 : {"python3", "/usr/bin/python3.11", "train.py"}) {
    ElasticOptions py = c10d;
    py.workerArgv = {argv0, "-u", "train.py"};
    note.clear();
    EXPECT_FALSE(agentStoreForWorkers(py, {}, &note)) << argv0;
    EXPECT_THAT(note, HasSubstr("the workers run Python"));
  }
  // No store hosted by an agent: static, etcd, --standalone.
  for (const RdzvBackend b : {RdzvBackend::kStatic, RdzvBackend::kEtcd}) {
    ElasticOptions o = c10d;
    o.rdzvBackend = b;
    EXPECT_FALSE(agentStoreForWorkers(o, {}));
  }
  ElasticOptions standalone = c10d;
  standalone.standalone = true;
  EXPECT_FALSE(agentStoreForWorkers(standalone, {}));
}

TEST(WorkerEnvironment, RoundTripsThroughWorkerEnv) {
  for (int32_t g = 0; g < 2; ++g) {
    for (int32_t l = 0; l < 2; ++l) {
      const Environment env = workerEnvironment(twoPerNode(), node(g), l, {});
      const WorkerEnv w = WorkerEnv::fromVariables(
          [&](const char* name) -> std::optional<std::string> {
            const auto it = env.find(name);
            if (it == env.end()) {
              return std::nullopt;
            }
            return it->second;
          });
      EXPECT_EQ(w.rank, 2 * g + l);
      EXPECT_EQ(w.worldSize, 4);
      EXPECT_EQ(w.localRank, l);
      EXPECT_EQ(w.localWorldSize, 2);
      EXPECT_EQ(w.master.addr, "10.0.0.1");
      EXPECT_EQ(w.master.port, 29500);
      ASSERT_TRUE(w.jobToken);
      EXPECT_EQ(w.jobToken->secret(), kToken);
    }
  }
}

TEST(WorkerEnvironment, UserOmpNumThreadsAndNcclSettingAreKept) {
  const Environment agent = {{"OMP_NUM_THREADS", "8"},
                             {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}};
  const Environment env = workerEnvironment(twoPerNode(), node(0), 0, agent);
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "8");
  EXPECT_EQ(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "0");
  EXPECT_FALSE(ompNumThreadsWarning(twoPerNode(), agent));
}

TEST(WorkerEnvironment, OneWorkerPerNodeLeavesOmpAlone) {
  ElasticOptions o = twoPerNode();
  o.nprocPerNode = 1;
  RendezvousOutcome r = node(1);
  r.rankOffset = 1;
  r.worldSize = 2;
  const Environment env = workerEnvironment(o, r, 0, {});
  EXPECT_EQ(env.count("OMP_NUM_THREADS"), 0u);
  EXPECT_FALSE(ompNumThreadsWarning(o, {}));
}

TEST(WorkerEnvironment, OmpWarning) {
  const auto w = ompNumThreadsWarning(twoPerNode(), {});
  ASSERT_TRUE(w);
  EXPECT_THAT(*w, HasSubstr("OMP_NUM_THREADS=1"));
}

TEST(WorkerEnvironment, AgentVariablesAreOverridden) {
  const Environment agent = {{"RANK", "99"}, {"TRELLIS_JOB_TOKEN", "old"}};
  const Environment env = workerEnvironment(twoPerNode(), node(0), 1, agent);
  EXPECT_EQ(env.at("RANK"), "1");
  EXPECT_EQ(env.at("TRELLIS_JOB_TOKEN"), kToken);
}

TEST(WorkerEnvironment, ImpossibleOutcomesAreRefused) {
  auto refused = [](RendezvousOutcome r, int32_t local, const char* field) {
    SCOPED_TRACE(field);
    try {
      (void)workerEnvironment(twoPerNode(), r, local, {});
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgumentError& e) {
      EXPECT_THAT(e.what(), HasSubstr(field));
    }
  };
  refused(node(0), 2, "localRank");
  refused(node(0), -1, "localRank");
  RendezvousOutcome r = node(0);
  r.groupRank = 2;
  refused(r, 0, "groupRank");
  r = node(1);
  r.worldSize = 3;
  refused(r, 0, "worldSize");
  r = node(0);
  r.masterPort = 0;
  refused(r, 0, "masterPort");
  r = node(0);
  r.jobToken.reset();
  refused(r, 0, "jobToken");
  r = node(0);
  r.runId.clear();
  refused(r, 0, "runId");
}

TEST(JobTokenForRun, GivenOrFresh) {
  EXPECT_EQ(jobTokenForRun({{"TRELLIS_JOB_TOKEN", kToken}}).secret(), kToken);
  const auto a = jobTokenForRun({});
  const auto b = jobTokenForRun({{"TRELLIS_JOB_TOKEN", ""}});
  EXPECT_EQ(a.secret().size(), 64u);
  EXPECT_NE(a.secret(), b.secret());
  try {
    (void)jobTokenForRun({{"TRELLIS_JOB_TOKEN", "short"}});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgumentError& e) {
    EXPECT_THAT(e.what(), HasSubstr("TRELLIS_JOB_TOKEN"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("short")));
  }
}

}  // namespace
}  // namespace trellis::elastic
