// CUDA tensors through RPC: two agents of one process (agent_group.h),
// whose cuda_ipc channel takes its same-process path; the path between
// processes is rpc_process_test's "cuda" scenario. Every test skips, saying
// why, where no GPU is visible or libtorch has no CUDA; none passes
// vacuously where one is.
#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <chrono>
#include <cuda_runtime_api.h>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#include <c10/core/impl/DeviceGuardImplInterface.h>
#define TRELLIS_TEST_STREAMS 1
#endif

#include "../gpu/gpu_test.h"
#include "agent_group.h"
#include <trellis/core/error.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>

using namespace std::chrono_literals;
namespace rpc = trellis::rpc;
using Group = rpc::testing::AgentGroup;

// ---- functions the tests call ----------------------------------------------

at::Tensor echo(const at::Tensor& t) { return t; }
std::string deviceOf(const at::Tensor& t) { return t.device().str(); }
// CPU and CUDA tensors in one call and in one reply.
std::tuple<at::Tensor, at::Tensor> addOnDevice(const at::Tensor& cpu,
                                               const at::Tensor& cuda) {
  at::Tensor sum = cuda.add(cpu.to(cuda.device()));
  return {sum.cpu(), sum};
}
at::Tensor makeOnDevice(int64_t n) {
  return at::arange(n, at::TensorOptions().device(at::kCUDA, 0)).to(at::kFloat);
}

TRELLIS_REMOTE_FUNCTION(echo);
TRELLIS_REMOTE_FUNCTION(deviceOf);
TRELLIS_REMOTE_FUNCTION(addOnDevice);
TRELLIS_REMOTE_FUNCTION(makeOnDevice);

namespace {

const at::TensorOptions kCuda0 = at::TensorOptions().device(at::kCUDA, 0);

bool sameOnHost(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
         a.cpu().equal(b.cpu());
}

TEST(RpcCuda, EchoKeepsDeviceDtypeShapeAndValues) {
  REQUIRE_GPU();
  Group g(2, rpc::testing::callsBoundedBy(60s));
  rpc::CurrentAgentScope scope(&g[0]);
  std::vector<at::Tensor> cases = {
      at::arange(0, kCuda0.dtype(at::kFloat)),
      at::arange(1, kCuda0.dtype(at::kFloat)),
      at::arange(1000, kCuda0.dtype(at::kHalf)),
      at::arange(1 << 20, kCuda0.dtype(at::kLong)),
      at::arange(4 << 20, kCuda0.dtype(at::kByte)),
      at::arange(777, kCuda0.dtype(at::kInt)).remainder(2).to(at::kBool),
      // A view: only the bytes it spans travel, its strides kept.
      at::arange(64 * 64, kCuda0.dtype(at::kFloat))
          .view({64, 64})
          .narrow(0, 8, 16),
      // Not dense: made contiguous first.
      at::arange(64 * 64, kCuda0.dtype(at::kDouble)).view({64, 64}).t()};
  for (const auto& t : cases) {
    const at::Tensor back = rpc::rpcSync<echo>("w1", t);
    EXPECT_TRUE(back.is_cuda()) << t.sizes();
    EXPECT_EQ(back.device().index(), 0);
    EXPECT_TRUE(sameOnHost(back, t)) << t.sizes() << " " << t.dtype();
  }
  EXPECT_EQ(rpc::rpcSync<deviceOf>("w1", cases[2]), "cuda:0");
}

TEST(RpcCuda, CpuAndCudaTensorsInOneCallAndOneReply) {
  REQUIRE_GPU();
  Group g(2, rpc::testing::callsBoundedBy(60s));
  rpc::CurrentAgentScope scope(&g[0]);
  const at::Tensor cpu = at::arange(5000, at::kFloat);  // over 16 KiB: cma
  const at::Tensor cuda = at::full({5000}, 2.0F, kCuda0);
  const auto [onHost, onDevice] = rpc::rpcSync<addOnDevice>("w1", cpu, cuda);
  EXPECT_FALSE(onHost.is_cuda());
  EXPECT_TRUE(onDevice.is_cuda());
  EXPECT_TRUE(onHost.equal(cpu.add(2)));
  EXPECT_TRUE(onDevice.cpu().equal(cpu.add(2)));
}

TEST(RpcCuda, RemoteAndToHere) {
  REQUIRE_GPU();
  Group g(2, rpc::testing::callsBoundedBy(60s));
  rpc::CurrentAgentScope scope(&g[0]);
  auto r = rpc::remote<makeOnDevice>("w1", int64_t{100000});
  const at::Tensor t = r.toHere();
  EXPECT_TRUE(t.is_cuda());
  EXPECT_TRUE(t.cpu().equal(at::arange(100000).to(at::kFloat)));
  // Twice: the owner sends the same allocation again.
  EXPECT_TRUE(r.toHere().cpu().equal(t.cpu()));
}

// Many calls in flight, each with its own allocation, and one allocation
// sent many times: more than the writer's ring of 64 events, and handles
// reused from the reader's cache.
TEST(RpcCuda, ManyCallsInFlight) {
  REQUIRE_GPU();
  Group g(2, rpc::testing::callsBoundedBy(60s));
  rpc::CurrentAgentScope scope(&g[0]);
  std::vector<at::Tensor> sent;
  std::vector<trellis::Future<at::Tensor>> calls;
  const at::Tensor shared = at::arange(64 * 1024, kCuda0.dtype(at::kFloat));
  for (int i = 0; i < 100; ++i) {
    sent.push_back(i % 2 == 0 ? at::full({64 * 1024}, float(i), kCuda0)
                              : shared);
    calls.push_back(rpc::rpcAsync<echo>("w1", sent.back()));
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_TRUE(sameOnHost(calls[i].wait(60s), sent[i])) << "call " << i;
  }
}

// Where the agents negotiated no channel for CUDA tensors (cuda_ipc left
// out), such a call fails naming the device, and the pipe goes on.
TEST(RpcCuda, WithoutACudaChannelTheCallFailsNamingTheDevice) {
  REQUIRE_GPU();
  rpc::RpcOptions o = rpc::testing::callsBoundedBy(60s);
  o.channels = {"basic"};
  Group g(2, o);
  rpc::CurrentAgentScope scope(&g[0]);
  try {
    rpc::rpcSync<echo>("w1", at::ones({16}, kCuda0));
    ADD_FAILURE() << "a CUDA tensor went without a CUDA channel";
  } catch (const trellis::Exception& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos)
        << e.what();
  }
  const at::Tensor cpu = at::arange(10, at::kFloat);
  EXPECT_TRUE(rpc::rpcSync<echo>("w1", cpu).equal(cpu));
}

