#pragma once

// The cma channel's out-of-band record (docs/transport.md, "cma channel"),
// internal to the channel, its tests and its fuzz target: where the writer's
// tensor lies in the writer's process, for the reader's process_vm_readv.
//
//   fixed64 pid | fixed64 address | varint length

#include <cstdint>
#include <string>

#include <trellis/core/error.h>

namespace trellis::transport::cma {

struct Record {
  uint64_t pid = 0;
  uint64_t address = 0;
  uint64_t length = 0;
};

std::string encodeRecord(const Record& record);
// DATA_LOSS naming the field for bytes that are not exactly one record, a
// ProtocolError for a pid that cannot be a process's (0, above 2^31 - 1).
Error decodeRecord(const std::string& bytes, Record* out);

}  // namespace trellis::transport::cma
