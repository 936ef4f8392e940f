// FileStore: an append-only log of checksummed records (format in
// docs/store.md). Each object replays the log incrementally into a map.
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <utility>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/core/wire.h>
#include <trellis/store/file_store.h>

namespace trellis::store {

namespace {

constexpr std::array<uint8_t, 4> kFileMagic = {'T', 'R', 'F', 'S'};
constexpr uint32_t kFileVersion = 1;
constexpr size_t kHeaderBytes = 8;
constexpr size_t kRecordHeaderBytes = 8;  // fixed32 length, fixed32 crc32c
// Larger lengths can only come from a torn or foreign record.
constexpr uint32_t kMaxRecordBytes = 1u << 30;
constexpr std::chrono::milliseconds kFirstPoll{1};
constexpr std::chrono::milliseconds kMaxPoll{50};

enum RecordType : uint8_t { kSet = 1, kDelete = 2, kMultiSet = 3 };

// CRC-32C (Castagnoli), reflected, table-driven.
constexpr std::array<uint32_t, 256> makeCrcTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    t[i] = c;
  }
  return t;
}
constexpr auto kCrcTable = makeCrcTable();

uint32_t crc32c(std::span<const uint8_t> data) {
  uint32_t c = 0xFFFFFFFFu;
  for (uint8_t b : data) {
    c = kCrcTable[(c ^ b) & 0xFF] ^ (c >> 8);
  }
  return c ^ 0xFFFFFFFFu;
}

uint32_t loadLe32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

void storeLe32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

[[noreturn]] void throwErrno(int err, const std::string& what) {
  throwError(Error::fromErrno(err, what));
}

}  // namespace

struct FileStore::Impl {
  std::string path;
  int fd = -1;
  bool tornWriteHook = false;

  Mutex mu;  // held while this object holds the flock
  std::unordered_map<std::string, Bytes> data TRELLIS_GUARDED_BY(mu);
  // End of the records replayed.
  uint64_t pos TRELLIS_GUARDED_BY(mu) = kHeaderBytes;

  // flock() on this object's descriptor; released on destruction.
  class FileLock {
   public:
    FileLock(Impl& impl, int op) : impl_(impl) {
      while (::flock(impl_.fd, op) != 0) {
        if (errno != EINTR) {
          throwErrno(errno, "locking file store " + impl_.path);
        }
      }
    }
    ~FileLock() { ::flock(impl_.fd, LOCK_UN); }

   private:
    Impl& impl_;
  };

