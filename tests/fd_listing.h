#pragma once
// Test helper: what `ls -l /proc/<pid>/fd` prints, read back as descriptor
// number -> target ("socket:[123]", "/dev/null", "pipe:[45]"). The tests
// that check what a child inherits (tests/job, tests/elastic) use it.
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

namespace trellis::testing {

inline std::map<int, std::string> parseFdListing(const std::string& text) {
  std::map<int, std::string> fds;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto arrow = line.find(" -> ");
    if (arrow == std::string::npos) {
      continue;  // "total 0"
    }
    const auto name = line.rfind(' ', arrow - 1);
    fds[std::atoi(line.c_str() + name + 1)] = line.substr(arrow + 4);
  }
  return fds;
}

}  // namespace trellis::testing
