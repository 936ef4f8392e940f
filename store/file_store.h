#pragma once

// FileStore: a Store kept in one file, shared by processes on one host or on
// a shared filesystem that honours flock() (docs/store.md, "FileStore").
//
// The file is an append-only log of checksummed records. Writers append
// under an exclusive flock; readers replay new records under a shared one.
// A record torn by a process killed mid-write fails its length or checksum
// check: readers ignore it and the next writer truncates it away, so the
// store stays readable and consistent. Blocking calls (get, multiGet, wait)
// poll the file with a backoff from 1 ms to 50 ms, so a waiter wakes at
// most ~50 ms after the key is written. The file grows with every write (no
// compaction) and is left in place when the store is destroyed.
//
// Thread-safe; any number of FileStore objects (in one or many processes)
// may share a path.

#include <memory>

#include <trellis/store/store.h>

namespace trellis::store {

class FileStore final : public Store {
 public:
  // Opens (creating if needed) `path`. Throws InvalidArgumentError when the
  // file exists but is not a Trellis file store, or the OS error (as its
  // typed exception) when it cannot be opened.
  explicit FileStore(std::string path,
                     std::chrono::milliseconds timeout = kDefaultTimeout);
  ~FileStore() override;

  const std::string& path() const;

  using Store::compareSet;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, std::span<const uint8_t> value) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, std::span<const uint8_t> expected,
                   std::span<const uint8_t> desired) override;
  [[nodiscard]] bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<Bytes>& values) override;

  // Test hook: when the environment variable
  // TRELLIS_FILE_STORE_TEST_TORN_WRITE is "1" at construction, the first
  // write of this object writes half of its record and then stops the
  // process with SIGSTOP, so a test can SIGKILL it mid-write.
  static constexpr const char* kTornWriteEnv =
      "TRELLIS_FILE_STORE_TEST_TORN_WRITE";

 protected:
  Bytes getWithTimeout(const std::string& key,
                       std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trellis::store
