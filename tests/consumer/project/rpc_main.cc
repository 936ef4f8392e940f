// A user program built against an installed Trellis, through the umbrella
// header and one target (trellis::dist_autograd): a one-worker group that
// calls itself, makes an RRef, runs a distributed backward and a
// DistributedOptimizer step, and shuts down.
#include <ATen/ATen.h>
#include <cstdio>
#include <memory>

#include <trellis/rpc.h>
#include <trellis/store/hash_store.h>

at::Tensor scale(at::Tensor x, double k) { return x * k; }
TRELLIS_REMOTE_FUNCTION(scale);

int main() {
  namespace rpc = trellis::rpc;
  namespace da = trellis::dist_autograd;
  rpc::RpcOptions options;
  options.store = std::make_shared<trellis::store::HashStore>();
  options.localAddress = "127.0.0.1";
  rpc::init("solo", 0, 1, options);

  at::Tensor w = at::ones({2}, at::kDouble).requires_grad_(true);
  const at::Tensor tripled = rpc::rpcSync<scale>("solo", w.detach(), 3.0);
  const at::Tensor doubled =
      rpc::remote<scale>("solo", w.detach(), 2.0).toHere();
  da::DistributedOptimizer opt(da::SGD{.lr = 0.5}, da::localParameters({w}));
  {
    da::Context ctx;
    const at::Tensor loss = rpc::rpcSync<scale>("solo", w, 3.0).sum();
    ctx.backward({loss});
    opt.step(ctx);
  }
  rpc::shutdown();
  // d(sum(3w))/dw = 3, so w = 1 - 0.5 * 3.
  if (!at::allclose(tripled, at::full({2}, 3.0, at::kDouble)) ||
      !at::allclose(doubled, at::full({2}, 2.0, at::kDouble)) ||
      !at::allclose(w.detach(), at::full({2}, -0.5, at::kDouble))) {
    std::fprintf(stderr, "consumer_rpc: unexpected values\n");
    return 1;
  }
  std::printf("consumer_rpc: ok\n");
  return 0;
}
