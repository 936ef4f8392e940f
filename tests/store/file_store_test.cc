// FileStore across real processes, including one SIGKILLed mid-write.
#include <fcntl.h>
#include <fstream>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "store_test_util.h"
#include <trellis/core/error.h>
#include <trellis/store/file_store.h>

namespace trellis::store {
namespace {

using namespace std::chrono_literals;
using testing::TempPath;
using testing::waitPid;

// Runs `body` in a forked child that exits 0 on success, 1 on an exception.
template <typename F>
pid_t spawn(F&& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 0;
    try {
      body();
    } catch (...) {
      rc = 1;
    }
    ::_exit(rc);
  }
  return pid;
}

int64_t fileSize(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST(FileStoreTest, SharedByProcessesCountsEveryAdd) {
  TempPath path("procs");
  FileStore parent(path.str(), 30s);
  constexpr int kProcs = 4;
  constexpr int kAdds = 50;
  std::vector<pid_t> kids;
  for (int i = 0; i < kProcs; ++i) {
    kids.push_back(spawn([&, i] {
      FileStore s(path.str(), 30s);
      for (int j = 0; j < kAdds; ++j) {
        s.add("counter", 1);
      }
      s.set("child" + std::to_string(i), std::to_string(::getpid()));
      s.wait({"go"});  // released by the parent through the file
    }));
  }
  std::vector<std::string> keys;
  for (int i = 0; i < kProcs; ++i) {
    keys.push_back("child" + std::to_string(i));
  }
  parent.wait(keys, 30s);
  parent.set("go", "1");
  for (pid_t pid : kids) {
    const int status = waitPid(pid, 30s);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  EXPECT_EQ(parent.getString("counter"), std::to_string(kProcs * kAdds));
  EXPECT_EQ(parent.numKeys(), kProcs + 2);
}

TEST(FileStoreTest, ProcessKilledMidWriteLeavesTheStoreConsistent) {
  TempPath path("torn");
  FileStore parent(path.str(), 30s);
  parent.set("before", "intact");
  parent.add("counter", 10);
  const int64_t sizeBefore = fileSize(path.str());

  // The child writes half a record (of a large value), then stops itself.
  const pid_t torn = spawn([&] {
    ::setenv(FileStore::kTornWriteEnv, "1", 1);
    FileStore s(path.str(), 30s);
    s.set("torn", std::string(64 * 1024, 't'));
  });
  const int stopped = waitPid(torn, 30s, WUNTRACED);
  ASSERT_TRUE(WIFSTOPPED(stopped)) << "child did not stop mid-write";
  EXPECT_GT(fileSize(path.str()), sizeBefore) << "half a record is on disk";

  // Writers queue behind the stopped child's lock...
  std::vector<pid_t> adders;
  for (int i = 0; i < 2; ++i) {
    adders.push_back(spawn([&] {
      FileStore s(path.str(), 30s);
      for (int j = 0; j < 20; ++j) {
        s.add("counter", 1);
      }
    }));
  }
  std::this_thread::sleep_for(100ms);
  // ...until it dies holding it, its record half written.
  ::kill(torn, SIGKILL);
  const int killed = waitPid(torn, 30s);
  ASSERT_TRUE(WIFSIGNALED(killed));
  EXPECT_EQ(WTERMSIG(killed), SIGKILL);
  for (pid_t pid : adders) {
    const int status = waitPid(pid, 30s);
    ASSERT_TRUE(WIFEXITED(status)) << status;
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }

  // The torn record is gone; everything else is there and consistent.
  EXPECT_FALSE(parent.check({"torn"}));
  EXPECT_EQ(parent.getString("before"), "intact");
  EXPECT_EQ(parent.getString("counter"), "50");
  FileStore fresh(path.str(), 30s);
  EXPECT_FALSE(fresh.check({"torn"}));
  EXPECT_EQ(fresh.getString("counter"), "50");
  EXPECT_EQ(fresh.numKeys(), 2);
  fresh.set("after", "ok");
  EXPECT_EQ(parent.getString("after"), "ok");
}

TEST(FileStoreTest, TornTailWithoutLaterWritersIsIgnoredByReaders) {
  TempPath path("tail");
  {
    FileStore s(path.str());
    s.set("a", "1");
  }
  // Append a record header promising more bytes than follow.
  {
    std::ofstream out(path.str(), std::ios::binary | std::ios::app);
    const char partial[] = {100, 0, 0, 0, 1, 2, 3, 4, 1, 1};
    out.write(partial, sizeof(partial));
  }
  FileStore s(path.str(), 100ms);
  EXPECT_EQ(s.getString("a"), "1");
  EXPECT_EQ(s.numKeys(), 1);
  s.set("b", "2");  // truncates the torn tail, then appends
  FileStore again(path.str());
  EXPECT_EQ(again.getString("b"), "2");
  EXPECT_EQ(again.numKeys(), 2);
}

TEST(FileStoreTest, CorruptRecordStopsReplayAtThatRecord) {
  TempPath path("crc");
  {
    FileStore s(path.str());
    s.set("a", "1");
    s.set("b", "2");
  }
  // Flip the last byte (inside the last record's body).
  {
    const int fd = ::open(path.str().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t end = ::lseek(fd, 0, SEEK_END);
    char c = 0;
    ASSERT_EQ(::pread(fd, &c, 1, end - 1), 1);
    c ^= 0x5A;
    ASSERT_EQ(::pwrite(fd, &c, 1, end - 1), 1);
    ::close(fd);
  }
  FileStore s(path.str(), 100ms);
  EXPECT_EQ(s.getString("a"), "1");
  EXPECT_FALSE(s.check({"b"}));
}

TEST(FileStoreTest, RejectsAFileThatIsNotAStore) {
  TempPath path("foreign");
  {
    std::ofstream out(path.str());
    out << "this is not a store file";
  }
  EXPECT_THROW(FileStore s(path.str()), InvalidArgumentError);
}

TEST(FileStoreTest, UnopenablePathIsAnError) {
  EXPECT_THROW(FileStore s("/nonexistent-dir/for/sure/store"), Exception);
}

}  // namespace
}  // namespace trellis::store
