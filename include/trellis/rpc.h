#pragma once

// Everything a parameter-server or RPC program needs, in one include:
// rpc::init / rpcSync / rpcAsync / remote / shutdown (rpc/rpc.h), RRef
// (rref/rref.h; it lives in trellis::rpc, as torch's RRef lives in
// torch.distributed.rpc), distributed autograd and DistributedOptimizer
// (dist_autograd/), and WorkerEnv for the launcher's variables. Link
// trellis::dist_autograd; it brings the rest.
//
//   #include <trellis/rpc.h>
//   auto env = trellis::WorkerEnv::fromEnvironment();
//   trellis::rpc::init("worker" + std::to_string(env.rank), env.rank,
//                      env.worldSize);

#include <trellis/core/worker_env.h>
#include <trellis/dist_autograd/dist_autograd.h>
#include <trellis/dist_autograd/optimizer.h>
#include <trellis/rpc/profiler.h>
#include <trellis/rpc/rpc.h>
#include <trellis/rref/rref.h>
