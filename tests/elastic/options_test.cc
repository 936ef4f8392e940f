#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/elastic/options.h>

namespace trellis::elastic {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ParseContext context(Environment env = {}, int32_t gpus = 0) {
  ParseContext c;
  c.env = std::move(env);
  c.cpuCount = [] { return 6; };
  c.gpuCount = [gpus] { return gpus; };
  c.newRunId = [] { return std::string("run-fixed"); };
  return c;
}

ElasticOptions parse(std::vector<std::string> args, Environment env = {},
                     int32_t gpus = 0) {
  return parseOptions(args, context(std::move(env), gpus));
}

// The InvalidArgumentError's message; fails the test when none is thrown.
std::string errorOf(std::vector<std::string> args, Environment env = {},
                    int32_t gpus = 0) {
  try {
    parse(std::move(args), std::move(env), gpus);
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InvalidArgumentError";
  return "";
}

TEST(ElasticOptions, DefaultsAreTorchrunsDefaults) {
  const ElasticOptions o = parse({"./train"});
  EXPECT_FALSE(o.helpRequested);
  EXPECT_EQ(o.minNodes, 1);
  EXPECT_EQ(o.maxNodes, 1);
  EXPECT_EQ(o.nprocPerNodeSpec, "1");
  EXPECT_EQ(o.nprocPerNode, 1);
  EXPECT_EQ(o.nodeRank, 0);
  EXPECT_FALSE(o.nodeRankGiven);
  EXPECT_EQ(o.rdzvBackend, RdzvBackend::kStatic);
  EXPECT_EQ(o.rdzvEndpointSpec, "");
  EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"127.0.0.1", 29500}));
  EXPECT_EQ(o.rdzvId, "none");
  EXPECT_EQ(o.rdzvConf, RdzvConf{});
  EXPECT_FALSE(o.standalone);
  EXPECT_EQ(o.maxRestarts, 0);
  EXPECT_EQ(o.monitorInterval, std::chrono::milliseconds(100));
  EXPECT_EQ(o.role, "default");
  EXPECT_FALSE(o.logDir);
  EXPECT_EQ(o.redirects, StreamsSpec{});
  EXPECT_EQ(o.tee, StreamsSpec{});
  EXPECT_TRUE(o.localRanksFilter.empty());
  EXPECT_EQ(o.masterAddr, "127.0.0.1");
  EXPECT_EQ(o.masterPort, 29500);
  EXPECT_FALSE(o.localAddr);
  EXPECT_EQ(o.startMethod, "spawn");
  EXPECT_FALSE(o.noPython);
  EXPECT_THAT(o.workerArgv, ElementsAre("./train"));
  EXPECT_TRUE(o.warnings.empty());
}

// One flag with a value, its effect, and its PET_ variable.
struct FlagCase {
  std::string dash;        // "--nproc-per-node"
  std::string underscore;  // "--nproc_per_node" (or the same)
  std::string env;         // "PET_NPROC_PER_NODE"
  std::string value;
  std::function<void(const ElasticOptions&)> check;
};

