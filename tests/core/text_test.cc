#include <array>
#include <cerrno>
#include <fcntl.h>
#include <fstream>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <gtest/gtest.h>

#include <trellis/core/pending_count.h>
#include <trellis/core/text.h>

namespace trellis {
namespace {

using namespace std::chrono_literals;

TEST(ParseDecimal, TakesWholeIntegersOnly) {
  EXPECT_EQ(parseDecimal("0"), 0);
  EXPECT_EQ(parseDecimal("42"), 42);
  EXPECT_EQ(parseDecimal("-7"), -7);
  EXPECT_EQ(parseDecimal("9223372036854775807"), INT64_MAX);
  EXPECT_EQ(parseDecimal("-9223372036854775808"), INT64_MIN);
  for (const char* bad : {"", "-", "+1", " 1", "1 ", "1x", "0x10", "1.0",
                          "9223372036854775808", "--1", "1e3"}) {
    EXPECT_EQ(parseDecimal(bad), std::nullopt) << "'" << bad << "'";
  }
}

TEST(CutWithNote, KeepsTheBoundAndSaysWhatWasCut) {
  std::string shortText = "fits";
  cutWithNote(shortText, 4);
  EXPECT_EQ(shortText, "fits");

  std::string s(1000, 'x');
  cutWithNote(s, 100);
  EXPECT_EQ(s.size(), 100u);
  EXPECT_EQ(s, std::string(100 - 31, 'x') + " ... [1000 bytes, the rest cut]");

  // A second cut names the length before the first.
  cutWithNote(s, 50, 1000);
  EXPECT_EQ(s, std::string(50 - 31, 'x') + " ... [1000 bytes, the rest cut]");

  // Below the note's own length only its start fits: never over the bound.
  std::string tiny(40, 'y');
  cutWithNote(tiny, 10);
  EXPECT_EQ(tiny, " ... [40 b");
  cutWithNote(tiny, 0);
  EXPECT_EQ(tiny, "");
}

TEST(ToHex, TwoLowercaseDigitsPerByte) {
  const std::array<uint8_t, 4> bytes{0x00, 0x0f, 0xa0, 0xff};
  EXPECT_EQ(toHex(bytes), "000fa0ff");
  EXPECT_EQ(toHex({}), "");
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

// A tree with files, an empty directory and a link out of it goes; what
// the link names stays. A missing path is already gone.
TEST(RemoveTree, RemovesEverythingUnderAPathButNotWhatALinkNames) {
  char base[] = "/tmp/trellis-remove-tree-XXXXXX";
  ASSERT_NE(::mkdtemp(base), nullptr);
  const std::string root = std::string(base) + "/root";
  const std::string outside = std::string(base) + "/outside";
  ASSERT_EQ(::mkdir(root.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir(outside.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((root + "/a").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((root + "/a/b").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((root + "/empty").c_str(), 0700), 0);
  std::ofstream(root + "/a/b/file") << "x";
  std::ofstream(root + "/top") << "y";
  std::ofstream(outside + "/kept") << "z";
  ASSERT_EQ(::symlink(outside.c_str(), (root + "/a/link").c_str()), 0);
  std::string why = "unset";
  EXPECT_TRUE(removeTree(root, &why));
  EXPECT_EQ(why, "");
  EXPECT_FALSE(exists(root));
  EXPECT_TRUE(exists(outside + "/kept"));
  EXPECT_TRUE(removeTree(root, &why)) << "a missing path is gone already";
  EXPECT_TRUE(removeTree(base));
  EXPECT_FALSE(exists(base));
}

// What cannot be removed (a file of /proc, even for root) is named.
TEST(RemoveTree, NamesWhatStayed) {
  std::string why;
  EXPECT_FALSE(removeTree("/proc/self/status", &why));
  EXPECT_NE(why.find("/proc/self/status"), std::string::npos) << why;
}

TEST(WriteAll, WritesEverythingAndReportsAClosedPipe) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string text(100'000, 'x');  // more than a pipe holds at once
  std::string got;
  std::thread reader([&] {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fds[0], buf, sizeof buf)) > 0) {
      got.append(buf, static_cast<size_t>(n));
    }
  });
  EXPECT_TRUE(writeAll(fds[1], text));
  ::close(fds[1]);
  reader.join();
  EXPECT_EQ(got, text);
  // Nobody reads any more: the write fails (EPIPE; SIGPIPE ignored here).
  ASSERT_EQ(::pipe(fds), 0);
  ::close(fds[0]);
  struct sigaction ignore {
  }, saved{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &saved);
  EXPECT_FALSE(writeAll(fds[1], "lost"));
  EXPECT_EQ(errno, EPIPE);
  ::sigaction(SIGPIPE, &saved, nullptr);
  ::close(fds[1]);
}

TEST(PendingCount, AwaitReturnsWhenTheLastEndsAndTimesOutOtherwise) {
  PendingCount p;
  EXPECT_TRUE(p.await(0ms));
  p.add();
  p.add();
  EXPECT_FALSE(p.await(20ms));
  std::thread t([&] {
    p.done();
    std::this_thread::sleep_for(20ms);
    p.done();
  });
  EXPECT_TRUE(p.await(10s));
  t.join();
}

}  // namespace
}  // namespace trellis
