// examples/row_shards.h: splitting a batch's lookups over the servers. The
// property the examples rely on: the servers' bags, summed, are the bags of
// the whole tables, for any number of servers and tables (rows that do not
// divide evenly, servers that get no rows of a batch, empty bags), and bad
// ids or offsets are refused, naming the table.

#include "../../examples/row_shards.h"

#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using trellis::examples::ClickWorld;
using trellis::examples::shardRows;
using trellis::examples::splitLookups;

constexpr int64_t kDim = 4;

// Server s's stacked weight, laid out as row_shards.h says: table t's rows
// r with r % servers == s, at t * shardRows(...) + r / servers.
at::Tensor serverWeight(const std::vector<at::Tensor>& tables, int64_t servers,
                        int64_t s) {
  const int64_t rows = tables[0].size(0);
  const int64_t mine = shardRows(rows, servers, s);
  at::Tensor w = torch::full({static_cast<int64_t>(tables.size()) * mine, kDim},
                             std::nan(""));
  for (size_t t = 0; t < tables.size(); ++t) {
    for (int64_t r = s; r < rows; r += servers) {
      w[static_cast<int64_t>(t) * mine + r / servers] = tables[t][r];
    }
  }
  return w;
}

// The bags of the whole tables, [tables * bags, kDim], table 0's first.
at::Tensor wholeBags(const ClickWorld::Batch& b,
                     const std::vector<at::Tensor>& tables) {
  std::vector<at::Tensor> parts;
  for (size_t t = 0; t < tables.size(); ++t) {
    parts.push_back(std::get<0>(
        at::embedding_bag(tables[t], b.ids[t], b.offsets[t], false, 0)));
  }
  return torch::cat(parts);
}

// The same bags from the servers' lookups, summed as the trainers do.
at::Tensor shardedBags(const ClickWorld::Batch& b,
                       const std::vector<at::Tensor>& tables, int64_t servers) {
  const int64_t rows = tables[0].size(0);
  const int64_t bags = b.offsets[0].size(0);
  const auto lookups = splitLookups(b, rows, servers);
  EXPECT_EQ(lookups.size(), static_cast<size_t>(servers));
  at::Tensor sum =
      torch::zeros({static_cast<int64_t>(tables.size()) * bags, kDim});
  for (int64_t s = 0; s < servers; ++s) {
    const auto& l = lookups[static_cast<size_t>(s)];
    if (l.ids.numel() == 0) {
      EXPECT_FALSE(l.offsets.defined()) << "server " << s;
      continue;
    }
    EXPECT_EQ(l.offsets.numel(), static_cast<int64_t>(tables.size()) * bags);
    const at::Tensor w = serverWeight(tables, servers, s);
    // Every id is a row of that server's weight (no NaN filler reached).
    EXPECT_GE(l.ids.min().item<int64_t>(), 0);
    EXPECT_LT(l.ids.max().item<int64_t>(), w.size(0));
    sum += std::get<0>(at::embedding_bag(w, l.ids, l.offsets, false, 0));
  }
  return sum;
}

std::vector<at::Tensor> randomTables(int64_t count, int64_t rows) {
  std::vector<at::Tensor> out;
  for (int64_t t = 0; t < count; ++t) {
    out.push_back(torch::randn({rows, kDim}));
  }
  return out;
}

// A batch of the given bags (each a list of ids), the same for each table.
ClickWorld::Batch batchOf(int64_t tables,
                          const std::vector<std::vector<int64_t>>& bags) {
  ClickWorld::Batch b;
  for (int64_t t = 0; t < tables; ++t) {
    std::vector<int64_t> ids, offsets;
    for (const auto& bag : bags) {
      offsets.push_back(static_cast<int64_t>(ids.size()));
      ids.insert(ids.end(), bag.begin(), bag.end());
    }
    b.ids.push_back(torch::tensor(ids, torch::kLong));
    b.offsets.push_back(torch::tensor(offsets, torch::kLong));
  }
  return b;
}