std::vector<FlagCase> flagCases() {
  return {
      {"--nnodes", "--nnodes", "PET_NNODES", "2:4",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.minNodes, 2);
         EXPECT_EQ(o.maxNodes, 4);
       }},
      {"--nproc-per-node", "--nproc_per_node", "PET_NPROC_PER_NODE", "3",
       [](const ElasticOptions& o) { EXPECT_EQ(o.nprocPerNode, 3); }},
      {"--node-rank", "--node_rank", "PET_NODE_RANK", "0",
       [](const ElasticOptions& o) { EXPECT_TRUE(o.nodeRankGiven); }},
      {"--rdzv-backend", "--rdzv_backend", "PET_RDZV_BACKEND", "etcd",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.rdzvBackend, RdzvBackend::kEtcd);
         EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"localhost", 2379}));
       }},
      {"--rdzv-endpoint", "--rdzv_endpoint", "PET_RDZV_ENDPOINT", "node1:1234",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.rdzvEndpointSpec, "node1:1234");
         EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"node1", 1234}));
       }},
      {"--rdzv-id", "--rdzv_id", "PET_RDZV_ID", "job42",
       [](const ElasticOptions& o) { EXPECT_EQ(o.rdzvId, "job42"); }},
      {"--rdzv-conf", "--rdzv_conf", "PET_RDZV_CONF",
       "join_timeout=5,is_host=false",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.rdzvConf.joinTimeout, std::chrono::seconds(5));
         EXPECT_EQ(o.rdzvConf.isHost, false);
       }},
      {"--max-restarts", "--max_restarts", "PET_MAX_RESTARTS", "3",
       [](const ElasticOptions& o) { EXPECT_EQ(o.maxRestarts, 3); }},
      {"--monitor-interval", "--monitor_interval", "PET_MONITOR_INTERVAL",
       "0.5",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.monitorInterval, std::chrono::milliseconds(500));
       }},
      {"--start-method", "--start_method", "PET_START_METHOD", "fork",
       [](const ElasticOptions& o) { EXPECT_EQ(o.startMethod, "fork"); }},
      {"--role", "--role", "PET_ROLE", "trainer",
       [](const ElasticOptions& o) { EXPECT_EQ(o.role, "trainer"); }},
      {"--log-dir", "--log_dir", "PET_LOG_DIR", "/tmp/logs",
       [](const ElasticOptions& o) { EXPECT_EQ(o.logDir, "/tmp/logs"); }},
      {"--redirects", "-r", "PET_REDIRECTS", "0:1,1:2",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.redirects.forRank(0), Streams::kOut);
         EXPECT_EQ(o.redirects.forRank(1), Streams::kErr);
         EXPECT_EQ(o.redirects.forRank(2), Streams::kNone);
       }},
      {"--tee", "-t", "PET_TEE", "3",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.tee.forRank(0), Streams::kAll);
         EXPECT_EQ(o.tee.forRank(7), Streams::kAll);
       }},
      {"--local-ranks-filter", "--local_ranks_filter", "PET_LOCAL_RANKS_FILTER",
       "0,2",
       [](const ElasticOptions& o) {
         EXPECT_THAT(o.localRanksFilter, ElementsAre(0, 2));
       }},
      {"--master-addr", "--master_addr", "PET_MASTER_ADDR", "10.0.0.1",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.masterAddr, "10.0.0.1");
         EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"10.0.0.1", 29500}));
       }},
      {"--master-port", "--master_port", "PET_MASTER_PORT", "1234",
       [](const ElasticOptions& o) {
         EXPECT_EQ(o.masterPort, 1234);
         EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"127.0.0.1", 1234}));
       }},
      {"--local-addr", "--local_addr", "PET_LOCAL_ADDR", "10.0.0.2",
       [](const ElasticOptions& o) { EXPECT_EQ(o.localAddr, "10.0.0.2"); }},
  };
}

// Flags some values need to be valid (nnodes 2:4 needs a dynamic backend).
std::vector<std::string> companions(const FlagCase& c) {
  if (c.dash == "--nnodes") {
    return {"--rdzv-backend", "c10d"};
  }
  return {};
}

TEST(ElasticOptions, EveryFlagInBothSpellingsAndWithEquals) {
  for (const FlagCase& c : flagCases()) {
    for (const std::string& name : {c.dash, c.underscore}) {
      SCOPED_TRACE(name);
      std::vector<std::string> a = companions(c);
      a.insert(a.end(), {name, c.value, "./train"});
      const ElasticOptions separate = parse(a);
      c.check(separate);
      EXPECT_THAT(separate.workerArgv, ElementsAre("./train"));
      if (name.rfind("--", 0) == 0) {
        std::vector<std::string> b = companions(c);
        b.insert(b.end(), {name + "=" + c.value, "./train"});
        c.check(parse(b));
      }
    }
  }
}

TEST(ElasticOptions, EveryPetVariable) {
  for (const FlagCase& c : flagCases()) {
    SCOPED_TRACE(c.env);
    c.check(parse(companions(c).empty()
                      ? std::vector<std::string>{"./train"}
                      : std::vector<std::string>{companions(c)[0],
                                                 companions(c)[1], "./train"},
                  {{c.env, c.value}}));
  }
}

