#include <algorithm>
#include <cstring>
#include <unistd.h>

#include <trellis/transport/shm/ring.h>

namespace trellis::transport::shm {

namespace {

// Both ends publish their index after every chunk of this size (or half
// the ring, if less) instead of once per call, so a large message streams:
// the consumer copies one chunk out while the producer copies the next one
// in. Publishing once per call made the two ends take turns on the whole
// ring; at 16 and 64 MiB that ran at a third of the streaming rate
// (docs/benchmarks.md, "Transport"). Half the default 4 MiB ring measured
// best on the 2-core VM under load: 64 MiB payloads 1.1-1.65x TensorPipe's
// shm in the same runs against 0.80-0.88x with 128 KiB chunks, whose
// per-chunk hand-offs cost more than the overlap they buy there.
constexpr size_t kPublishBytes = size_t{2} << 20;

uint64_t loadAcquire(uint64_t* p) {
  return std::atomic_ref<uint64_t>(*p).load(std::memory_order_acquire);
}
void storeRelease(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}

// Moves n bytes at ring index *index in chunks of at most kPublishBytes (or
// half the ring) that never cross the end of the ring: copy(ring offset, bytes
// done, chunk length) for each, then *index advances and is published
// (release), then afterPublish() runs.
template <typename Copy, typename Published>
void streamChunks(uint64_t* index, uint64_t* published, uint64_t capacity,
                  size_t n, Copy copy, Published afterPublish) {
  for (size_t done = 0; done < n;) {
    const size_t off = static_cast<size_t>(*index & (capacity - 1));
    const size_t step =
        std::min({n - done, std::min(kPublishBytes, capacity / 2),
                  static_cast<size_t>(capacity) - off});
    copy(off, done, step);
    done += step;
    *index += step;
    storeRelease(published, *index);
    afterPublish();
  }
}

void ringDoorbell(int fd) {
  const uint64_t one = 1;
  // EAGAIN only if the counter would overflow: the peer is already woken.
  [[maybe_unused]] const ssize_t r = ::write(fd, &one, sizeof(one));
}

// The waiting flags pair with the indices Dekker-style: each side stores
// one, fences, then loads the other; seq_cst on both makes it impossible
// for both to miss each other (a lost wake-up).
void setFlag(uint32_t* p, bool on) {
  std::atomic_ref<uint32_t>(*p).store(on ? 1 : 0, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
bool takeFlag(uint32_t* p) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::atomic_ref<uint32_t> f(*p);
  if (f.load(std::memory_order_seq_cst) == 0) {
    return false;
  }
  return f.exchange(0, std::memory_order_seq_cst) != 0;
}

}  // namespace

bool validRingBytes(uint64_t n) {
  return n >= kMinRingBytes && n <= kMaxRingBytes && (n & (n - 1)) == 0;
}

namespace {

constexpr uint32_t kSetupMagic = 0x50555453;  // "STUP"
constexpr uint32_t kSetupVersion = 1;
constexpr uint32_t kReplyMagic = 0x594c5052;  // "RPLY"

uint32_t getU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t getU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
void putU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void putU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

}  // namespace

void encodeSetup(uint64_t ringBytes, uint8_t (&out)[kSetupBytes]) {
  std::memset(out, 0, kSetupBytes);
  putU32(out, kSetupMagic);
  putU32(out + 4, kSetupVersion);
  putU64(out + 8, ringBytes);
}

Error decodeSetup(const uint8_t (&msg)[kSetupBytes], const std::string& who,
                  uint64_t* ringBytes) {
  if (getU32(msg) != kSetupMagic) {
    return Error::protocol(who + ": bad magic (not a Trellis shm peer)");
  }
  if (getU32(msg + 4) != kSetupVersion) {
    return Error::protocol(who + ": unsupported version " +
                           std::to_string(getU32(msg + 4)));
  }
  const uint64_t ring = getU64(msg + 8);
  if (!validRingBytes(ring)) {
    return Error::protocol(who + ": ring size " + std::to_string(ring) +
                           " is not a power of two in [" +
                           std::to_string(kMinRingBytes) + ", " +
                           std::to_string(kMaxRingBytes) + "]");
  }
  *ringBytes = ring;
  return Error();
}

void encodeReply(uint8_t (&out)[kReplyBytes]) {
  std::memset(out, 0, kReplyBytes);
  putU32(out, kReplyMagic);
}

Error decodeReply(const uint8_t (&msg)[kReplyBytes], const std::string& who) {
  if (getU32(msg) != kReplyMagic || getU32(msg + 4) != 0) {
    return Error::protocol(who + ": bad reply");
  }
  return Error();
}

void writeSegmentHeader(void* segment, uint64_t ringBytes) {
  const SegmentHeader h{kSegmentMagic, kSegmentVersion, ringBytes};
  std::memcpy(segment, &h, sizeof(h));
}

Error checkSegmentHeader(const void* header, uint64_t ringBytes,
                         const std::string& who) {
  SegmentHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kSegmentMagic || h.version != kSegmentVersion ||
      h.ringBytes != ringBytes) {
    return Error::protocol(who + ": segment header does not match");
  }
  return Error();
}

RingWriter::RingWriter(RingControl* control, char* data, size_t capacity)
    : control_(control), data_(data), capacity_(capacity) {}

Error RingWriter::space(size_t* free) {
  const uint64_t tail = loadAcquire(&control_->tail);
  // Unsigned: a tail behind the last one seen or beyond our head makes
  // `used` exceed what we have written since lastTail_.
  const uint64_t used = head_ - tail;
  if (used > head_ - lastTail_) {
    free_ = 0;
    *free = 0;
    return Error::protocol("shm peer corrupted ring: consumer tail " +
                           std::to_string(tail) + " outside [" +
                           std::to_string(lastTail_) + ", " +
                           std::to_string(head_) + "]");
  }
  lastTail_ = tail;
  free_ = static_cast<size_t>(capacity_ - used);
  *free = free_;
  return Error();
}

size_t RingWriter::write(const void* src, size_t n) {
  n = std::min(n, free_);
  if (n == 0) {
    return 0;
  }
  const char* from = static_cast<const char*>(src);
  // A consumer asleep on its eventfd is woken after the first chunk, not
  // after the whole copy: otherwise it starts only once this end has
  // filled the ring, and the two ends take turns instead of streaming.
  streamChunks(
      &head_, &control_->head, capacity_, n,
      [&](size_t off, size_t done, size_t step) {
        std::memcpy(data_ + off, from + done, step);
      },
      [&] {
        if (doorbell_ >= 0 && takeConsumerWaiting()) {
          ringDoorbell(doorbell_);
        }
      });
  free_ -= n;
  return n;
}

void RingWriter::setWaiting(bool on) {
  setFlag(&control_->producerWaiting, on);
}

bool RingWriter::takeConsumerWaiting() {
  return takeFlag(&control_->consumerWaiting);
}

RingReader::RingReader(RingControl* control, const char* data, size_t capacity)
    : control_(control), data_(data), capacity_(capacity) {}

Error RingReader::available(size_t* n) {
  const uint64_t head = loadAcquire(&control_->head);
  const uint64_t avail = head - tail_;
  if (avail > capacity_ || avail < lastHead_ - tail_) {
    avail_ = 0;
    *n = 0;
    return Error::protocol("shm peer corrupted ring: producer head " +
                           std::to_string(head) + " outside [" +
                           std::to_string(lastHead_) + ", " +
                           std::to_string(tail_ + capacity_) + "]");
  }
  lastHead_ = head;
  avail_ = static_cast<size_t>(avail);
  *n = avail_;
  return Error();
}

size_t RingReader::read(void* dst, size_t n) {
  n = std::min(n, avail_);
  if (n == 0) {
    return 0;
  }
  char* to = static_cast<char*>(dst);
  streamChunks(
      &tail_, &control_->tail, capacity_, n,
      [&](size_t off, size_t done, size_t step) {
        std::memcpy(to + done, data_ + off, step);
      },
      [&] {
        if (doorbell_ >= 0 && takeProducerWaiting()) {
          ringDoorbell(doorbell_);
        }
      });
  avail_ -= n;
  return n;
}

void RingReader::setWaiting(bool on) {
  setFlag(&control_->consumerWaiting, on);
}

bool RingReader::takeProducerWaiting() {
  return takeFlag(&control_->producerWaiting);
}

}  // namespace trellis::transport::shm