  uint64_t fileSize() {
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      throwErrno(errno, "stat of file store " + path);
    }
    return static_cast<uint64_t>(st.st_size);
  }

  void readAt(uint8_t* out, size_t n, uint64_t off) {
    while (n > 0) {
      const ssize_t r = ::pread(fd, out, n, static_cast<off_t>(off));
      if (r < 0 && errno == EINTR) {
        continue;
      }
      if (r < 0) {
        throwErrno(errno, "reading file store " + path);
      }
      if (r == 0) {
        throw InternalError(
            Error::internal("file store " + path + " shrank while locked"));
      }
      out += r;
      n -= static_cast<size_t>(r);
      off += static_cast<uint64_t>(r);
    }
  }

  void writeAt(const uint8_t* in, size_t n, uint64_t off) {
    while (n > 0) {
      const ssize_t w = ::pwrite(fd, in, n, static_cast<off_t>(off));
      if (w < 0 && errno == EINTR) {
        continue;
      }
      if (w < 0) {
        throwErrno(errno, "writing file store " + path);
      }
      in += w;
      n -= static_cast<size_t>(w);
      off += static_cast<uint64_t>(w);
    }
  }

  // Under an exclusive lock: writes the header into an empty (or torn,
  // shorter than a header) file, or checks the one that is there.
  void initFile() {
    FileLock lock(*this, LOCK_EX);
    const uint64_t size = fileSize();
    std::array<uint8_t, kHeaderBytes> hdr{};
    if (size < kHeaderBytes) {
      if (::ftruncate(fd, 0) != 0) {
        throwErrno(errno, "truncating file store " + path);
      }
      std::copy(kFileMagic.begin(), kFileMagic.end(), hdr.begin());
      storeLe32(hdr.data() + 4, kFileVersion);
      writeAt(hdr.data(), hdr.size(), 0);
      return;
    }
    readAt(hdr.data(), hdr.size(), 0);
    if (!std::equal(kFileMagic.begin(), kFileMagic.end(), hdr.begin())) {
      throw InvalidArgumentError(Error::invalidArgument(
          path + " is not a Trellis file store (bad magic)"));
    }
    if (loadLe32(hdr.data() + 4) != kFileVersion) {
      throw InvalidArgumentError(Error::invalidArgument(
          path + " is a file store of unsupported version " +
          std::to_string(loadLe32(hdr.data() + 4))));
    }
  }

  // Applies one record body; false when it does not decode (a corrupt
  // record that happens to pass its checksum is treated as the log's end).
  bool apply(std::span<const uint8_t> body) TRELLIS_REQUIRES(mu) {
    wire::WireReader r(body, "file store record");
    const uint8_t type = r.u8("type");
    auto readPair = [&](std::vector<std::pair<std::string, Bytes>>& out) {
      auto k = r.string(kMaxRecordBytes, "key");
      auto v = r.bytes(kMaxRecordBytes, "value");
      out.emplace_back(std::string(k), Bytes(v.begin(), v.end()));
    };
    std::vector<std::pair<std::string, Bytes>> sets;
    std::string deleted;
    if (type == kSet) {
      readPair(sets);
    } else if (type == kDelete) {
      deleted = r.string(kMaxRecordBytes, "key");
    } else if (type == kMultiSet) {
      const uint64_t n = r.varint(body.size(), "count");
      for (uint64_t i = 0; i < n && r.ok(); ++i) {
        readPair(sets);
      }
    } else {
      return false;
    }
    r.expectEnd();
    if (!r.ok()) {
      return false;
    }
    if (type == kDelete) {
      data.erase(deleted);
    }
    for (auto& [k, v] : sets) {
      data[k] = std::move(v);
    }
    return true;
  }

  // Under a flock: reads the records written since the last replay. Stops
  // at the first incomplete or corrupt record (a torn tail).
  void replay() TRELLIS_REQUIRES(mu) {
    const uint64_t size = fileSize();
    if (size < pos) {
      // The file was truncated beneath us (recreated): start over.
      data.clear();
      pos = kHeaderBytes;
      if (size < pos) {
        return;
      }
    }
    if (size == pos) {
      return;
    }
    Bytes buf(size - pos);
    readAt(buf.data(), buf.size(), pos);
    size_t off = 0;
    while (buf.size() - off >= kRecordHeaderBytes) {
      const uint32_t len = loadLe32(buf.data() + off);
      const uint32_t crc = loadLe32(buf.data() + off + 4);
      if (len > kMaxRecordBytes ||
          buf.size() - off - kRecordHeaderBytes < len) {
        break;
      }
      std::span<const uint8_t> body(buf.data() + off + kRecordHeaderBytes, len);
      if (crc32c(body) != crc || !apply(body)) {
        break;
      }
      off += kRecordHeaderBytes + len;
    }
    pos += off;
  }

  // Under an exclusive flock, after replay(): drops a torn tail, appends.
  void append(const Bytes& body) TRELLIS_REQUIRES(mu) {
    if (body.size() > kMaxRecordBytes) {
      throw InvalidArgumentError(Error::invalidArgument(
          "file store record of " + std::to_string(body.size()) +
          " bytes exceeds the limit of " + std::to_string(kMaxRecordBytes)));
    }
    if (fileSize() > pos && ::ftruncate(fd, static_cast<off_t>(pos)) != 0) {
      throwErrno(errno, "truncating the torn tail of file store " + path);
    }
    Bytes rec(kRecordHeaderBytes + body.size());
    storeLe32(rec.data(), static_cast<uint32_t>(body.size()));
    storeLe32(rec.data() + 4, crc32c(body));
    std::memcpy(rec.data() + kRecordHeaderBytes, body.data(), body.size());
    if (tornWriteHook) {
      tornWriteHook = false;
      const size_t half = rec.size() / 2;
      writeAt(rec.data(), half, pos);
      ::raise(SIGSTOP);
      writeAt(rec.data() + half, rec.size() - half, pos + half);
    } else {
      writeAt(rec.data(), rec.size(), pos);
    }
    pos += rec.size();
    const bool applied = apply(body);
    (void)applied;
  }

  static Bytes setRecord(const std::string& key,
                         std::span<const uint8_t> value) {
    wire::WireWriter w;
    w.reserve(key.size() + value.size() + 12);
    w.putU8(kSet);
    w.putString(key);
    w.putBytes(value);
    return w.release();
  }

  bool allPresent(const std::vector<std::string>& keys) const
      TRELLIS_REQUIRES(mu) {
    for (const auto& k : keys) {
      if (!data.contains(k)) {
        return false;
      }
    }
    return true;
  }

  // Polls until every key exists, then runs `onReady(data)` under the lock
  // (the map is passed in: the analysis cannot see that a lambda runs
  // under the lock).
  template <typename F>
  void pollFor(const std::vector<std::string>& keys,
               std::chrono::milliseconds timeout, std::string_view op,
               F&& onReady) TRELLIS_EXCLUDES(mu) {
    detail::checkTimeout(timeout);
    const Deadline deadline = Deadline::fromTimeout(timeout);
    auto delay = kFirstPoll;
    for (;;) {
      {
        MutexLock g(mu);
        FileLock lock(*this, LOCK_SH);
        replay();
        if (allPresent(keys)) {
          onReady(std::as_const(data));
          return;
        }
      }
      if (deadline.expired()) {
        throw TimeoutError(
            Error::timeout(detail::timeoutMessage(op, keys, timeout)));
      }
      std::this_thread::sleep_for(
          std::min<Duration>(delay, deadline.remaining()));
      delay = std::min(delay * 2, kMaxPoll);
    }
  }
};

