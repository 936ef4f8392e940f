#pragma once

// How elastic-run starts one worker (agent.h, "Workers"): its log streams
// (redirected, tee'd with a prefix, silenced or inherited) and fork + exec
// with the worker's environment, in its own process group, with
// PR_SET_PDEATHSIG, the agent's signals back to their defaults and no
// descriptor of the agent's but stdin, stdout and stderr. Internal to
// elastic/ (not installed).
//
// Thread safety: the agent's thread only.

#include <csignal>
#include <optional>
#include <string>
#include <sys/types.h>

#include <trellis/elastic/agent.h>
#include <trellis/elastic/group_keeper.h>
#include <trellis/elastic/options.h>
#include <trellis/elastic/worker_env.h>

namespace trellis::elastic {

// The signals Agent::run handles for its duration; a worker starts with
// their default actions.
inline constexpr int kAgentSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGCHLD,
                                        SIGPIPE};

// One tee'd stream of one worker: the pipe the agent reads, the log file
// it copies to, and the console it prefixes lines onto (-1: none).
struct Tee {
  int pipe = -1;
  int file = -1;
  int console = -1;
  std::string prefix;
  std::string partial;
};

// Reads what is there; returns false at EOF (the pipe is then closed).
bool pump(Tee& t);

struct Worker {
  WorkerExit exit;
  bool reaped = false;
  Tee tees[2];  // stdout, stderr
};

struct WorkerSpawn {
  const ElasticOptions& options;
  const AgentConfig& config;
  int32_t localRank = 0;
  std::string dir;  // the worker's log folder of this attempt
  Environment env;  // its whole environment
  pid_t agentPid = 0;
};

// Starts the worker `w` describes (w.exit.localRank etc. set by the
// caller): sets w.exit.pid and w.tees, tells the keeper its group. The
// message of an exec failure ("cannot run 'prog' (local rank 0): No such
// file or directory"), else nullopt. Throws the errno's Error when a log
// file, pipe or fork fails.
std::optional<std::string> startWorker(Worker& w, const WorkerSpawn& s,
                                       GroupKeeper& keeper);

}  // namespace trellis::elastic