TEST(ElasticOptions, BooleanFlagsAndTheirVariables) {
  EXPECT_TRUE(parse({"--standalone", "./t"}).standalone);
  EXPECT_TRUE(parse({"./t"}, {{"PET_STANDALONE", "1"}}).standalone);
  EXPECT_FALSE(parse({"./t"}, {{"PET_STANDALONE", "0"}}).standalone);
  EXPECT_TRUE(parse({"--no-python", "./t"}).noPython);
  EXPECT_TRUE(parse({"--no_python", "./t"}).noPython);
  EXPECT_TRUE(parse({"./t"}, {{"PET_NO_PYTHON", "true"}}).noPython);
  EXPECT_THAT(errorOf({"./t"}, {{"PET_NO_PYTHON", "maybe"}}),
              HasSubstr("PET_NO_PYTHON='maybe' (--no-python)"));
}

TEST(ElasticOptions, CommandLineWinsOverEnvironment) {
  const Environment env = {{"PET_NPROC_PER_NODE", "4"},
                           {"PET_ROLE", "env-role"},
                           {"PET_MAX_RESTARTS", "9"}};
  const ElasticOptions o =
      parse({"--nproc_per_node", "2", "--role", "cli-role", "./t"}, env);
  EXPECT_EQ(o.nprocPerNode, 2);
  EXPECT_EQ(o.role, "cli-role");
  EXPECT_EQ(o.maxRestarts, 9);  // not on the command line: from PET_
}

TEST(ElasticOptions, EmptyPetVariableCountsAsUnset) {
  EXPECT_EQ(parse({"./t"}, {{"PET_NPROC_PER_NODE", ""}}).nprocPerNode, 1);
}

TEST(ElasticOptions, LastOccurrenceWinsAsArgparse) {
  EXPECT_EQ(
      parse({"--max-restarts", "1", "--max_restarts", "2", "./t"}).maxRestarts,
      2);
}

TEST(ElasticOptions, NprocPerNodeWords) {
  EXPECT_EQ(parse({"--nproc-per-node", "cpu", "./t"}, {}, 2).nprocPerNode, 6);
  EXPECT_EQ(parse({"--nproc-per-node", "gpu", "./t"}, {}, 2).nprocPerNode, 2);
  EXPECT_EQ(parse({"--nproc-per-node", "auto", "./t"}, {}, 2).nprocPerNode, 2);
  EXPECT_EQ(parse({"--nproc-per-node", "auto", "./t"}, {}, 0).nprocPerNode, 6);
  const ElasticOptions o = parse({"--nproc-per-node", "gpu", "./t"}, {}, 4);
  EXPECT_EQ(o.nprocPerNodeSpec, "gpu");
  EXPECT_THAT(errorOf({"--nproc-per-node", "gpu", "./t"}, {}, 0),
              HasSubstr("--nproc-per-node 'gpu': no GPU"));
  EXPECT_THAT(errorOf({"--nproc-per-node", "many", "./t"}),
              HasSubstr("--nproc-per-node 'many'"));
  EXPECT_THAT(errorOf({"--nproc-per-node=0", "./t"}),
              HasSubstr("--nproc-per-node '0'"));
  EXPECT_THAT(errorOf({"--nproc-per-node=-2", "./t"}),
              HasSubstr("--nproc-per-node '-2'"));
}

TEST(ElasticOptions, CommandAndWorkerArguments) {
  EXPECT_THAT(
      parse({"--nproc-per-node", "2", "./bin", "--nproc-per-node", "9", "-m",
             "--standalone"})
          .workerArgv,
      ElementsAre("./bin", "--nproc-per-node", "9", "-m", "--standalone"));
  EXPECT_THAT(parse({"--", "./bin", "-x"}).workerArgv,
              ElementsAre("./bin", "-x"));
  EXPECT_THAT(parse({"train.py", "--lr", "1"}).workerArgv,
              ElementsAre("python3", "-u", "train.py", "--lr", "1"));
  EXPECT_THAT(parse({"train.py"}, {{"PYTHON_EXEC", "/opt/py"}}).workerArgv,
              ElementsAre("/opt/py", "-u", "train.py"));
  EXPECT_THAT(parse({"--no-python", "train.py"}).workerArgv,
              ElementsAre("train.py"));
  EXPECT_THAT(errorOf({}), HasSubstr("missing CMD"));
  EXPECT_THAT(errorOf({"--nproc-per-node", "2"}), HasSubstr("missing CMD"));
}

TEST(ElasticOptions, UnknownFlagIsNamed) {
  EXPECT_THAT(errorOf({"--bogus", "./t"}), HasSubstr("--bogus"));
  EXPECT_THAT(errorOf({"--logs-specs", "x", "./t"}), HasSubstr("--logs-specs"));
}