#ifdef TRELLIS_TEST_STREAMS
using trellis::testing::StreamGate;

// A template, so that only the accessor this libtorch has is compiled
// (native_handle(), later stream_handle()).
template <typename Stream>
cudaStream_t rawStream(const Stream& s) {
  if constexpr (requires { s.stream_handle(); }) {
    return static_cast<cudaStream_t>(s.stream_handle());
  } else {
    return static_cast<cudaStream_t>(s.native_handle());
  }
}

// A tensor written on a side stream (torch's pool, non-blocking) is sent
// after that write, not before: the agent makes the legacy default stream,
// which the cuda_ipc copy is ordered after, wait for the sender's current
// stream. Without that join the copy reads the zeros.
TEST(RpcCuda, ATensorWrittenOnASideStreamIsSentAfterTheWrite) {
  REQUIRE_GPU();
  Group g(2, rpc::testing::callsBoundedBy(60s));
  rpc::CurrentAgentScope scope(&g[0]);
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Device dev(c10::kCUDA, 0);
  at::Tensor t = at::zeros({1 << 20}, kCuda0);
  // Warm: the pipe, the handles and the pool's streams exist before the
  // gate, so nothing below waits for a first-use set-up.
  EXPECT_TRUE(sameOnHost(rpc::rpcSync<echo>("w1", t), t));
  const c10::Stream side = impl->getStreamFromGlobalPool(dev);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  trellis::Future<at::Tensor> call;
  {
    StreamGate gate(20s, rawStream(side));
    const c10::Stream before = impl->exchangeStream(side);
    t.fill_(7);  // on `side`, behind the gate
    const auto issued = std::chrono::steady_clock::now();
    call = rpc::rpcAsync<echo>("w1", t);
    impl->exchangeStream(before);
    EXPECT_LT(std::chrono::steady_clock::now() - issued, 5s)
        << "sending blocked the host on the gated stream";
    // Long enough for the copy to have run, had it not waited.
    std::this_thread::sleep_for(200ms);
    EXPECT_FALSE(call.completed()) << "the echo came back before the write ran";
    gate.open();
  }
  const at::Tensor back = call.wait(60s);
  EXPECT_TRUE(back.cpu().eq(7).all().item<bool>())
      << "the echo carried what the tensor held before the side stream's "
         "write";
}
#endif

}  // namespace
