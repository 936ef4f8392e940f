#include <chrono>
#include <filesystem>
#include <fstream>
#include <signal.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/elastic/checkpoint.h>

namespace trellis::elastic {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

struct TempDir {
  fs::path path = fs::temp_directory_path() /
                  ("trellis-ckpt-" + std::to_string(::getpid()) + "-" +
                   std::to_string(reinterpret_cast<uintptr_t>(this)));
  ~TempDir() { trellis::removeTree(path); }
};

torch::nn::Sequential model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(),
                               torch::nn::BatchNorm1d(8),
                               torch::nn::Linear(8, 1));
}

// One Adam step, so the optimizer has state (moments, step counts).
void train(torch::nn::Sequential& m, torch::optim::Adam& opt, int seed) {
  torch::manual_seed(seed);
  opt.zero_grad();
  m->forward(torch::randn({16, 4})).pow(2).mean().backward();
  opt.step();
}

void saveStep(Checkpoints& c, int64_t step, torch::nn::Sequential& m,
              torch::optim::Adam& opt) {
  c.save(step, [&](torch::serialize::OutputArchive& a) {
    saveModule(a, "model", *m);
    saveOptimizer(a, "optim", opt);
    a.write("step", c10::IValue(step));
  });
}

void expectSameParameters(const torch::nn::Module& a,
                          const torch::nn::Module& b) {
  const auto pa = a.named_parameters();
  const auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  }
  const auto ba = a.named_buffers();
  const auto bb = b.named_buffers();
  for (const auto& item : ba) {
    EXPECT_TRUE(torch::equal(item.value(), bb[item.key()])) << item.key();
  }
}

TEST(Checkpoints, ARestoredModelAndOptimizerContinueExactlyAsTheOriginal) {
  TempDir dir;
  Checkpoints c({.dir = dir.path});
  EXPECT_FALSE(c.loadLatest().has_value());
  auto m = model();
  torch::optim::Adam opt(m->parameters(), 0.01);
  train(m, opt, 1);
  saveStep(c, 7, m, opt);

  auto restored = model();
  torch::optim::Adam ropt(restored->parameters(), 0.01);
  auto last = c.loadLatest();
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->step, 7);
  EXPECT_EQ(last->path.filename(), "checkpoint-000000000007.ckpt");
  loadModule(last->archive, "model", *restored);
  loadOptimizer(last->archive, "optim", ropt);
  c10::IValue step;
  last->archive.read("step", step);
  EXPECT_EQ(step.toInt(), 7);
  expectSameParameters(*m, *restored);
  // The optimizer's state came back too: one more identical step on each
  // gives identical parameters (Adam's moments decide the update).
  train(m, opt, 2);
  train(restored, ropt, 2);
  expectSameParameters(*m, *restored);
}

TEST(Checkpoints, KeepsTheLastKAndLoadsTheNewestByStepNotByName) {
  TempDir dir;
  Checkpoints c({.dir = dir.path, .prefix = "rank3", .keepLast = 2});
  auto m = model();
  torch::optim::Adam opt(m->parameters(), 0.01);
  for (int64_t step : {9, 10, 100, 1000}) {
    saveStep(c, step, m, opt);
  }
  EXPECT_EQ(c.steps(), (std::vector<int64_t>{100, 1000}));
  EXPECT_EQ(c.loadLatest()->step, 1000);
  // load(step): exactly that one, or none.
  EXPECT_EQ(c.load(100)->step, 100);
  EXPECT_FALSE(c.load(10).has_value());  // pruned
  EXPECT_FALSE(c.load(-1).has_value());
  // Why not, naming the file.
  std::string why;
  EXPECT_FALSE(c.load(10, std::nullopt, &why).has_value());
  EXPECT_EQ(why, (dir.path / "rank3-000000000010.ckpt").string() +
                     " does not exist");
  // Another prefix in the same directory is left alone.
  Checkpoints other({.dir = dir.path, .prefix = "rank4", .keepLast = 1});
  saveStep(other, 5, m, opt);
  saveStep(other, 6, m, opt);
  EXPECT_EQ(c.steps(), (std::vector<int64_t>{100, 1000}));
  EXPECT_EQ(other.steps(), (std::vector<int64_t>{6}));
}

