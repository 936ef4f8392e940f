// trellis-flight-recorder: reads the flight-recorder dumps of a failed job
// (TRELLIS_FLIGHT_RECORDER_DIR) and prints, per process group, the first
// collective on which the ranks disagree, that some rank never entered, or
// that did not complete everywhere, naming the ranks
// (docs/collectives.md, "Flight recorder").
//
//   trellis-flight-recorder DIR|FILE...
//
// Exit status: 0 nothing wrong found, 1 a problem found, 2 bad usage or an
// unreadable dump.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <trellis/collectives/flight_report.h>

namespace {

namespace fs = std::filesystem;
using trellis::collectives::detail::Dump;

constexpr uintmax_t kMaxFileBytes = 1ull << 30;

int usage() {
  std::fprintf(stderr,
               "usage: trellis-flight-recorder DIR|FILE...\n"
               "  Compares the flight-recorder dumps (*.json) of the ranks of "
               "a job and\n  names the first collective they disagree on or "
               "got stuck in.\n");
  return 2;
}

bool readDump(const fs::path& path, std::vector<Dump>* dumps) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) {
    std::fprintf(stderr, "trellis-flight-recorder: %s: %s\n", path.c_str(),
                 ec.message().c_str());
    return false;
  }
  if (size > kMaxFileBytes) {
    std::fprintf(stderr,
                 "trellis-flight-recorder: %s: %ju bytes, more than a dump "
                 "can be (1 GiB)\n",
                 path.c_str(), size);
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    std::fprintf(stderr, "trellis-flight-recorder: %s: cannot read\n",
                 path.c_str());
    return false;
  }
  Dump d;
  if (auto e = trellis::collectives::detail::parseDump(text.str(), &d);
      !e.ok()) {
    std::fprintf(stderr, "trellis-flight-recorder: %s: %s\n", path.c_str(),
                 e.message().c_str());
    return false;
  }
  d.source = path.string();
  dumps->push_back(std::move(d));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    return usage();
  }
  std::vector<Dump> dumps;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      usage();
      return 0;
    }
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      std::vector<fs::path> files;
      for (const auto& entry : fs::directory_iterator(arg, ec)) {
        if (entry.path().extension() == ".json") {
          files.push_back(entry.path());
        }
      }
      std::sort(files.begin(), files.end());
      if (files.empty()) {
        std::fprintf(stderr, "trellis-flight-recorder: %s: no *.json files\n",
                     arg.c_str());
        return 2;
      }
      for (const auto& f : files) {
        if (!readDump(f, &dumps)) {
          return 2;
        }
      }
    } else if (!readDump(arg, &dumps)) {
      return 2;
    }
  }
  const auto report = trellis::collectives::detail::compareDumps(dumps);
  std::fputs(report.text.c_str(), stdout);
  return report.problem ? 1 : 0;
}
