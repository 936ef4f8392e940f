#include <map>
#include <string>

#include <gtest/gtest.h>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>

namespace trellis {
namespace {

using Vars = std::map<std::string, std::string>;

WorkerEnv parse(const Vars& vars) {
  return WorkerEnv::fromVariables(
      [&](const char* name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) {
          return std::nullopt;
        }
        return it->second;
      });
}

// The message of the InvalidArgumentError that parsing `vars` throws.
std::string refusal(const Vars& vars) {
  try {
    parse(vars);
  } catch (const InvalidArgumentError& e) {
    return e.error().message();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

TEST(WorkerEnv, TorchrunVariables) {
  const WorkerEnv env = parse({{"RANK", "5"},
                               {"WORLD_SIZE", "8"},
                               {"LOCAL_RANK", "1"},
                               {"LOCAL_WORLD_SIZE", "4"},
                               {"MASTER_ADDR", "node-0.cluster"},
                               {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.worldSize, 8);
  EXPECT_EQ(env.localRank, 1);
  EXPECT_EQ(env.localWorldSize, 4);
  EXPECT_EQ(env.master.addr, "node-0.cluster");
  EXPECT_EQ(env.master.port, 29500);
  EXPECT_TRUE(env.master.complete());
  EXPECT_FALSE(env.jobToken.has_value());
}

TEST(WorkerEnv, WithoutLocalVariablesTheJobIsOneHost) {
  const WorkerEnv env = parse({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(env.localRank, 2);
  EXPECT_EQ(env.localWorldSize, 3);
  EXPECT_FALSE(env.master.complete());
  EXPECT_EQ(env.master.port, 0);
}

TEST(WorkerEnv, EmptyCountsAsUnset) {
  const WorkerEnv env = parse({{"RANK", "0"},
                               {"WORLD_SIZE", "1"},
                               {"LOCAL_RANK", ""},
                               {"MASTER_ADDR", ""},
                               {"TRELLIS_JOB_TOKEN", ""}});
  EXPECT_EQ(env.localRank, 0);
  EXPECT_TRUE(env.master.addr.empty());
  EXPECT_FALSE(env.jobToken.has_value());
}

TEST(WorkerEnv, MissingRequiredVariablesAreNamed) {
  EXPECT_NE(refusal({{"WORLD_SIZE", "2"}}).find("RANK is not set"),
            std::string::npos);
  EXPECT_NE(refusal({{"RANK", "0"}}).find("WORLD_SIZE is not set"),
            std::string::npos);
}

TEST(WorkerEnv, MalformedNumbersAreNamedWithTheirValue) {
  for (const std::string v : {"x", "1x", " 1", "1 ", "+1", "0x10", "1.0",
                              "99999999999999999999", "-"}) {
    SCOPED_TRACE(v);
    EXPECT_EQ(refusal({{"RANK", v}, {"WORLD_SIZE", "4"}}),
              "RANK='" + v + "' is not a decimal integer");
  }
  EXPECT_NE(refusal({{"RANK", "0"}, {"WORLD_SIZE", "0"}})
                .find("WORLD_SIZE='0' is out of range"),
            std::string::npos);
  EXPECT_NE(refusal({{"RANK", "4"}, {"WORLD_SIZE", "4"}})
                .find("RANK='4' is out of range: 0 <= RANK < WORLD_SIZE (4)"),
            std::string::npos);
  EXPECT_NE(refusal({{"RANK", "-1"}, {"WORLD_SIZE", "4"}})
                .find("RANK='-1' is out of range"),
            std::string::npos);
}

TEST(WorkerEnv, LocalValuesMustFitTheJob) {
  EXPECT_NE(
      refusal({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "5"}})
          .find("LOCAL_WORLD_SIZE='5' is out of range"),
      std::string::npos);
  EXPECT_NE(refusal({{"RANK", "0"},
                     {"WORLD_SIZE", "4"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"LOCAL_RANK", "2"}})
                .find("LOCAL_RANK='2' is out of range"),
            std::string::npos);
  // Several hosts without LOCAL_RANK: the rank cannot stand in for it.
  EXPECT_NE(
      refusal({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}})
          .find("set LOCAL_RANK"),
      std::string::npos);
}

TEST(WorkerEnv, MasterEndpointIsChecked) {
  const Vars job = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
  auto with = [&](Vars extra) {
    extra.insert(job.begin(), job.end());
    return refusal(extra);
  };
  EXPECT_NE(with({{"MASTER_PORT", "0"}}).find("MASTER_PORT='0' is out of"),
            std::string::npos);
  EXPECT_NE(with({{"MASTER_PORT", "65536"}}).find("a port is 1-65535"),
            std::string::npos);
  EXPECT_NE(with({{"MASTER_PORT", "http"}}).find("not a decimal integer"),
            std::string::npos);
  EXPECT_NE(with({{"MASTER_ADDR", "node 0"}}).find("MASTER_ADDR='node 0'"),
            std::string::npos);
  EXPECT_NE(with({{"MASTER_ADDR", std::string(300, 'a')}})
                .find("longer than a host name"),
            std::string::npos);
  const WorkerEnv v6 = parse({{"RANK", "0"},
                              {"WORLD_SIZE", "1"},
                              {"MASTER_ADDR", "::1"},
                              {"MASTER_PORT", "1"}});
  EXPECT_EQ(v6.master.addr, "::1");
  EXPECT_EQ(v6.master.port, 1);
}

TEST(WorkerEnv, TheLaunchersStoreAndItsKeyPrefix) {
  const Vars job = {{"RANK", "1"},
                    {"WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.1"},
                    {"MASTER_PORT", "29400"}};
  auto with = [&](Vars extra) {
    extra.insert(job.begin(), job.end());
    return extra;
  };
  // Unset, empty or "False": rank 0 serves, no prefix (as before).
  for (const Vars& v : {job, with({{"TORCHELASTIC_USE_AGENT_STORE", ""}}),
                        with({{"TORCHELASTIC_USE_AGENT_STORE", "False"}})}) {
    const WorkerEnv e = parse(v);
    EXPECT_FALSE(e.master.agentStore);
    EXPECT_EQ(e.master.keyPrefix, "");
  }
  // "True": torch's prefix, plus elastic-run's round when it gives one.
  const WorkerEnv torch = parse(with({{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                      {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_TRUE(torch.master.agentStore);
  EXPECT_EQ(torch.master.keyPrefix, "/worker/attempt_2");
  const WorkerEnv ours = parse(with({{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                     {"TORCHELASTIC_RESTART_COUNT", "0"},
                                     {"TRELLIS_RDZV_ROUND", "7"}}));
  EXPECT_EQ(ours.master.keyPrefix, "/worker/attempt_0/round_7");
  // The round only matters with the launcher's store.
  EXPECT_EQ(parse(with({{"TRELLIS_RDZV_ROUND", "x"}})).master.keyPrefix, "");

  EXPECT_NE(refusal(with({{"TORCHELASTIC_USE_AGENT_STORE", "true"}}))
                .find("TORCHELASTIC_USE_AGENT_STORE='true' is neither"),
            std::string::npos);
  EXPECT_NE(refusal(with({{"TORCHELASTIC_USE_AGENT_STORE", "True"}}))
                .find("TORCHELASTIC_RESTART_COUNT is not set"),
            std::string::npos);
  EXPECT_NE(refusal(with({{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                          {"TORCHELASTIC_RESTART_COUNT", "-1"}}))
                .find("TORCHELASTIC_RESTART_COUNT='-1' is out of range"),
            std::string::npos);
  EXPECT_NE(refusal(with({{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                          {"TORCHELASTIC_RESTART_COUNT", "0"},
                          {"TRELLIS_RDZV_ROUND", "1/../x"}}))
                .find("TRELLIS_RDZV_ROUND='1/../x' is not a decimal"),
            std::string::npos);
  // masterFromVariables reads the same.
  const MasterEndpoint m =
      masterFromVariables([](const char* name) -> std::optional<std::string> {
        const Vars v = {{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                        {"TORCHELASTIC_RESTART_COUNT", "4"}};
        auto it = v.find(name);
        return it == v.end() ? std::nullopt
                             : std::optional<std::string>(it->second);
      });
  EXPECT_TRUE(m.agentStore);
  EXPECT_EQ(m.keyPrefix, "/worker/attempt_4");
}

TEST(WorkerEnv, JobTokenIsCheckedAndNeverShown) {
  const std::string good(32, 'k');
  const WorkerEnv env =
      parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"TRELLIS_JOB_TOKEN", good}});
  ASSERT_TRUE(env.jobToken.has_value());
  EXPECT_EQ(env.jobToken->secret(), good);
  const std::string shortToken = "secret-but-short";
  const std::string msg = refusal({{"RANK", "0"},
                                   {"WORLD_SIZE", "1"},
                                   {"TRELLIS_JOB_TOKEN", shortToken + " x"}});
  EXPECT_NE(msg.find("TRELLIS_JOB_TOKEN"), std::string::npos) << msg;
  EXPECT_EQ(msg.find(shortToken), std::string::npos) << msg;
}

TEST(WorkerEnv, FromEnvironmentReadsTheProcess) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  const WorkerEnv env = WorkerEnv::fromEnvironment();
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.worldSize, 2);
}

TEST(WorkerEnv, NothingSetNamesEveryLauncher) {
  const std::string m = refusal({});
  EXPECT_NE(m.find("RANK is not set"), std::string::npos) << m;
  EXPECT_NE(m.find("srun"), std::string::npos) << m;
  EXPECT_NE(m.find("mpirun"), std::string::npos) << m;
}

// What srun sets for task 5 of 6: two tasks on each of three nodes
// ("2(x2),2"), this one the second on the third node.
Vars srunTask() {
  return {{"SLURM_PROCID", "5"},
          {"SLURM_NTASKS", "6"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2),2"},
          {"SLURM_TASKS_PER_NODE", "8(x3)"},  // the job's; the step's wins
          {"SLURM_JOB_NODELIST", "gpu[07-09,11],cpu1"},
          {"SLURM_JOB_ID", "123456"}};
}

TEST(WorkerEnv, SrunVariables) {
  const WorkerEnv env = parse(srunTask());
  EXPECT_EQ(env.launcher, "Slurm");
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.worldSize, 6);
  EXPECT_EQ(env.localRank, 1);
  EXPECT_EQ(env.localWorldSize, 2);
  EXPECT_EQ(env.master.addr, "gpu07");
  EXPECT_EQ(env.master.port, 15000 + 123456 % 10000);
  // The step's node list wins over the job's; MASTER_* win over both.
  Vars v = srunTask();
  v["SLURM_STEP_NODELIST"] = "rack[2-3]-n[04-05]";
  EXPECT_EQ(parse(v).master.addr, "rack2-n04");
  v["MASTER_ADDR"] = "10.0.0.1";
  v["MASTER_PORT"] = "29500";
  EXPECT_EQ(parse(v).master.addr, "10.0.0.1");
  EXPECT_EQ(parse(v).master.port, 29500);
  // Per-node counts: the node's own entry.
  v = srunTask();
  v["SLURM_STEP_TASKS_PER_NODE"] = "1,3(x2)";
  v["SLURM_NODEID"] = "0";
  v["SLURM_LOCALID"] = "0";
  EXPECT_EQ(parse(v).localWorldSize, 1);
  v["SLURM_NODEID"] = "2";
  v["SLURM_LOCALID"] = "2";
  EXPECT_EQ(parse(v).localWorldSize, 3);
}

TEST(WorkerEnv, MalformedSlurmValuesAreNamed) {
  auto with = [](const char* name, const char* value) {
    Vars v = srunTask();
    v[name] = value;
    return refusal(v);
  };
  // The last: a first host of 300 characters (found by worker_env_fuzz:
  // it became a MASTER_ADDR longer than any host name).
  const std::string longHost = std::string(300, 'n') + ",gpu1";
  for (const char* list :
       {"gpu[07-09", "gpu[a-b]", "gpu 1", ",gpu1", "[]", longHost.c_str()}) {
    const std::string m = with("SLURM_JOB_NODELIST", list);
    EXPECT_NE(m.find("SLURM_JOB_NODELIST='"), std::string::npos) << m;
  }
  for (const char* spec : {"2(x", "2(3)", "x2", "0", "2(x0)", "2,,2", ""}) {
    Vars v = srunTask();
    v["SLURM_STEP_TASKS_PER_NODE"] = spec;
    if (std::string(spec).empty()) {
      // Empty counts as unset: the job's value (8 per node, capped at the
      // 6 tasks) is used.
      EXPECT_EQ(parse(v).localWorldSize, 6);
      continue;
    }
    const std::string m = refusal(v);
    EXPECT_NE(m.find("SLURM_STEP_TASKS_PER_NODE='"), std::string::npos)
        << spec << ": " << m;
  }
  EXPECT_NE(with("SLURM_STEP_TASKS_PER_NODE", "2,2")
                .find("no entry for this "
                      "node"),
            std::string::npos);
  EXPECT_NE(with("SLURM_PROCID", "6").find("SLURM_PROCID='6' is out of range"),
            std::string::npos);
  EXPECT_NE(with("SLURM_LOCALID", "2").find("SLURM_LOCALID='2'"),
            std::string::npos);
  EXPECT_NE(with("SLURM_JOB_ID", "-1").find("SLURM_JOB_ID='-1'"),
            std::string::npos);
  Vars v = srunTask();
  v.erase("SLURM_NODEID");
  EXPECT_NE(refusal(v).find("SLURM_NODEID is not set"), std::string::npos);
}

TEST(WorkerEnv, MpirunVariablesWinOverTheBatchStepsSlurmOnes) {
  Vars v = srunTask();
  v["SLURM_PROCID"] = "0";  // inherited from the batch step by every process
  v["OMPI_COMM_WORLD_RANK"] = "3";
  v["OMPI_COMM_WORLD_SIZE"] = "4";
  v["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  v["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  const WorkerEnv env = parse(v);
  EXPECT_EQ(env.launcher, "Open MPI");
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.worldSize, 4);
  EXPECT_EQ(env.localRank, 1);
  EXPECT_EQ(env.localWorldSize, 2);
  EXPECT_EQ(env.master.addr, "gpu07");  // inside an allocation
  // torchrun's (elastic-run's) variables win over both.
  v["RANK"] = "2";
  v["WORLD_SIZE"] = "8";
  EXPECT_EQ(parse(v).launcher, "torchrun");
  EXPECT_EQ(parse(v).rank, 2);
  // Outside Slurm mpirun sets no address.
  const WorkerEnv bare =
      parse({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_TRUE(bare.master.addr.empty());
  EXPECT_EQ(bare.master.port, 0);
  EXPECT_NE(refusal({{"OMPI_COMM_WORLD_RANK", "0"}})
                .find("OMPI_COMM_WORLD_SIZE is not set"),
            std::string::npos);
}

TEST(TimeoutModel, UnsetZeroAndNegative) {
  using std::chrono::seconds;
  EXPECT_EQ(timeoutOr(std::nullopt, seconds(60), "rpc timeout"), seconds(60));
  EXPECT_EQ(timeoutOr(seconds(0), seconds(60), "rpc timeout"), seconds(0));
  EXPECT_EQ(timeoutOr(seconds(2), seconds(60), "rpc timeout"), seconds(2));
  try {
    timeoutOr(seconds(-1), seconds(60), "rpc timeout");
    ADD_FAILURE() << "accepted a negative timeout";
  } catch (const InvalidArgumentError& e) {
    EXPECT_EQ(e.error().message(),
              "rpc timeout must be >= 0 (0 means none; leave it unset for the "
              "default), got -1s");
  }
}

}  // namespace
}  // namespace trellis
