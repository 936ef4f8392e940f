#pragma once

// Bounds-checked binary encoding shared by every Trellis wire format
// (docs/wire.md): little-endian fixed-width integers, LEB128 varints,
// zig-zag signed varints, varint-length-prefixed strings and bytes, and
// nested sections prefixed by a fixed32 length.
//
// WireReader never reads outside its buffer. Every length is checked against
// both the bytes left and a caller-supplied limit before anything is sized
// from it. The first failure is sticky: it is recorded as a ProtocolError
// (code DATA_LOSS) naming the message, the field and the absolute byte
// offset; every later read returns zero/empty and changes nothing. So a
// decoder reads all fields, then checks ok() once before acting on them.
// A nested reader reports its failure to its parent as well; it must not
// outlive the parent.
//
// Strings and byte spans returned by the reader point into the input buffer.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <trellis/core/error.h>

namespace trellis::wire {

constexpr size_t kMaxVarintBytes = 10;

class WireWriter {
 public:
  WireWriter() = default;
  void reserve(size_t n) { buf_.reserve(n); }

  void putU8(uint8_t v) {
    firstRoom();
    buf_.push_back(v);
  }
  void putFixed32(uint32_t v);
  void putFixed64(uint64_t v);
  void putVarint(uint64_t v);
  void putSignedVarint(int64_t v);  // zig-zag
  void putBool(bool v) { putU8(v ? 1 : 0); }
  void putRaw(std::span<const uint8_t> bytes);
  void putRaw(std::string_view bytes);
  void putBytes(std::span<const uint8_t> bytes);  // varint length + bytes
  void putString(std::string_view s);             // varint length + bytes

  // A nested section: beginNested() reserves a fixed32 length and returns
  // its position; endNested(pos) writes the length of what followed.
  size_t beginNested();
  void endNested(size_t mark);

  size_t size() const { return buf_.size(); }
  const std::vector<uint8_t>& bytes() const { return buf_; }
  std::vector<uint8_t> release() { return std::move(buf_); }
  void clear() { buf_.clear(); }

 private:
  // The first write takes room for a small message at once, rather than
  // growing the buffer 1, 2, 4, 8... bytes a varint at a time.
  void firstRoom(size_t bytes = 0) {
    if (buf_.capacity() == 0) {
      buf_.reserve(bytes > kFirstBytes ? bytes : kFirstBytes);
    }
  }
  static constexpr size_t kFirstBytes = 64;

  std::vector<uint8_t> buf_;
};

class WireReader {
 public:
  // `what` names the message in errors ("store request").
  explicit WireReader(std::span<const uint8_t> data,
                      std::string_view what = "message");
  WireReader(std::string_view data, std::string_view what = "message");

  uint8_t u8(std::string_view field = {});
  bool boolean(std::string_view field = {});  // rejects anything but 0 and 1
  uint32_t fixed32(std::string_view field = {});
  uint64_t fixed64(std::string_view field = {});
  uint64_t varint(std::string_view field = {});
  // A varint that must be <= max.
  uint64_t varint(uint64_t max, std::string_view field);
  int64_t signedVarint(std::string_view field = {});

  std::string_view string(size_t maxLen, std::string_view field);
  std::span<const uint8_t> bytes(size_t maxLen, std::string_view field);
  // Exactly n bytes with no length prefix.
  std::span<const uint8_t> raw(size_t n, std::string_view field);
  // A fixed32-length-prefixed section of at most maxLen bytes.
  WireReader nested(size_t maxLen, std::string_view field);

  // Fails unless every byte has been consumed.
  void expectEnd();
  // Records `message` as the failure at the current offset (first one wins).
  void fail(std::string_view field, std::string_view message);

  bool ok() const { return error_.ok(); }
  const Error& error() const { return error_; }
  size_t offset() const { return base_ + pos_; }
  size_t remaining() const { return ok() ? data_.size() - pos_ : 0; }

 private:
  WireReader(std::span<const uint8_t> data, std::string what, size_t base,
             WireReader* parent);
  [[nodiscard]] bool need(size_t n, std::string_view field);

  std::span<const uint8_t> data_;
  size_t pos_ = 0;
  size_t base_ = 0;
  std::string what_;
  WireReader* parent_ = nullptr;
  Error error_;
};

}  // namespace trellis::wire
