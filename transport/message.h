#pragma once

// What a Pipe carries (docs/transport.md).
//
// A Message is descriptor bytes + payloads + tensors. The writer owns every
// buffer a Message points to and must keep it alive and unchanged until the
// write callback fires: writes are scatter/gather and never copy payload or
// tensor bytes. The reader first sees a Descriptor (the descriptor bytes and
// the lengths and devices of what follows), then supplies an Allocation with
// one destination buffer per payload and tensor, of exactly those lengths.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trellis::transport {

enum class DeviceType : uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int32_t index = 0;

  static Device cpu() { return Device{}; }
  static Device cuda(int32_t index) { return Device{DeviceType::kCuda, index}; }
  // "cpu" or "cuda:N".
  std::string toString() const;
  friend bool operator==(const Device&, const Device&) = default;
};

struct Message {
  struct Payload {
    const void* data = nullptr;
    size_t length = 0;
  };
  struct Tensor {
    const void* data = nullptr;
    size_t length = 0;
    Device device;
  };
  // Copied into the frame; the reader receives it before allocating.
  std::string descriptor;
  std::vector<Payload> payloads;
  std::vector<Tensor> tensors;
};

struct Descriptor {
  struct TensorInfo {
    size_t length = 0;
    Device device;
  };
  std::string descriptor;
  std::vector<size_t> payloadLengths;
  std::vector<TensorInfo> tensors;
};

struct Allocation {
  struct Buffer {
    void* data = nullptr;
    size_t length = 0;
  };
  // One buffer per payload / tensor of the Descriptor, same order and length.
  // A zero-length buffer may have a null pointer.
  std::vector<Buffer> payloads;
  std::vector<Buffer> tensors;
};

}  // namespace trellis::transport