FileStore::FileStore(std::string path, std::chrono::milliseconds timeout)
    : Store(timeout), impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->fd = ::open(impl_->path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (impl_->fd < 0) {
    throwErrno(errno, "opening file store " + impl_->path);
  }
  const char* hook = std::getenv(kTornWriteEnv);
  impl_->tornWriteHook = hook != nullptr && std::strcmp(hook, "1") == 0;
  try {
    impl_->initFile();
  } catch (...) {
    ::close(impl_->fd);
    throw;
  }
}

FileStore::~FileStore() { ::close(impl_->fd); }

const std::string& FileStore::path() const { return impl_->path; }

void FileStore::set(const std::string& key, std::span<const uint8_t> value) {
  const Bytes rec = Impl::setRecord(key, value);
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_EX);
  impl_->replay();
  impl_->append(rec);
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_EX);
  impl_->replay();
  auto it = impl_->data.find(key);
  const int64_t result = detail::addToCounter(
      key, it == impl_->data.end() ? nullptr : &it->second, delta);
  impl_->append(Impl::setRecord(key, detail::toBytes(std::to_string(result))));
  return result;
}

Bytes FileStore::compareSet(const std::string& key,
                            std::span<const uint8_t> expected,
                            std::span<const uint8_t> desired) {
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_EX);
  impl_->replay();
  auto it = impl_->data.find(key);
  if (it == impl_->data.end()) {
    if (!expected.empty()) {
      return Bytes(expected.begin(), expected.end());
    }
  } else if (!std::equal(it->second.begin(), it->second.end(), expected.begin(),
                         expected.end())) {
    return it->second;
  }
  impl_->append(Impl::setRecord(key, desired));
  return Bytes(desired.begin(), desired.end());
}

bool FileStore::check(const std::vector<std::string>& keys) {
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_SH);
  impl_->replay();
  return impl_->allPresent(keys);
}

bool FileStore::deleteKey(const std::string& key) {
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_EX);
  impl_->replay();
  if (!impl_->data.contains(key)) {
    return false;
  }
  wire::WireWriter w;
  w.putU8(kDelete);
  w.putString(key);
  impl_->append(w.release());
  return true;
}

int64_t FileStore::numKeys() {
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_SH);
  impl_->replay();
  return static_cast<int64_t>(impl_->data.size());
}

void FileStore::wait(const std::vector<std::string>& keys,
                     std::chrono::milliseconds timeout) {
  impl_->pollFor(keys, timeout, "wait", [](const auto&) {});
}

Bytes FileStore::getWithTimeout(const std::string& key,
                                std::chrono::milliseconds timeout) {
  Bytes out;
  impl_->pollFor({key}, timeout, "get",
                 [&](const auto& data) { out = data.at(key); });
  return out;
}

std::vector<Bytes> FileStore::multiGet(const std::vector<std::string>& keys) {
  std::vector<Bytes> out;
  impl_->pollFor(keys, timeout(), "multiGet", [&](const auto& data) {
    for (const auto& k : keys) {
      out.push_back(data.at(k));
    }
  });
  return out;
}

void FileStore::multiSet(const std::vector<std::string>& keys,
                         const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "store multiSet: " + std::to_string(keys.size()) + " keys but " +
        std::to_string(values.size()) + " values"));
  }
  wire::WireWriter w;
  w.putU8(kMultiSet);
  w.putVarint(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    w.putString(keys[i]);
    w.putBytes(values[i]);
  }
  const Bytes rec = w.release();
  MutexLock g(impl_->mu);
  Impl::FileLock lock(*impl_, LOCK_EX);
  impl_->replay();
  impl_->append(rec);
}

}  // namespace trellis::store
