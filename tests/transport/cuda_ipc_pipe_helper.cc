// The writer of cuda_ipc_pipe_test in a process of its own.
//
//   cuda_ipc_pipe_helper ADDRESS BYTES
//
// Connects with the default transports and channels, fills a CUDA buffer of
// BYTES + 512 bytes with the pattern (cuda_ipc_pipe_test.cc: patternByte),
// queued on the legacy default stream and not waited for, prints
// "ready CPU_CHANNEL CUDA_CHANNEL", writes one message (a 1000-byte CPU
// payload and the CUDA tensor at offset 512), prints "written ok" or
// "written error: ..." once its callback fires, and exits 0.

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>
#include <string>
#include <vector>

#include <trellis/core/future.h>
#include <trellis/transport/context.h>

using namespace trellis;
using namespace trellis::transport;

namespace {

uint8_t patternByte(size_t i) {
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a);
}

int run(const std::string& address, size_t bytes) {
  void* dev = nullptr;
  void* host = nullptr;
  if (cudaMalloc(&dev, bytes + 512) != cudaSuccess ||
      cudaMallocHost(&host, bytes + 512) != cudaSuccess) {
    std::fprintf(stderr, "helper: CUDA allocation failed\n");
    return 1;
  }
  auto* h = static_cast<uint8_t*>(host);
  for (size_t i = 0; i < bytes + 512; ++i) {
    h[i] = patternByte(i);
  }
  cudaMemcpyAsync(dev, host, bytes + 512, cudaMemcpyHostToDevice,
                  cudaStreamLegacy);
  ContextOptions o;
  o.name = "helper";
  o.tokenFromEnvironment = false;
  auto ctx = Context::create(o);
  auto pipe = ctx->connect(address);
  std::vector<uint8_t> payload(1000, 0x33);
  Message m;
  m.descriptor = "cuda";
  m.payloads.push_back({payload.data(), payload.size()});
  m.tensors.push_back({static_cast<char*>(dev) + 512, bytes, Device::cuda(0)});
  Promise<void> p;
  pipe->write(std::move(m), [p](const Error& e) mutable {
    e.ok() ? p.setValue() : p.setError(e);
  });
  auto w = p.getFuture();
  if (!w.waitFor(std::chrono::seconds(60))) {
    std::fprintf(stderr, "write callback did not fire within 60 s\n");
    return 1;
  }
  std::printf("ready %s %s\n", pipe->channelName().c_str(),
              pipe->channelName(DeviceType::kCuda).c_str());
  if (w.error().ok()) {
    std::printf("written ok\n");
  } else {
    std::printf("written error: %s\n", w.error().what().c_str());
  }
  std::fflush(stdout);
  ctx->close();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s ADDRESS BYTES\n", argv[0]);
    return 2;
  }
  try {
    return run(argv[1], std::strtoull(argv[2], nullptr, 10));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "helper: %s\n", e.what());
    return 1;
  }
}
