#pragma once

// The cuda_ipc out-of-band record (docs/transport.md, "cuda_ipc channel"),
// internal to the channel and its tests. Free of CUDA types, so that it can
// be tested everywhere.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include <trellis/core/error.h>

namespace trellis::transport::cuda_ipc {

// cudaIpcMemHandle_t and cudaIpcEventHandle_t are 64 opaque bytes each.
constexpr size_t kHandleBytes = 64;
constexpr uint32_t kRecordMagic = 0x31494354;  // "TCI1", little-endian
constexpr size_t kRecordBytes = 4 + 4 + 6 * 8 + 2 * kHandleBytes;

struct Record {
  uint32_t deviceIndex = 0;     // the writer's device
  uint64_t offset = 0;          // of the tensor from the allocation base
  uint64_t length = 0;          // of the tensor
  uint64_t allocationSize = 0;  // the writer's view; the reader rechecks
  uint64_t writerPid = 0;
  // The driver's process-wide unique id of the allocation: with the pid, it
  // keys the reader's cache of opened handles, so that an allocation freed
  // and replaced at the same address is opened afresh.
  uint64_t bufferId = 0;
  // Only for a reader in the writer's own process, which cannot open its
  // own handles and uses the address once it has checked it.
  uint64_t baseAddress = 0;
  std::array<uint8_t, kHandleBytes> memHandle{};
  std::array<uint8_t, kHandleBytes> eventHandle{};
};

std::string encodeRecord(const Record& record);
// DATA_LOSS naming the field when `bytes` is not a well-formed record;
// offset + length must not overflow and must fit in allocationSize.
Error decodeRecord(std::string_view bytes, Record* out);

}  // namespace trellis::transport::cuda_ipc
