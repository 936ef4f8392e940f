#include <cstring>

#include <trellis/core/wire.h>

namespace trellis::wire {

void WireWriter::putFixed32(uint32_t v) {
  firstRoom();
  for (int i = 0; i < 4; ++i) {
    buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
}

void WireWriter::putFixed64(uint64_t v) {
  firstRoom();
  for (int i = 0; i < 8; ++i) {
    buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
}

void WireWriter::putVarint(uint64_t v) {
  firstRoom();
  while (v >= 0x80) {
    buf_.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  buf_.push_back(static_cast<uint8_t>(v));
}

void WireWriter::putSignedVarint(int64_t v) {
  putVarint((static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63));
}

void WireWriter::putRaw(std::span<const uint8_t> bytes) {
  firstRoom(bytes.size());
  buf_.insert(buf_.end(), bytes.begin(), bytes.end());
}

void WireWriter::putRaw(std::string_view bytes) {
  putRaw(
      std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
}

void WireWriter::putBytes(std::span<const uint8_t> bytes) {
  putVarint(bytes.size());
  putRaw(bytes);
}

void WireWriter::putString(std::string_view s) {
  putVarint(s.size());
  putRaw(s);
}

size_t WireWriter::beginNested() {
  const size_t mark = buf_.size();
  putFixed32(0);
  return mark;
}

void WireWriter::endNested(size_t mark) {
  const size_t len = buf_.size() - mark - 4;
  for (int i = 0; i < 4; ++i) {
    buf_[mark + i] = static_cast<uint8_t>(len >> (8 * i));
  }
}

WireReader::WireReader(std::span<const uint8_t> data, std::string_view what)
    : data_(data), what_(what) {}

WireReader::WireReader(std::string_view data, std::string_view what)
    : data_(reinterpret_cast<const uint8_t*>(data.data()), data.size()),
      what_(what) {}

WireReader::WireReader(std::span<const uint8_t> data, std::string what,
                       size_t base, WireReader* parent)
    : data_(data), base_(base), what_(std::move(what)), parent_(parent) {}

void WireReader::fail(std::string_view field, std::string_view message) {
  if (!error_.ok()) {
    return;
  }
  std::string text = what_ + ": offset " + std::to_string(offset());
  if (!field.empty()) {
    text += ": field '";
    text += field;
    text += "'";
  }
  text += ": ";
  text += message;
  error_ = Error::protocol(std::move(text));
  for (WireReader* p = parent_; p != nullptr; p = p->parent_) {
    if (p->error_.ok()) {
      p->error_ = error_;
    }
  }
}

bool WireReader::need(size_t n, std::string_view field) {
  if (!ok()) {
    return false;
  }
  if (n > data_.size() - pos_) {
    fail(field, "truncated: need " + std::to_string(n) + " bytes, " +
                    std::to_string(data_.size() - pos_) + " left");
    return false;
  }
  return true;
}

uint8_t WireReader::u8(std::string_view field) {
  if (!need(1, field)) {
    return 0;
  }
  return data_[pos_++];
}

bool WireReader::boolean(std::string_view field) {
  const uint8_t v = u8(field);
  if (v > 1) {
    fail(field, "boolean byte is " + std::to_string(v) + ", expected 0 or 1");
    return false;
  }
  return v == 1;
}

uint32_t WireReader::fixed32(std::string_view field) {
  if (!need(4, field)) {
    return 0;
  }
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(data_[pos_ + i]) << (8 * i);
  }
  pos_ += 4;
  return v;
}

uint64_t WireReader::fixed64(std::string_view field) {
  if (!need(8, field)) {
    return 0;
  }
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) {
    v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
  }
  pos_ += 8;
  return v;
}

uint64_t WireReader::varint(std::string_view field) {
  if (!ok()) {
    return 0;
  }
  uint64_t v = 0;
  for (size_t i = 0; i < kMaxVarintBytes; ++i) {
    if (pos_ >= data_.size()) {
      fail(field, "truncated varint");
      return 0;
    }
    const uint8_t b = data_[pos_++];
    if (i == kMaxVarintBytes - 1 && b > 1) {
      fail(field, "varint overflows 64 bits");
      return 0;
    }
    v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
    if ((b & 0x80) == 0) {
      return v;
    }
  }
  fail(field, "varint longer than 10 bytes");
  return 0;
}

uint64_t WireReader::varint(uint64_t max, std::string_view field) {
  const uint64_t v = varint(field);
  if (ok() && v > max) {
    fail(field, "value " + std::to_string(v) + " exceeds limit " +
                    std::to_string(max));
    return 0;
  }
  return v;
}

int64_t WireReader::signedVarint(std::string_view field) {
  const uint64_t z = varint(field);
  return static_cast<int64_t>((z >> 1) ^ (~(z & 1) + 1));
}

std::span<const uint8_t> WireReader::bytes(size_t maxLen,
                                           std::string_view field) {
  const uint64_t len = varint(field);
  if (!ok()) {
    return {};
  }
  if (len > maxLen) {
    fail(field, "length " + std::to_string(len) + " exceeds limit " +
                    std::to_string(maxLen));
    return {};
  }
  return raw(static_cast<size_t>(len), field);
}

std::string_view WireReader::string(size_t maxLen, std::string_view field) {
  auto b = bytes(maxLen, field);
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

std::span<const uint8_t> WireReader::raw(size_t n, std::string_view field) {
  if (!need(n, field)) {
    return {};
  }
  auto out = data_.subspan(pos_, n);
  pos_ += n;
  return out;
}

WireReader WireReader::nested(size_t maxLen, std::string_view field) {
  const uint32_t len = fixed32(field);
  if (ok() && len > maxLen) {
    fail(field, "nested length " + std::to_string(len) + " exceeds limit " +
                    std::to_string(maxLen));
  }
  const size_t start = offset();
  auto body = ok() ? raw(len, field) : std::span<const uint8_t>();
  WireReader child(body, what_, start, this);
  if (!ok()) {
    child.error_ = error_;
  }
  return child;
}

void WireReader::expectEnd() {
  if (ok() && pos_ != data_.size()) {
    fail({},
         std::to_string(data_.size() - pos_) + " unexpected trailing bytes");
  }
}

}  // namespace trellis::wire