TEST(ElasticOptions, FlagWithoutValueIsNamed) {
  EXPECT_THAT(errorOf({"--nnodes"}), HasSubstr("--nnodes"));
}

TEST(ElasticOptions, Help) {
  EXPECT_TRUE(parse({"--help"}).helpRequested);
  EXPECT_TRUE(parse({"-h"}).helpRequested);
  EXPECT_THAT(usage(), HasSubstr("--nproc-per-node"));
  // After CMD, -h is the worker's.
  EXPECT_FALSE(parse({"./t", "-h"}).helpRequested);
}

TEST(ElasticOptions, ModuleAndRunPathAreRefused) {
  for (const char* f : {"-m", "--module", "--run-path", "--run_path"}) {
    SCOPED_TRACE(f);
    const std::string e = errorOf({f, "pkg.train"});
    EXPECT_THAT(e, HasSubstr("python3 -m"));
  }
  EXPECT_THAT(errorOf({"--module", "pkg"}), HasSubstr("--module"));
  EXPECT_THAT(errorOf({"--run-path", "/a.py"}), HasSubstr("--run-path"));
  EXPECT_THAT(errorOf({"./t"}, {{"PET_MODULE", "1"}}),
              HasSubstr("PET_MODULE='1' (--module)"));
  EXPECT_THAT(errorOf({"./t"}, {{"PET_RUN_PATH", "1"}}),
              HasSubstr("PET_RUN_PATH='1' (--run-path)"));
  EXPECT_EQ(parse({"./t"}, {{"PET_MODULE", "0"}}).workerArgv.size(), 1u);
}

TEST(ElasticOptions, Nnodes) {
  const ElasticOptions o = parse({"--nnodes", "3", "--node-rank", "2", "./t"});
  EXPECT_EQ(o.minNodes, 3);
  EXPECT_EQ(o.maxNodes, 3);
  for (const char* bad : {"3:2", "0", "-1", "1:2:3", "x", "1:", ""}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(errorOf({"--rdzv-backend", "c10d", "--nnodes", bad, "./t"}),
                HasSubstr("--nnodes '" + std::string(bad) + "'"));
  }
  EXPECT_THAT(
      errorOf({"--rdzv-backend", "c10d", "./t"}, {{"PET_NNODES", "3:2"}}),
      HasSubstr("PET_NNODES='3:2' (--nnodes)"));
}

TEST(ElasticOptions, NodeRank) {
  EXPECT_EQ(parse({"--nnodes", "4", "--node-rank", "3", "./t"}).nodeRank, 3);
  EXPECT_THAT(errorOf({"--node-rank", "-1", "./t"}),
              HasSubstr("--node-rank '-1'"));
  const std::string e = errorOf({"--nnodes", "2", "--node-rank", "2", "./t"});
  EXPECT_THAT(e, HasSubstr("--node-rank '2'"));
  EXPECT_THAT(e, HasSubstr("--nnodes '2'"));
}

TEST(ElasticOptions, StaticRendezvousRules) {
  std::string e = errorOf({"--nnodes", "2", "./t"});
  EXPECT_THAT(e, HasSubstr("--rdzv-backend 'static'"));
  EXPECT_THAT(e, HasSubstr("--nnodes '2'"));
  EXPECT_THAT(e, HasSubstr("--node-rank"));
  e = errorOf({"--nnodes", "1:2", "--node-rank", "0", "./t"});
  EXPECT_THAT(e, HasSubstr("--rdzv-backend 'static'"));
  EXPECT_THAT(e, HasSubstr("--nnodes '1:2'"));
  const ElasticOptions o =
      parse({"--rdzv-backend", "static", "--rdzv-endpoint", "[::1]", "./t"});
  EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"::1", 29400}));
}

TEST(ElasticOptions, Backends) {
  EXPECT_EQ(parse({"--rdzv-backend", "c10d", "./t"}).rdzvEndpoint,
            (Endpoint{"localhost", 29400}));
  EXPECT_EQ(parse({"--rdzv-backend", "etcd-v2", "./t"}).rdzvBackend,
            RdzvBackend::kEtcdV2);
  EXPECT_EQ(parse({"--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e", "./t"})
                .rdzvEndpoint,
            (Endpoint{"e", 2379}));
  EXPECT_THAT(errorOf({"--rdzv-backend", "zookeeper", "./t"}),
              HasSubstr("--rdzv-backend 'zookeeper'"));
  EXPECT_EQ(backendName(RdzvBackend::kEtcdV2), "etcd-v2");
}

