// TRELLIS_SPIN_US: the process-wide polling budget, read once.

#include <cstdlib>

#include <gtest/gtest.h>

#include <trellis/core/spin.h>

namespace trellis {
namespace {

// Each case runs in a child process (a death-test fork), since the budget
// is read once per process.
void expectBudget(const char* value, int64_t wantUs) {
  EXPECT_EXIT(
      {
        if (value == nullptr) {
          ::unsetenv("TRELLIS_SPIN_US");
        } else {
          ::setenv("TRELLIS_SPIN_US", value, 1);
        }
        const auto us =
            std::chrono::duration_cast<std::chrono::microseconds>(spinBudget())
                .count();
        std::_Exit(us == wantUs ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "")
      << "TRELLIS_SPIN_US=" << (value == nullptr ? "(unset)" : value);
}

TEST(SpinBudgetTest, DefaultAndValidValues) {
  expectBudget(nullptr, 50);
  expectBudget("", 50);
  expectBudget("0", 0);
  expectBudget("200", 200);
  expectBudget("100000", 100000);
}

TEST(SpinBudgetTest, InvalidValuesFallBackToTheDefaultAndSaySo) {
  for (const char* bad : {"-1", "12x", "abc", "100001", "1e3"}) {
    EXPECT_EXIT(
        {
          ::setenv("TRELLIS_SPIN_US", bad, 1);
          const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                              spinBudget())
                              .count();
          std::_Exit(us == 50 ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "TRELLIS_SPIN_US='.*' is not a number")
        << bad;
  }
}

}  // namespace
}  // namespace trellis
