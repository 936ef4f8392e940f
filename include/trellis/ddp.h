#pragma once

// DistributedDataParallel, Join and SyncBatchNorm, in one include
// (docs/ddp.md), with the collectives they run over. Link trellis::ddp.
//
//   #include <trellis/ddp.h>
//   trellis::ddp::DistributedDataParallel model(net, group);

#include <trellis/collectives.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/ddp/join.h>
#include <trellis/ddp/sync_batch_norm.h>
