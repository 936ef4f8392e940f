#pragma once

// All of Trellis a worker program needs, in one include; link
// trellis::trellis. trellis::init starts the worker (job/job.h); then RPC,
// RRef and distributed autograd (<trellis/rpc.h>), collectives and DDP
// (<trellis/ddp.h>), error files and checkpoints (<trellis/elastic.h>).
//
//   #include <trellis/trellis.h>
//   int main() {
//     auto job = trellis::init();              // every rank in job.group()
//     trellis::ddp::DistributedDataParallel model(net, job.group());
//     ...
//   }                                          // the exit barrier

#include <trellis/ddp.h>
#include <trellis/elastic.h>
#include <trellis/job/job.h>
#include <trellis/rpc.h>
