// The writer side of the cuda_ipc tests, in a process of its own (a process
// cannot open its own IPC handles).
//
//   cuda_ipc_peer_helper <allocation bytes> <offset>:<length>...
//
// Allocates one buffer on cuda:0, queues some slow work on the legacy
// default stream and then the pattern (cuda_ipc_test.cc: patternByte) from
// pinned host memory, without waiting: a reader that does not wait for the
// writer's event sees zeros. Then prints "RECORD <hex>" per tensor and
// "READY", and stays alive (keeping the buffer) for at most 60 s or until
// killed. Exits 2 on a usage or CUDA error, printing "ERROR <what>".

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>
#include <string>
#include <thread>
#include <vector>

#include <trellis/transport/channel.h>
#include <trellis/transport/cuda_ipc/factory.h>
#include <trellis/transport/transport.h>

namespace {

uint8_t patternByte(size_t i) {
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a);
}

int fail(const std::string& what) {
  std::printf("ERROR %s\n", what.c_str());
  std::fflush(stdout);
  return 2;
}

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace trellis::transport;
  if (argc < 3) {
    return fail("usage: cuda_ipc_peer_helper <bytes> <offset>:<length>...");
  }
  const size_t bytes = std::strtoull(argv[1], nullptr, 10);
  void* dev = nullptr;
  if (cudaMalloc(&dev, bytes) != cudaSuccess) {
    return fail("cudaMalloc");
  }
  void* host = nullptr;
  if (cudaMallocHost(&host, bytes) != cudaSuccess) {
    return fail("cudaMallocHost");
  }
  auto* h = static_cast<uint8_t*>(host);
  for (size_t i = 0; i < bytes; ++i) {
    h[i] = patternByte(i);
  }
  // Slow work first, so that the pattern lands well after the records are
  // out: some 20 ms of memsets on a scratch buffer (H100).
  void* scratch = nullptr;
  const size_t scratchBytes = size_t{256} << 20;
  if (cudaMalloc(&scratch, scratchBytes) != cudaSuccess) {
    return fail("cudaMalloc scratch");
  }
  cudaMemsetAsync(dev, 0, bytes, cudaStreamLegacy);
  for (int i = 0; i < 200; ++i) {
    cudaMemsetAsync(scratch, i, scratchBytes, cudaStreamLegacy);
  }
  cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, cudaStreamLegacy);

  auto channel = cuda_ipc::create();
  const trellis::Error v = channel->viable();
  if (!v.ok()) {
    return fail(v.what());
  }
  for (int a = 2; a < argc; ++a) {
    const std::string spec = argv[a];
    const auto colon = spec.find(':');
    if (colon == std::string::npos) {
      return fail("bad tensor spec " + spec);
    }
    const size_t offset = std::strtoull(spec.c_str(), nullptr, 10);
    const size_t length = std::strtoull(spec.c_str() + colon + 1, nullptr, 10);
    Message::Tensor t;
    t.data = static_cast<char*>(dev) + offset;
    t.length = length;
    t.device = Device::cuda(0);
    std::string record;
    const trellis::Error e = channel->describeOutOfBand(t, &record);
    if (!e.ok()) {
      return fail(e.what());
    }
    std::printf("RECORD %s\n", hex(record).c_str());
  }
  std::printf("READY\n");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}
