#pragma once
// How the DLRM-shaped examples spread their tables over parameter servers
// (header only): used by examples/hybrid_training.cc and by
// bench/hybrid_bench.cc's floor, so both split a batch the same way.
//
// Row r of every table lives on server r % servers, as that server's row
// r / servers of the table; each server stacks its rows of all tables in
// one weight (table t's first, then table t+1's), so one lookup per server
// covers every table.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
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
// One pass over the batch's ids in plain C++: with at:: ops (a mask, a
// masked_select and a bincount per table and server) the split was about
// 60 small ops, 0.35 ms of a trainer's 64-sample step (docs/examples.md).
// Throws std::out_of_range for an id outside [0, rows) and
// std::invalid_argument for offsets that are not a table's bag starts.
inline std::vector<ShardLookup> splitLookups(const ClickWorld::Batch& b,
                                             int64_t rows, int64_t servers) {
  if (servers < 1 || rows < servers) {
    throw std::invalid_argument("splitLookups: " + std::to_string(rows) +
                                " rows over " + std::to_string(servers) +
                                " servers");
  }
  if (b.offsets.size() != b.ids.size()) {
    throw std::invalid_argument(
        "splitLookups: " + std::to_string(b.ids.size()) + " id lists but " +
        std::to_string(b.offsets.size()) + " offset lists");
  }
  const size_t tables = b.ids.size();
  const int64_t bags = b.offsets.empty() ? 0 : b.offsets[0].size(0);
  const auto n = static_cast<size_t>(servers);
  // ids[s], offsets[s]: server s's rows and bag starts, all tables.
  std::vector<std::vector<int64_t>> ids(n), offsets(n);
  for (size_t s = 0; s < n; ++s) {
    offsets[s].reserve(tables * static_cast<size_t>(bags));
  }
  for (size_t t = 0; t < tables; ++t) {
    const at::Tensor tableIds = b.ids[t].to(at::kLong).contiguous();
    const at::Tensor tableOffsets = b.offsets[t].to(at::kLong).contiguous();
    if (tableIds.dim() != 1 || tableOffsets.dim() != 1 ||
        tableOffsets.size(0) != bags) {
      throw std::invalid_argument("splitLookups: table " + std::to_string(t) +
                                  " needs 1-d ids and 1-d offsets of " +
                                  std::to_string(bags) + " bags");
    }
    const int64_t total = tableIds.size(0);
    const int64_t* id = tableIds.data_ptr<int64_t>();
    const int64_t* start = tableOffsets.data_ptr<int64_t>();
    // Table t's rows of server s start at base[s] of its stacked weight.
    std::vector<int64_t> base(n);
    for (size_t s = 0; s < n; ++s) {
      base[s] = static_cast<int64_t>(t) *
                shardRows(rows, servers, static_cast<int64_t>(s));
      ids[s].reserve(ids[s].size() + static_cast<size_t>(total / servers) + 1);
    }
    for (int64_t bag = 0; bag < bags; ++bag) {
      // Bag starts that begin at 0 and never go down or past the end.
      const int64_t end = bag + 1 < bags ? start[bag + 1] : total;
      if ((bag == 0 && start[0] != 0) || end < start[bag] || end > total) {
        throw std::invalid_argument(
            "splitLookups: table " + std::to_string(t) + "'s bag " +
            std::to_string(bag) + " spans ids " + std::to_string(start[bag]) +
            ".." + std::to_string(end) + " of its " + std::to_string(total) +
            " (offsets must start at 0 and not decrease)");
      }
      for (size_t s = 0; s < n; ++s) {
        offsets[s].push_back(static_cast<int64_t>(ids[s].size()));
      }
      for (int64_t i = start[bag]; i < end; ++i) {
        const int64_t r = id[i];
        if (r < 0 || r >= rows) {
          throw std::out_of_range("splitLookups: table " + std::to_string(t) +
                                  " id " + std::to_string(r) + " outside its " +
                                  std::to_string(rows) + " rows");
        }
        const auto s = static_cast<size_t>(r % servers);
        ids[s].push_back(base[s] + r / servers);
      }
    }
  }
  const auto tensorOf = [](const std::vector<int64_t>& v) {
    at::Tensor out = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
    std::copy(v.begin(), v.end(), out.data_ptr<int64_t>());
    return out;
  };
  std::vector<ShardLookup> out(n);
  for (size_t s = 0; s < n; ++s) {
    out[s].ids = tensorOf(ids[s]);
    if (!ids[s].empty()) {
      out[s].offsets = tensorOf(offsets[s]);
    }
  }
  return out;
}

}  // namespace trellis::examples
