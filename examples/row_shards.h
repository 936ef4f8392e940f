#pragma once
// How the DLRM-shaped examples spread their tables over parameter servers
// (header only): used by examples/hybrid_training.cc and by
// bench/hybrid_bench.cc's floor, so both split a batch the same way.
//
// Row r of every table lives on server r % servers, as that server's row
// r / servers of the table; each server stacks its rows of all tables in
// one weight (table t's first, then table t+1's), so one lookup per server
// covers every table.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "click_data.h"

namespace trellis::examples {

// Rows of one table that live on server `shard`.
inline int64_t shardRows(int64_t rows, int64_t servers, int64_t shard) {
  return (rows - shard + servers - 1) / servers;
}

// One server's part of a batch's lookups: rows of its stacked weight and
// the offsets of the bags, table 0's bags first, then table 1's, ...
// (tables × bags bags, some of them empty). `ids` is empty when none of
// the batch's rows live on that server.
struct ShardLookup {
  at::Tensor ids;
  at::Tensor offsets;
};

// `b`'s lookups, one per server (`rows` per table, `servers` servers).
inline std::vector<ShardLookup> splitLookups(const ClickWorld::Batch& b,
                                             int64_t rows, int64_t servers) {
  const auto tables = static_cast<int64_t>(b.ids.size());
  const int64_t bags = b.offsets.empty() ? 0 : b.offsets[0].size(0);
  const auto n = static_cast<size_t>(servers);
  // ids[s] and counts[s]: per table, server s's rows and bag sizes.
  std::vector<std::vector<at::Tensor>> ids(n), counts(n);
  for (int64_t t = 0; t < tables; ++t) {
    const at::Tensor& tableIds = b.ids[static_cast<size_t>(t)];
    // The bag of each id.
    at::Tensor bagOf = torch::repeat_interleave(
        torch::diff(b.offsets[static_cast<size_t>(t)],
                    /*n=*/1, /*dim=*/0, /*prepend=*/c10::nullopt,
                    torch::tensor({tableIds.size(0)}, torch::kLong)));
    at::Tensor server = tableIds.remainder(servers);
    for (int64_t s = 0; s < servers; ++s) {
      at::Tensor mask = server.eq(s);
      const int64_t base = t * shardRows(rows, servers, s);
      ids[static_cast<size_t>(s)].push_back(
          tableIds.masked_select(mask).div(servers, "floor") + base);
      counts[static_cast<size_t>(s)].push_back(
          torch::bincount(bagOf.masked_select(mask), {}, bags));
    }
  }
  std::vector<ShardLookup> out(n);
  for (size_t s = 0; s < n; ++s) {
    out[s].ids = torch::cat(ids[s]);
    if (out[s].ids.numel() > 0) {
      const at::Tensor perBag = torch::cat(counts[s]);
      out[s].offsets = perBag.cumsum(0) - perBag;
    }
  }
  return out;
}

}  // namespace trellis::examples
