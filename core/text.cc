#include <cerrno>
#include <charconv>
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

}  // namespace trellis