TEST(ElasticOptions, Endpoints) {
  auto ep = [](const std::string& s) {
    return parse({"--rdzv-backend", "c10d", "--rdzv-endpoint", s, "./t"})
        .rdzvEndpoint;
  };
  EXPECT_EQ(ep("host"), (Endpoint{"host", 29400}));
  EXPECT_EQ(ep("host:0"), (Endpoint{"host", 0}));
  EXPECT_EQ(ep("[fe80::1]:77"), (Endpoint{"fe80::1", 77}));
  EXPECT_EQ(ep("[fe80::1]:77").toString(), "[fe80::1]:77");
  EXPECT_EQ(ep("10.1.2.3:65535").toString(), "10.1.2.3:65535");
  for (const char* bad : {"host:65536", "host:-1", "host:x", ":80", "fe80::1",
                          "[::1", "[]:1", "[::1]80", "host:"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(
        errorOf({"--rdzv-backend", "c10d", "--rdzv-endpoint", bad, "./t"}),
        HasSubstr("--rdzv-endpoint '" + std::string(bad) + "'"));
  }
  EXPECT_THAT(errorOf({"--master-port", "0", "./t"}),
              HasSubstr("--master-port '0'"));
  EXPECT_THAT(errorOf({"--master-port", "70000", "./t"}),
              HasSubstr("--master-port '70000'"));
  EXPECT_EQ(parse({"--master-addr", "[::1]", "./t"}).rdzvEndpoint,
            (Endpoint{"::1", 29500}));
}

TEST(ElasticOptions, Standalone) {
  const ElasticOptions o =
      parse({"--standalone", "--nproc-per-node", "2", "./t"});
  EXPECT_TRUE(o.standalone);
  EXPECT_EQ(o.rdzvBackend, RdzvBackend::kC10d);
  EXPECT_EQ(o.rdzvEndpoint, (Endpoint{"localhost", 0}));
  EXPECT_EQ(o.rdzvId, "run-fixed");
  // The real context makes a UUID.
  const ElasticOptions real =
      parseOptions(std::vector<std::string>{"--standalone", "./t"}, [] {
        ParseContext c = ParseContext::fromProcess();
        c.env.clear();
        return c;
      }());
  EXPECT_EQ(real.rdzvId.size(), 36u);
  EXPECT_EQ(real.rdzvId[14], '4');

  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{
           {"--rdzv-endpoint", "h:1"},
           {"--rdzv-backend", "c10d"},
           {"--rdzv-id", "x"}}) {
    SCOPED_TRACE(flag);
    const std::string e = errorOf({"--standalone", flag, value, "./t"});
    EXPECT_THAT(e, HasSubstr("--standalone"));
    EXPECT_THAT(e, HasSubstr(flag + " '" + value + "'"));
  }
  const std::string e = errorOf({"--standalone", "--nnodes", "1:2", "./t"});
  EXPECT_THAT(e, HasSubstr("--standalone"));
  EXPECT_THAT(e, HasSubstr("--nnodes '1:2'"));
  EXPECT_THAT(
      errorOf({"./t"}, {{"PET_STANDALONE", "1"}, {"PET_RDZV_ENDPOINT", "h:1"}}),
      HasSubstr("PET_RDZV_ENDPOINT='h:1' (--rdzv-endpoint)"));
}

