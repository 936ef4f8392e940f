// cuda_ipc through Context and Pipe: negotiated as the pipe's cuda channel
// beside its cpu channel, a message with a CPU payload and CUDA tensors
// between two contexts of one process and between two processes
// (cuda_ipc_pipe_helper). Skips without a GPU.

#include <cstdlib>
#include <cuda_runtime_api.h>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "peer_process.h"
#include "transport_test_util.h"
#include <trellis/core/future.h>
#include <trellis/transport/context.h>

namespace trellis::transport::testing {
namespace {

uint8_t patternByte(size_t i) {  // as in cuda_ipc_pipe_helper.cc
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a);
}

bool haveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t n) { EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
};

// Reads one message: CPU buffers for payloads and CPU tensors, fresh
// device memory for CUDA tensors. Returns the read's error.
struct Read {
  Descriptor descriptor;
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<std::vector<uint8_t>> cpuTensors;
  std::vector<std::unique_ptr<DeviceBuffer>> cudaTensors;
  Error error;
};

std::unique_ptr<Read> readOne(const std::shared_ptr<Pipe>& pipe) {
  auto r = std::make_unique<Read>();
  Promise<Descriptor> dp;
  pipe->readDescriptor([dp](const Error& e, Descriptor d) mutable {
    e.ok() ? dp.setValue(std::move(d)) : dp.setError(e);
  });
  auto df = dp.getFuture();
  if (!df.waitFor(kWait) || !df.error().ok()) {
    r->error = df.error().ok() ? Error::timeout("no descriptor") : df.error();
    return r;
  }
  r->descriptor = df.wait(kWait);
  Allocation a;
  for (size_t n : r->descriptor.payloadLengths) {
    r->payloads.emplace_back(n);
    a.payloads.push_back({r->payloads.back().data(), n});
  }
  r->cpuTensors.reserve(r->descriptor.tensors.size());
  for (const auto& t : r->descriptor.tensors) {
    if (t.device.type == DeviceType::kCuda) {
      r->cudaTensors.push_back(std::make_unique<DeviceBuffer>(t.length));
      a.tensors.push_back({r->cudaTensors.back()->p, t.length});
    } else {
      r->cpuTensors.emplace_back(t.length);
      a.tensors.push_back({r->cpuTensors.back().data(), t.length});
    }
  }
  Promise<void> rp;
  pipe->read(std::move(a), [rp](const Error& e) mutable {
    e.ok() ? rp.setValue() : rp.setError(e);
  });
  auto rf = rp.getFuture();
  r->error = rf.waitFor(kWait) ? rf.error() : Error::timeout("no read");
  return r;
}

void expectPattern(const void* dev, size_t offset, size_t length) {
  std::vector<uint8_t> host(length);
  ASSERT_EQ(cudaMemcpy(host.data(), dev, length, cudaMemcpyDeviceToHost),
            cudaSuccess);
  size_t bad = 0;
  for (size_t i = 0; i < length; ++i) {
    bad += host[i] != patternByte(offset + i) ? 1 : 0;
  }
  EXPECT_EQ(bad, 0u);
}

const Backend kUvCuda{
    "uv_cuda", "uv",        "uv://127.0.0.1:0", {"basic", "cuda_ipc"},
    "basic",   std::nullopt};

TEST(CudaIpcPipeTest, TwoContextsOfOneProcess) {
  if (!haveGpu()) {
    GTEST_SKIP() << "no CUDA device";
  }
  auto pp = makePair(kUvCuda, optionsFor(kUvCuda, "server"),
                     optionsFor(kUvCuda, "client"));
  const size_t lengths[] = {(size_t{3} << 20) + 5, 4096};
  DeviceBuffer src(lengths[0] + lengths[1] + 1024);
  std::vector<uint8_t> host(lengths[0] + lengths[1] + 1024);
  for (size_t i = 0; i < host.size(); ++i) {
    host[i] = patternByte(i);
  }
  ASSERT_EQ(cudaMemcpy(src.p, host.data(), host.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<uint8_t> cpu(5000, 0x42);
  std::vector<uint8_t> payload(100, 0x17);
  Message m;
  m.descriptor = "mixed";
  m.payloads.push_back({payload.data(), payload.size()});
  // Two CUDA tensors of one allocation, a CPU tensor between them.
  auto* base = static_cast<char*>(src.p);
  m.tensors.push_back({base + 512, lengths[0], Device::cuda(0)});
  m.tensors.push_back({cpu.data(), cpu.size(), Device::cpu()});
  m.tensors.push_back({base + 512 + lengths[0], lengths[1], Device::cuda(0)});
  for (int round = 0; round < 3; ++round) {
    auto w = writeAsync(*pp.clientPipe, m);
    auto r = readOne(pp.serverPipe);
    ASSERT_TRUE(r->error.ok()) << r->error.what();
    ASSERT_TRUE(w.waitFor(kWait));
    ASSERT_TRUE(w.error().ok()) << w.error().what();
    EXPECT_EQ(pp.clientPipe->channelName(DeviceType::kCuda), "cuda_ipc");
    EXPECT_EQ(pp.serverPipe->channelName(DeviceType::kCuda), "cuda_ipc");
    EXPECT_EQ(r->descriptor.descriptor, "mixed");
    ASSERT_EQ(r->descriptor.tensors.size(), 3u);
    EXPECT_EQ(r->descriptor.tensors[0].device, Device::cuda(0));
    EXPECT_EQ(r->payloads[0], payload);
    EXPECT_EQ(r->cpuTensors[0], cpu);
    expectPattern(r->cudaTensors[0]->p, 512, lengths[0]);
    expectPattern(r->cudaTensors[1]->p, 512 + lengths[0], lengths[1]);
  }
}

TEST(CudaIpcPipeTest, FromAnotherProcess) {
  if (!haveGpu()) {
    GTEST_SKIP() << "no CUDA device";
  }
  auto ctx = Context::create(optionsFor(kUvCuda, "server"));
  auto listener = ctx->listen({"uv://127.0.0.1:0"});
  const size_t bytes = (size_t{16} << 20) + 3;
  const char* moved = std::getenv("TRELLIS_CUDA_IPC_PIPE_HELPER");
  auto child = spawnHelper(moved ? moved : CUDA_IPC_PIPE_HELPER,
                           {listener->address("uv"), std::to_string(bytes)});
  auto pipe = acceptOne(*listener);
  auto r = readOne(pipe);
  ASSERT_TRUE(r->error.ok()) << r->error.what();
  EXPECT_EQ(pipe->channelName(DeviceType::kCuda), "cuda_ipc");
  ASSERT_EQ(r->cudaTensors.size(), 1u);
  expectPattern(r->cudaTensors[0]->p, 512, bytes);
  EXPECT_EQ(child->readLine(60000), "ready basic cuda_ipc");
  EXPECT_EQ(child->readLine(60000), "written ok");
  const int status = child->wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace trellis::transport::testing