// Each kind of damage makes loadLatest() fall back to the one before.
TEST(Checkpoints, DamagedNewestIsSkippedForTheOneBefore) {
  auto m = model();
  torch::optim::Adam opt(m->parameters(), 0.01);
  struct Case {
    const char* what;
    std::function<void(const fs::path&)> damage;
  };
  const std::vector<Case> cases = {
      {"truncated in the data",
       [](const fs::path& p) { fs::resize_file(p, fs::file_size(p) - 10); }},
      {"truncated in the header",
       [](const fs::path& p) { fs::resize_file(p, 20); }},
      {"a flipped byte",
       [](const fs::path& p) {
         std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(static_cast<std::streamoff>(fs::file_size(p) / 2));
         f.put('\x5a');
       }},
      {"empty", [](const fs::path& p) { fs::resize_file(p, 0); }},
      {"another file under the name",
       [](const fs::path& p) {
         std::ofstream(p, std::ios::trunc) << std::string(200, 'x');
       }},
  };
  for (const auto& k : cases) {
    TempDir dir;
    Checkpoints c({.dir = dir.path});
    saveStep(c, 1, m, opt);
    const fs::path newest = c.save(2, [&](torch::serialize::OutputArchive& a) {
      saveModule(a, "model", *m);
    });
    k.damage(newest);
    auto last = c.loadLatest();
    ASSERT_TRUE(last.has_value()) << k.what;
    EXPECT_EQ(last->step, 1) << k.what;
    std::string why;
    EXPECT_FALSE(c.load(2, std::nullopt, &why).has_value()) << k.what;
    EXPECT_EQ(why.rfind(newest.string() + ": ", 0), 0u) << k.what << ": " << why;
  }
  // A file renamed to another step's name is refused: its header says
  // otherwise.
  TempDir dir;
  Checkpoints c({.dir = dir.path});
  const fs::path one = c.save(
      1, [&](torch::serialize::OutputArchive& a) { saveModule(a, "m", *m); });
  fs::rename(one, dir.path / "checkpoint-000000000005.ckpt");
  EXPECT_FALSE(c.loadLatest().has_value());
  std::string why;
  EXPECT_FALSE(c.load(5, std::nullopt, &why).has_value());
  EXPECT_NE(why.find("records step 1"), std::string::npos) << why;
}

TEST(Checkpoints, BadOptionsAndStepsAreRefusedNamingThem) {
  TempDir dir;
  auto refused = [](CheckpointOptions o, const std::string& words) {
    try {
      Checkpoints c(std::move(o));
      ADD_FAILURE() << "accepted; wanted " << words;
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(e.error().message().find(words), std::string::npos) << e.what();
    }
  };
  refused({.dir = ""}, "dir is empty");
  refused({.dir = dir.path, .prefix = "a/b"}, "prefix 'a/b'");
  refused({.dir = dir.path, .prefix = ".hidden"}, "prefix '.hidden'");
  refused({.dir = dir.path, .keepLast = 0}, "keepLast is 0");
  Checkpoints c({.dir = dir.path});
  EXPECT_THROW(c.save(-1, [](auto&) {}), InvalidArgumentError);
  // A directory that cannot be created names the path.
  std::ofstream(dir.path / "file") << "x";
  try {
    Checkpoints bad({.dir = dir.path / "file" / "sub"});
    ADD_FAILURE() << "a directory under a regular file was accepted";
  } catch (const Exception& e) {
    EXPECT_NE(std::string(e.what()).find("create directory"), std::string::npos)
        << e.what();
  }
}

// A writer SIGKILLed while saving, again and again: every time, what is
// left loads, and it is one of the checkpoints the writer finished.
TEST(Checkpoints, AWriterKilledMidSaveLeavesTheLastWholeOne) {
  TempDir dir;
  for (int round = 0; round < 5; ++round) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Large enough that a save takes a while: the kill lands inside one.
      torch::nn::Linear big(1024, 1024);
      Checkpoints c({.dir = dir.path, .keepLast = 2});
      for (int64_t step = 1000 * round;; ++step) {
        c.save(step, [&](torch::serialize::OutputArchive& a) {
          saveModule(a, "big", *big);
          a.write("step", c10::IValue(step));
        });
      }
    }
    // Once this round's first save is in (a save takes 50-300 ms: longer
    // under ASan on a loaded machine), a little later: inside a save.
    Checkpoints watcher({.dir = dir.path});
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (watcher.steps().empty() || watcher.steps().back() < 1000 * round) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(child, SIGKILL);
        ::waitpid(child, nullptr, 0);
        FAIL() << "round " << round << ": no save within 30 s";
      }
      std::this_thread::sleep_for(5ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 37 * round));
    ASSERT_EQ(::kill(child, SIGKILL), 0);  // the child this test started
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status));
    Checkpoints reader({.dir = dir.path});
    auto last = reader.loadLatest();
    ASSERT_TRUE(last.has_value()) << "round " << round;
    c10::IValue step;
    last->archive.read("step", step);
    EXPECT_EQ(step.toInt(), last->step);
    EXPECT_GE(last->step, 1000 * round) << "round " << round;
    torch::nn::Linear check(1024, 1024);
    loadModule(last->archive, "big", *check);
  }
}

}  // namespace
}  // namespace trellis::elastic
