// Fuzz target for what a same-host peer hands the transport outside the
// framed stream: the cma channel's record, the cuda_ipc channel's record,
// and the shm transport's setup message, reply and segment header (the
// peer writes the segment). Arbitrary bytes must never crash or read out
// of bounds; what decodes must re-encode to the same fields.
//
// Input: byte 0 selects the decoder, the rest is the input.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <trellis/transport/cma/record.h>
#include <trellis/transport/cuda_ipc/record.h>
#include <trellis/transport/shm/ring.h>

namespace {

namespace shm = trellis::transport::shm;
namespace cma = trellis::transport::cma;
namespace cuda_ipc = trellis::transport::cuda_ipc;
using trellis::Code;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

template <size_t N>
void fill(const std::string& in, uint8_t (&out)[N]) {
  std::memset(out, 0, N);
  std::memcpy(out, in.data(), std::min(N, in.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const std::string in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 5) {
    case 0: {
      cma::Record r;
      const auto e = cma::decodeRecord(in, &r);
      if (e.ok()) {
        require(r.pid > 0 && r.pid <= 0x7fffffff);
        cma::Record back;
        require(cma::decodeRecord(cma::encodeRecord(r), &back).ok());
        require(back.pid == r.pid && back.address == r.address &&
                back.length == r.length);
      } else {
        require(e.code() == Code::kDataLoss);
      }
      break;
    }
    case 1: {
      cuda_ipc::Record r;
      const auto e = cuda_ipc::decodeRecord(in, &r);
      if (e.ok()) {
        require(in.size() == cuda_ipc::kRecordBytes);
        require(r.offset <= r.allocationSize &&
                r.length <= r.allocationSize - r.offset);
        require(cuda_ipc::encodeRecord(r) == in);
      } else {
        require(e.code() == Code::kDataLoss);
      }
      break;
    }
    case 2: {
      uint8_t msg[shm::kSetupBytes];
      fill(in, msg);
      uint64_t ring = 0;
      const auto e = shm::decodeSetup(msg, "peer", &ring);
      if (e.ok()) {
        require(shm::validRingBytes(ring));
        uint8_t again[shm::kSetupBytes];
        shm::encodeSetup(ring, again);
        uint64_t back = 0;
        require(shm::decodeSetup(again, "peer", &back).ok() && back == ring);
      } else {
        require(e.code() == Code::kDataLoss);
      }
      break;
    }
    case 3: {
      uint8_t msg[shm::kReplyBytes];
      fill(in, msg);
      uint8_t real[shm::kReplyBytes];
      shm::encodeReply(real);
      require(shm::decodeReply(msg, "peer").ok() ==
              (std::memcmp(msg, real, sizeof(msg)) == 0));
      break;
    }
    default: {
      // A header the peer wrote, checked against the size both agreed on.
      uint8_t header[sizeof(shm::SegmentHeader)];
      fill(in.substr(std::min<size_t>(in.size(), 8)), header);
      uint64_t agreed = 0;
      std::memcpy(&agreed, in.data(), std::min<size_t>(in.size(), 8));
      uint8_t real[sizeof(shm::SegmentHeader)];
      shm::writeSegmentHeader(real, agreed);
      require(shm::checkSegmentHeader(header, agreed, "peer").ok() ==
              (std::memcmp(header, real, sizeof(header)) == 0));
      break;
    }
  }
  return 0;
}
