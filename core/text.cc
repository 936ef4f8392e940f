#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <trellis/core/text.h>

namespace trellis {

std::optional<int64_t> parseDecimal(std::string_view s) {
  int64_t v = 0;
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end) {
    return std::nullopt;
  }
  return v;
}

void cutWithNote(std::string& s, size_t max, size_t originalBytes) {
  if (s.size() <= max) {
    return;
  }
  const std::string note =
      " ... [" + std::to_string(originalBytes != 0 ? originalBytes : s.size()) +
      " bytes, the rest cut]";
  const size_t keep = max > note.size() ? max - note.size() : 0;
  s.resize(keep);
  s.append(note, 0, max - keep);
}

std::string toHex(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

bool writeAll(int fd, std::string_view bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return false;
    }
    off += static_cast<size_t>(n);
  }
  return true;
}

namespace {
// nftw's callback takes no context: the walk of this thread records its
// first failure here.
thread_local std::string* tFirstFailure = nullptr;

int removeEntry(const char* path, const struct stat* /*st*/, int /*type*/,
                FTW* /*ftw*/) {
  // Depth first: a directory comes after everything in it.
  if (std::remove(path) != 0 && errno != ENOENT && tFirstFailure->empty()) {
    *tFirstFailure = std::string(path) + ": " + std::strerror(errno);
  }
  return 0;  // go on: remove what can be removed
}
}  // namespace

bool removeTree(const std::string& path, std::string* why) {
  std::string failure;
  tFirstFailure = &failure;
  const int rc = ::nftw(path.c_str(), removeEntry, 16, FTW_DEPTH | FTW_PHYS);
  const int walkErrno = errno;
  tFirstFailure = nullptr;
  if (rc != 0 && walkErrno != ENOENT && failure.empty()) {
    failure = path + ": " + std::strerror(walkErrno);
  }
  struct stat st {};
  const bool gone = ::lstat(path.c_str(), &st) != 0 && errno == ENOENT;
  if (!gone && failure.empty()) {
    failure = path + ": still there";
  }
  if (why != nullptr) {
    *why = gone ? "" : failure;
  }
  return gone;
}

}  // namespace trellis
