// A worker for job_test, started by elastic-run: trellis::init and
// Job::shutdown as a program uses them, one scenario per --mode. Prints
// what the test checks on stderr, as "rank R: ...".
//
//   hybrid        rank 0 is "ps", the others trainers in a group of their
//                 own: an allreduce among the trainers, an RPC to "ps"
//   throw         rank 1 throws out of main after init
//   unwind        rank 1 throws inside the Job's scope and catches it in
//                 main; rank 0 reports the job's exit code
//   world         expects one process more than were started
//   differ        rank 1 starts no RPC where rank 0 does
//   late          rank 1 sleeps 4 s before init; init bounds start-up at 1 s
//   exit-slow     rank 1 uses the job's store 1.5 s after rank 0 is done,
//                 then shuts down with code 3; rank 0 reports the job's code
//   exit-timeout  rank 1 stays 4 s; rank 0's exit barrier waits 1 s
//   fds           with RPC and a group running (rank 0 serving the store),
//                 lists the descriptors a program this worker starts would
//                 inherit: "rank R: inherited: none" or their targets
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "../fd_listing.h"

#include <trellis/trellis.h>

using namespace std::chrono_literals;

int64_t addTen(int64_t x) { return x + 10; }
TRELLIS_REMOTE_FUNCTION(addTen);

namespace {

void say(int rank, const std::string& what) {
  std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
  std::fflush(stderr);
}

int hybrid() {
  const auto env = trellis::WorkerEnv::fromEnvironment();
  std::vector<int> trainers;
  for (int r = 1; r < env.worldSize; ++r) {
    trainers.push_back(r);
  }
  auto job = trellis::init(
      {.rpcName = env.rank == 0 ? "ps" : "trainer" + std::to_string(env.rank),
       .groupRanks = trainers,
       .timeout = 20s});
  if (job.inGroup()) {
    auto t = torch::full({4}, static_cast<double>(job.rank()));
    job.group()->allreduce(t).wait();
    const int64_t reply = trellis::rpc::rpcSync<addTen>("ps", job.rank());
    say(job.rank(), "allreduce " + std::to_string(t[0].item<double>()) +
                        " group rank " + std::to_string(job.group()->rank()) +
                        " of " + std::to_string(job.group()->size()) + " rpc " +
                        std::to_string(reply));
  } else {
    say(job.rank(), "serving");
  }
  return job.shutdown();
}

int unwind() {
  try {
    auto job = trellis::init();
    if (job.rank() == 1) {
      throw std::runtime_error("rank 1 gives up");
    }
    say(0, "job exit code " + std::to_string(job.shutdown()));
    return 0;
  } catch (const std::exception& e) {
    say(1, std::string("caught: ") + e.what());
    return 0;
  }
}

int exitSlow() {
  auto job = trellis::init();
  if (job.rank() == 0) {
    say(0, "job exit code " + std::to_string(job.shutdown()));
    return 0;
  }
  std::this_thread::sleep_for(1500ms);
  job.store()->set("late", "still served");
  say(job.rank(), "store says " + job.store()->getString("late"));
  job.shutdown(3);
  return 0;
}

int exitTimeout() {
  auto job = trellis::init({.exitTimeout = 1s});
  if (job.rank() != 0) {
    std::this_thread::sleep_for(4s);
    return 0;
  }
  try {
    job.shutdown();
  } catch (const trellis::TimeoutError& e) {
    say(0, e.what());
    return 4;
  }
  return 0;
}

// What a child started now would inherit beyond stdin, stdout, stderr:
// popen's shell lists its own descriptors.
std::string inheritedDescriptors() {
  FILE* ls = ::popen("ls -l /proc/$$/fd", "r");
  if (ls == nullptr) {
    return "popen failed";
  }
  std::string listing;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), ls) != nullptr) {
    listing += buf;
  }
  ::pclose(ls);
  std::string found;
  for (const auto& [fd, target] : trellis::testing::parseFdListing(listing)) {
    if (fd > 2) {
      found += " " + std::to_string(fd) + "=" + target;
    }
  }
  return found.empty() ? " none" : found;
}

int fds() {
  const auto env = trellis::WorkerEnv::fromEnvironment();
  auto job = trellis::init({.rpcName = "w" + std::to_string(env.rank)});
  auto t = torch::ones({2});
  job.group()->allreduce(t).wait();  // the group's connections are up
  say(job.rank(), "inherited:" + inheritedDescriptors());
  return job.shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  const std::string mode = argc > 2 ? argv[2] : "";
  const auto env = trellis::WorkerEnv::fromEnvironment();
  if (mode == "hybrid") {
    return hybrid();
  }
  if (mode == "throw") {
    auto job = trellis::init();
    if (job.rank() == 1) {
      throw std::runtime_error("boom after init on rank 1");
    }
    return job.shutdown();
  }
  if (mode == "unwind") {
    return unwind();
  }
  if (mode == "world") {
    auto job = trellis::init({.worldSize = env.worldSize + 1});
    return 0;
  }
  if (mode == "differ") {
    auto job = trellis::init({.rpcName = env.rank == 0 ? "w0" : ""});
    return 0;
  }
  if (mode == "late") {
    if (env.rank == 1) {
      std::this_thread::sleep_for(4s);
    }
    auto job = trellis::init({.initTimeout = 1s});
    return 0;
  }
  if (mode == "exit-slow") {
    return exitSlow();
  }
  if (mode == "fds") {
    return fds();
  }
  if (mode == "exit-timeout") {
    return exitTimeout();
  }
  std::fprintf(stderr, "job_worker: unknown --mode '%s'\n", mode.c_str());
  return 2;
}
