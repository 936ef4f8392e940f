#pragma once

// Internal: the shared-memory layout of one shm connection and the two ends
// of a single-producer single-consumer byte ring (docs/transport.md, "shm
// transport"). Not installed.
//
// Layout of the memfd (all integers little-endian, as the host writes them):
//   [0, 4096)            SegmentHeader: magic, version, ring size; then the
//                        RingControl of ring 0 at 256 and of ring 1 at 512
//   [4096, 4096 + R)     data of ring 0 (connector -> acceptor)
//   [4096 + R, 4096+2R)  data of ring 1 (acceptor -> connector)
//
// Trust: the peer maps the same pages and can write anything anywhere in
// them at any time. Each end keeps its own index (producer: head, consumer:
// tail) in a local variable and only publishes it; the other index is read
// from shared memory and validated on every read. Validation failure is a
// ProtocolError; no out-of-range address is ever formed from shared data.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <trellis/core/error.h>

namespace trellis::transport::shm {

constexpr uint32_t kSegmentMagic = 0x4d485354;  // "TSHM"
constexpr uint32_t kSegmentVersion = 1;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kRingControlOffset[2] = {256, 512};
constexpr size_t kMinRingBytes = size_t{4} << 10;
constexpr size_t kMaxRingBytes = size_t{1} << 30;

inline size_t segmentBytes(size_t ringBytes) {
  return kHeaderBytes + 2 * ringBytes;
}
inline size_t ringDataOffset(int ring, size_t ringBytes) {
  return kHeaderBytes + static_cast<size_t>(ring) * ringBytes;
}
// Power of two within [kMinRingBytes, kMaxRingBytes].
bool validRingBytes(uint64_t ringBytes);

// Setup, over the unix socket, before the segment is mapped. The
// connector's message, sent with [memfd, connector eventfd]: u32 magic
// "STUP", u32 version, u64 ring bytes, u64 reserved (zero). The acceptor's
// reply, with [acceptor eventfd]: u32 magic "RPLY", u32 zero.
constexpr size_t kSetupBytes = 24;
constexpr size_t kReplyBytes = 8;
void encodeSetup(uint64_t ringBytes, uint8_t (&out)[kSetupBytes]);
// The ring size the connector asks for; a ProtocolError prefixed with `who`
// for a bad magic, version or size.
Error decodeSetup(const uint8_t (&msg)[kSetupBytes], const std::string& who,
                  uint64_t* ringBytes);
void encodeReply(uint8_t (&out)[kReplyBytes]);
Error decodeReply(const uint8_t (&msg)[kReplyBytes], const std::string& who);

// The connector writes a SegmentHeader at the segment's start; the acceptor
// checks it against the setup message (`header` is the segment's first
// sizeof(SegmentHeader) bytes, copied out of shared memory).
void writeSegmentHeader(void* segment, uint64_t ringBytes);
Error checkSegmentHeader(const void* header, uint64_t ringBytes,
                         const std::string& who);

struct SegmentHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t ringBytes;
};

// Each field on its own cache line: the producer writes head and reads
// tail, the consumer the reverse; the waiting flags say "ring my eventfd".
struct alignas(64) RingControl {
  alignas(64) uint64_t head;             // bytes ever written (producer)
  alignas(64) uint64_t tail;             // bytes ever read (consumer)
  alignas(64) uint32_t consumerWaiting;  // consumer sleeps until data
  alignas(64) uint32_t producerWaiting;  // producer sleeps until space
};
static_assert(sizeof(RingControl) == 256);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

// The writing end. `control` and `data` point into the mapped segment.
class RingWriter final {
 public:
  RingWriter() = default;
  RingWriter(RingControl* control, char* data, size_t capacity);

  // Free bytes; ProtocolError if the peer's tail is not within
  // [last tail seen, our head].
  Error space(size_t* free);
  // Copies min(n, free) bytes (free from the last space() call) and
  // publishes the new head, chunk by chunk; after each chunk, a consumer
  // that asked to be woken is woken through the doorbell (if one is set).
  // Returns the bytes copied.
  size_t write(const void* src, size_t n);
  // The peer's eventfd, written when the consumer waits for data (-1, the
  // default: none; the caller then asks takeConsumerWaiting() itself).
  void setDoorbell(int peerEventFd) { doorbell_ = peerEventFd; }
  // Sets / clears "wake me when there is space", with a full fence, so a
  // consumer that frees space afterwards sees it.
  void setWaiting(bool on);
  // After publishing: true if the consumer asked to be woken (the flag is
  // cleared, so one wake-up per sleep).
  [[nodiscard]] bool takeConsumerWaiting();
  uint64_t head() const { return head_; }

 private:
  RingControl* control_ = nullptr;
  char* data_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t head_ = 0;
  uint64_t lastTail_ = 0;
  size_t free_ = 0;
  int doorbell_ = -1;
};

// The reading end.
class RingReader final {
 public:
  RingReader() = default;
  RingReader(RingControl* control, const char* data, size_t capacity);

  // Readable bytes; ProtocolError if the peer's head moved backwards or
  // runs ahead of our tail by more than the capacity.
  Error available(size_t* n);
  // Copies min(n, available) bytes (from the last available() call) and
  // publishes the new tail, chunk by chunk, waking a producer that waits
  // for space after each chunk (as RingWriter::write). Returns the bytes
  // copied.
  size_t read(void* dst, size_t n);
  void setDoorbell(int peerEventFd) { doorbell_ = peerEventFd; }
  void setWaiting(bool on);
  [[nodiscard]] bool takeProducerWaiting();
  uint64_t tail() const { return tail_; }

 private:
  RingControl* control_ = nullptr;
  const char* data_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t tail_ = 0;
  uint64_t lastHead_ = 0;
  size_t avail_ = 0;
  int doorbell_ = -1;
};

}  // namespace trellis::transport::shm
