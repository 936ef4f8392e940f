#include <trellis/core/wire.h>
#include <trellis/transport/cma/record.h>

namespace trellis::transport::cma {

std::string encodeRecord(const Record& record) {
  wire::WireWriter w;
  w.putFixed64(record.pid);
  w.putFixed64(record.address);
  w.putVarint(record.length);
  return std::string(w.bytes().begin(), w.bytes().end());
}

Error decodeRecord(const std::string& bytes, Record* out) {
  wire::WireReader r(bytes, "cma record");
  out->pid = r.fixed64("cma pid");
  out->address = r.fixed64("cma address");
  out->length = r.varint("cma length");
  r.expectEnd();
  if (r.ok() && (out->pid == 0 || out->pid > 0x7fffffff)) {
    return Error::protocol("cma record: invalid pid " +
                           std::to_string(out->pid));
  }
  return r.error();
}

}  // namespace trellis::transport::cma
