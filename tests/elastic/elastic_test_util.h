#pragma once
// Helpers of the elastic-run tests that run real agents (elastic_run_test,
// elastic_multinode_test).
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <sys/wait.h>

namespace trellis::elastic::testing {

// The whole file; empty when it cannot be read.
inline std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// NAME=value lines (what the test worker writes of its environment).
inline std::map<std::string, std::string> readEnvFile(
    const std::filesystem::path& path) {
  std::map<std::string, std::string> env;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) {
      env[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return env;
}

// A wait status's exit code; -1 when the process was killed by a signal.
inline int exitCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace trellis::elastic::testing
