#include <string>

#include <gtest/gtest.h>

#include <trellis/core/ids.h>
#include <trellis/core/logging.h>

namespace trellis {
namespace {

TEST(LoggingTest, ParsesLevelsCaseInsensitively) {
  EXPECT_EQ(log::parseLevel("debug"), spdlog::level::debug);
  EXPECT_EQ(log::parseLevel("WARN"), spdlog::level::warn);
  EXPECT_EQ(log::parseLevel("Warning"), spdlog::level::warn);
  EXPECT_EQ(log::parseLevel("off"), spdlog::level::off);
  EXPECT_FALSE(log::parseLevel("verbose").has_value());
  EXPECT_FALSE(log::parseLevel("").has_value());
}

TEST(LoggingTest, BadEnvValueKeepsDefaultAndSaysWhy) {
  // The logger reads TRELLIS_LOG_LEVEL once; this runs in a child so that the
  // value under test is the one it sees first. "threadsafe": the child is
  // a fresh run of this binary, not a fork of a process whose earlier tests
  // (the whole binary run at once) made the logger already.
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TRELLIS_LOG_LEVEL", "loud", 1);
        TRELLIS_LOG_WARN("after bad level");
        std::exit(log::logger().level() == spdlog::level::warn ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "ignoring TRELLIS_LOG_LEVEL='loud': expected one of trace, debug");
  GTEST_FLAG_SET(death_test_style, style);
}

TEST(IdsTest, HierarchicalIds) {
  IdAllocator agent("agent.w3");
  EXPECT_EQ(agent.next("pipe"), "agent.w3.pipe0");
  EXPECT_EQ(agent.next("pipe"), "agent.w3.pipe1");
  IdAllocator root("");
  EXPECT_EQ(root.next("ctx"), "ctx0");
}

}  // namespace
}  // namespace trellis