TEST(RowShards, ServersBagsSumToTheWholeTablesBags) {
  torch::manual_seed(7);
  // rows 101 divides by none of 2, 3, 4, 7: the last servers hold fewer.
  for (const int64_t rows : {int64_t{100}, int64_t{101}}) {
    for (const int64_t tables : {int64_t{1}, int64_t{3}}) {
      ClickWorld world({.tables = tables, .rows = rows, .seed = 11});
      const auto whole = randomTables(tables, rows);
      std::mt19937_64 g(5);
      for (const int64_t servers : {1, 2, 3, 4, 7}) {
        for (int round = 0; round < 3; ++round) {
          const auto b = world.draw(g, 17);
          const at::Tensor want = wholeBags(b, whole);
          const at::Tensor got = shardedBags(b, whole, servers);
          EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5))
              << rows << " rows, " << tables << " tables, " << servers
              << " servers, round " << round << ": max diff "
              << (got - want).abs().max().item<float>();
        }
      }
    }
  }
}

TEST(RowShards, EmptyBagsAndAServerWithoutRowsOfTheBatch) {
  torch::manual_seed(8);
  const auto whole = randomTables(2, 10);
  // Only even ids: server 1 of 2 gets none of this batch's rows; bags 1
  // and 3 are empty.
  const auto b = batchOf(2, {{0, 2, 2}, {}, {8}, {}, {4, 6}});
  const auto lookups = splitLookups(b, 10, 2);
  EXPECT_EQ(lookups[1].ids.numel(), 0);
  EXPECT_FALSE(lookups[1].offsets.defined());
  EXPECT_TRUE(torch::allclose(shardedBags(b, whole, 2), wholeBags(b, whole)));
  // Server 0's rows: table 0's at 0.., table 1's at 5.. (5 rows each).
  EXPECT_EQ(std::vector<int64_t>(lookups[0].ids.data_ptr<int64_t>(),
                                 lookups[0].ids.data_ptr<int64_t>() + 12),
            (std::vector<int64_t>{0, 1, 1, 4, 2, 3, 5, 6, 6, 9, 7, 8}));
  EXPECT_EQ(std::vector<int64_t>(lookups[0].offsets.data_ptr<int64_t>(),
                                 lookups[0].offsets.data_ptr<int64_t>() + 10),
            (std::vector<int64_t>{0, 3, 3, 4, 4, 6, 9, 9, 10, 10}));
  // A batch of no bags at all: nothing to look up anywhere.
  for (const auto& l : splitLookups(batchOf(2, {}), 10, 3)) {
    EXPECT_EQ(l.ids.numel(), 0);
  }
}

TEST(RowShards, BadIdsAndOffsetsAreRefusedNamingTheTable) {
  using ::testing::HasSubstr;
  const auto expectThrow = [](auto&& f, const char* what, const char* text) {
    try {
      f();
      ADD_FAILURE() << what << ": no exception";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr(text)) << what;
    }
  };
  auto b = batchOf(2, {{1, 2}, {3}});
  b.ids[1][2] = 10;  // table 1's last id, one past its 10 rows
  expectThrow([&] { splitLookups(b, 10, 2); }, "id past the rows",
              "table 1 id 10 outside its 10 rows");
  b.ids[1][2] = -1;
  expectThrow([&] { splitLookups(b, 10, 2); }, "negative id",
              "table 1 id -1 outside");
  b = batchOf(2, {{1, 2}, {3}});
  b.offsets[0][0] = 1;  // does not start at 0
  expectThrow([&] { splitLookups(b, 10, 2); }, "offsets from 1",
              "table 0's bag 0");
  b = batchOf(2, {{1, 2}, {3}, {4}});
  b.offsets[1][2] = 1;  // goes down
  expectThrow([&] { splitLookups(b, 10, 2); }, "decreasing offsets",
              "table 1's bag 1");
  b = batchOf(1, {{1, 2}, {3}});
  b.offsets[0][1] = 9;  // past the 3 ids
  expectThrow([&] { splitLookups(b, 10, 2); }, "offset past the ids",
              "table 0's bag 0 spans ids 0..9 of its 3");
  b = batchOf(2, {{1}});
  b.offsets.pop_back();
  expectThrow([&] { splitLookups(b, 10, 2); }, "a table without offsets",
              "2 id lists but 1 offset lists");
  b = batchOf(2, {{1}, {2}});
  b.offsets[1] = torch::tensor({int64_t{0}}, torch::kLong);
  expectThrow([&] { splitLookups(b, 10, 2); }, "fewer bags in table 1",
              "table 1 needs 1-d ids and 1-d offsets of 2 bags");
  expectThrow([&] { splitLookups(batchOf(1, {{1}}), 10, 0); }, "no servers",
              "10 rows over 0 servers");
  expectThrow([&] { splitLookups(batchOf(1, {{1}}), 2, 3); },
              "more servers than rows", "2 rows over 3 servers");
}

}  // namespace
