// Fuzz target for the shm ring (transport/shm/ring.h) with a hostile peer:
// the other process maps the same pages and may write any index at any
// time. A script of operations drives one writer and one reader of a ring
// whose control block the "peer" corrupts at will. Whatever it writes, no
// copy may leave the ring's data or the caller's buffer (ASan), no end may
// report more than the capacity, and while the peer keeps quiet the bytes
// read are exactly the bytes written, in order.
//
// Input: byte 0 picks the capacity (64 << (b % 3) bytes: the ring's logic
// does not depend on its size, and small rings wrap often and cost the
// fuzzer little); then operations of 9 bytes: op, then a u64 argument.
//  op % 4 == 0  the writer writes (arg % 3 * capacity / 2 + 1) bytes
//  op % 4 == 1  the reader reads up to (arg % (2 * capacity) + 1) bytes
//  op % 4 == 2  the peer overwrites the published head with arg
//  op % 4 == 3  the peer overwrites the published tail with arg
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include <trellis/transport/shm/ring.h>

namespace {

namespace shm = trellis::transport::shm;
using trellis::Code;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const size_t capacity = size_t{64} << (data[0] % 3);
  auto control = std::make_unique<shm::RingControl>();
  std::memset(control.get(), 0, sizeof(*control));
  // Exactly the ring's bytes, so that ASan sees any copy past its end.
  std::vector<char> ring(capacity);
  shm::RingWriter writer(control.get(), ring.data(), capacity);
  shm::RingReader reader(control.get(), ring.data(), capacity);
  std::deque<uint8_t> inFlight;  // written and not yet read, while honest
  bool corrupted = false;
  uint8_t next = 0;
  for (size_t at = 1; at + 9 <= size; at += 9) {
    const uint8_t op = data[at];
    uint64_t arg = 0;
    std::memcpy(&arg, data + at + 1, 8);
    switch (op % 4) {
      case 0: {
        size_t free = 0;
        const auto e = writer.space(&free);
        require(free <= capacity);
        if (!e.ok()) {
          require(corrupted && e.code() == Code::kDataLoss);
          break;
        }
        // Exactly as long as asked (ASan sees a read past it); only the
        // part the ring takes is filled.
        const size_t want = arg % 3 * capacity / 2 + 1;
        std::unique_ptr<uint8_t[]> src(new uint8_t[want]);
        for (size_t i = 0; i < std::min(want, free); ++i) {
          src[i] = next++;
        }
        const size_t n = writer.write(src.get(), want);
        require(n <= free && n <= want);
        inFlight.insert(inFlight.end(), src.get(), src.get() + n);
        break;
      }
      case 1: {
        size_t avail = 0;
        const auto e = reader.available(&avail);
        require(avail <= capacity);
        if (!e.ok()) {
          require(corrupted && e.code() == Code::kDataLoss);
          break;
        }
        const size_t want = arg % (2 * capacity) + 1;
        std::unique_ptr<uint8_t[]> dst(new uint8_t[want]);
        const size_t n = reader.read(dst.get(), want);
        require(n <= avail && n <= want);
        if (!corrupted) {
          require(n <= inFlight.size());
          for (size_t i = 0; i < n; ++i) {
            require(dst[i] == inFlight.front());
            inFlight.pop_front();
          }
        }
        break;
      }
      case 2:
        control->head = arg;
        corrupted = true;
        break;
      default:
        control->tail = arg;
        corrupted = true;
        break;
    }
  }
  return 0;
}
