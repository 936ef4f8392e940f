#pragma once
// What the GPU tests share (collectives_nccl_test, rpc_cuda_test,
// ddp_cuda_test): the reason a test skips where it cannot run, and a gate
// that holds a CUDA stream. Header only; the tests link CUDA::cudart.
#include <ATen/Context.h>
#include <chrono>
#include <condition_variable>
#include <cuda_runtime_api.h>
#include <memory>
#include <mutex>
#include <string>

#include <gtest/gtest.h>

namespace trellis::testing {

// Why the GPU tests cannot run here; empty where they can.
inline std::string noGpu() {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    return std::string("no GPU visible (cudaGetDeviceCount: ") +
           cudaGetErrorName(e) + ")";
  }
  if (n == 0) {
    return "no GPU visible";
  }
  if (!at::hasCUDA()) {
    return "this libtorch has no CUDA, so there are no CUDA tensors";
  }
  return "";
}

// Holds `stream` (the legacy default stream by default, torch's default
// current stream) in a host function until the gate is opened or
// destroyed, or `limit` passed, so work queued there after it cannot
// start. The limit frees the stream should something (ncclCommAbort, a
// host wait) wait for the device. The host function owns its state, so
// the gate never waits for the stream.
class StreamGate {
 public:
  explicit StreamGate(std::chrono::seconds limit, cudaStream_t stream = nullptr)
      : state_(std::make_shared<State>()) {
    state_->limit = limit;
    auto* held = new std::shared_ptr<State>(state_);
    EXPECT_EQ(cudaLaunchHostFunc(stream, &StreamGate::hold, held), cudaSuccess);
  }
  ~StreamGate() { open(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void open() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->open = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::chrono::seconds limit{0};
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
  };
  static void hold(void* p) {
    std::unique_ptr<std::shared_ptr<State>> held(
        static_cast<std::shared_ptr<State>*>(p));
    State& s = **held;
    std::unique_lock<std::mutex> lock(s.mu);
    s.cv.wait_for(lock, s.limit, [&s] { return s.open; });
  }
  std::shared_ptr<State> state_;
};

}  // namespace trellis::testing

#define REQUIRE_GPU()                                                  \
  do {                                                                 \
    if (std::string why = ::trellis::testing::noGpu(); !why.empty()) { \
      GTEST_SKIP() << why;                                             \
    }                                                                  \
  } while (0)
