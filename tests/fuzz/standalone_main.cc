// Runs a libFuzzer target over files and folders given on the command line,
// so that compilers without libFuzzer (gcc) still build every fuzz target and
// replay its seed corpus as a regression test. Exits non-zero when no input
// was found.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fs = std::filesystem;

static bool runFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", p.c_str());
    return false;
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  return true;
}

int main(int argc, char** argv) {
  size_t ran = 0;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    if (fs::is_directory(arg)) {
      for (const auto& entry : fs::directory_iterator(arg)) {
        if (entry.is_regular_file() && runFile(entry.path())) {
          ++ran;
        }
      }
    } else if (runFile(arg)) {
      ++ran;
    }
  }
  std::printf("replayed %zu inputs\n", ran);
  return ran > 0 ? 0 : 1;
}