TEST(ElasticOptions, RdzvConf) {
  const ElasticOptions o =
      parse({"--rdzv-backend", "c10d", "--rdzv-conf",
             "join_timeout=900, last_call_timeout=10,close_timeout=5,"
             "read_timeout=120,timeout=30,is_host=1,",
             "./t"});
  EXPECT_EQ(o.rdzvConf.joinTimeout, std::chrono::seconds(900));
  EXPECT_EQ(o.rdzvConf.lastCallTimeout, std::chrono::seconds(10));
  EXPECT_EQ(o.rdzvConf.closeTimeout, std::chrono::seconds(5));
  EXPECT_EQ(o.rdzvConf.readTimeout, std::chrono::seconds(120));
  EXPECT_EQ(o.rdzvConf.timeout, std::chrono::seconds(30));
  EXPECT_EQ(o.rdzvConf.isHost, true);
  EXPECT_EQ(parse({"--rdzv-conf", "", "./t"}).rdzvConf, RdzvConf{});
  const ElasticOptions k =
      parse({"--rdzv-conf",
             "keep_alive_interval=2,keep_alive_max_attempt=4,"
             "exit_barrier_timeout=60",
             "./t"});
  EXPECT_EQ(k.rdzvConf.keepAliveInterval, std::chrono::seconds(2));
  EXPECT_EQ(k.rdzvConf.keepAliveMaxAttempt, 4);
  EXPECT_EQ(k.rdzvConf.exitBarrierTimeout, std::chrono::seconds(60));

  const std::string unknown = errorOf({"--rdzv-conf", "keep_alive=3", "./t"});
  EXPECT_THAT(unknown, HasSubstr("--rdzv-conf 'keep_alive=3'"));
  EXPECT_THAT(unknown, HasSubstr("unknown key 'keep_alive'"));
  for (const char* bad :
       {"join_timeout=0", "join_timeout=-5", "join_timeout=1.5",
        "read_timeout=abc", "is_host=maybe", "timeout", "=3",
        "timeout=", "timeout=1,timeout=2", "keep_alive_max_attempt=0",
        "keep_alive_interval=0", "exit_barrier_timeout=x"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(errorOf({"--rdzv-conf", bad, "./t"}),
                HasSubstr("--rdzv-conf '" + std::string(bad) + "'"));
  }
}

TEST(ElasticOptions, RedirectsAndTee) {
  const ElasticOptions o = parse({"-r", "2", "-t", "0:3,10:1", "./t"});
  EXPECT_EQ(o.redirects.forRank(5), Streams::kErr);
  EXPECT_EQ(o.tee.forRank(0), Streams::kAll);
  EXPECT_EQ(o.tee.forRank(10), Streams::kOut);
  EXPECT_EQ(o.tee.forRank(1), Streams::kNone);
  for (const char* bad :
       {"4", "-1", "x", "", "0:4", "0:1,0:2", "a:1", "0:1,"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(errorOf({"--redirects", bad, "./t"}),
                HasSubstr("--redirects '" + std::string(bad) + "'"));
    EXPECT_THAT(errorOf({"--tee=" + std::string(bad), "./t"}),
                HasSubstr("--tee '" + std::string(bad) + "'"));
  }
}

TEST(ElasticOptions, OtherValueErrorsNameTheFlag) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--max-restarts", "-1"},
      {"--max-restarts", "x"},
      {"--monitor-interval", "0"},
      {"--monitor-interval", "-1"},
      {"--monitor-interval", "nan"},
      {"--monitor-interval", "1s"},
      {"--start-method", "thread"},
      {"--role", ""},
      {"--rdzv-id", " "},
      {"--log-dir", ""},
      {"--local-addr", ""},
      {"--master-addr", ""},
      {"--local-ranks-filter", "0,-1"},
      {"--local-ranks-filter", "0,,1"},
      {"--local-ranks-filter", "a"},
  };
  for (const auto& [flag, value] : bad) {
    SCOPED_TRACE(flag + " " + value);
    EXPECT_THAT(errorOf({flag, value, "./t"}),
                HasSubstr(flag + " '" + value + "'"));
  }
}

TEST(ElasticOptions, MasterFlagsWithADynamicBackendWarn) {
  const ElasticOptions o =
      parse({"--rdzv-backend", "c10d", "--master-port", "1234", "./t"});
  ASSERT_EQ(o.warnings.size(), 1u);
  EXPECT_THAT(o.warnings[0], HasSubstr("--master-port '1234'"));
}

TEST(ElasticOptions, ArgcArgvOverload) {
  const char* argv[] = {"elastic-run", "--nproc-per-node", "2", "./t", "x"};
  const ElasticOptions o = parseOptions(5, argv, context());
  EXPECT_EQ(o.nprocPerNode, 2);
  EXPECT_THAT(o.workerArgv, ElementsAre("./t", "x"));
}

TEST(ElasticOptions, ProcessContextProbes) {
  const ParseContext c = ParseContext::fromProcess();
  EXPECT_GE(c.cpuCount(), 1);
  EXPECT_GE(c.gpuCount(), 0);
}

}  // namespace
}  // namespace trellis::elastic
