#include <trellis/core/wire.h>
#include <trellis/transport/cuda_ipc/record.h>

namespace trellis::transport::cuda_ipc {

std::string encodeRecord(const Record& r) {
  wire::WireWriter w;
  w.reserve(kRecordBytes);
  w.putFixed32(kRecordMagic);
  w.putFixed32(r.deviceIndex);
  w.putFixed64(r.offset);
  w.putFixed64(r.length);
  w.putFixed64(r.allocationSize);
  w.putFixed64(r.writerPid);
  w.putFixed64(r.bufferId);
  w.putFixed64(r.baseAddress);
  w.putRaw(std::span<const uint8_t>(r.memHandle));
  w.putRaw(std::span<const uint8_t>(r.eventHandle));
  const auto& b = w.bytes();
  return std::string(b.begin(), b.end());
}

Error decodeRecord(std::string_view bytes, Record* out) {
  wire::WireReader in(bytes, "cuda_ipc record");
  if (in.fixed32("magic") != kRecordMagic && in.ok()) {
    in.fail("magic", "not a cuda_ipc record (wrong magic or version)");
  }
  Record r;
  r.deviceIndex = in.fixed32("device index");
  r.offset = in.fixed64("offset");
  r.length = in.fixed64("length");
  r.allocationSize = in.fixed64("allocation size");
  r.writerPid = in.fixed64("writer pid");
  r.bufferId = in.fixed64("buffer id");
  r.baseAddress = in.fixed64("base address");
  const auto mem = in.raw(kHandleBytes, "memory handle");
  const auto event = in.raw(kHandleBytes, "event handle");
  in.expectEnd();
  if (in.ok() &&
      (r.offset > r.allocationSize || r.length > r.allocationSize - r.offset)) {
    in.fail("length", "offset " + std::to_string(r.offset) + " + length " +
                          std::to_string(r.length) +
                          " exceeds the allocation size " +
                          std::to_string(r.allocationSize));
  }
  if (!in.ok()) {
    return in.error();
  }
  std::copy(mem.begin(), mem.end(), r.memHandle.begin());
  std::copy(event.begin(), event.end(), r.eventHandle.begin());
  *out = r;
  return Error();
}

}  // namespace trellis::transport::cuda_ipc
