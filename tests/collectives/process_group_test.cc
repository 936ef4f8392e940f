// ProcessGroup with the cpu backend: ranks as threads of this process, each
// with its own group (own transport context and pipes) over one HashStore.
// Every result is checked against a reference computed locally.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "thread_ranks.h"
#include <trellis/collectives/cpu/mesh.h>
#include <trellis/collectives/cpu/message.h>
#include <trellis/collectives/process_group.h>
#include <trellis/core/error.h>
#include <trellis/store/hash_store.h>
#include <trellis/store/prefix_store.h>
#include <trellis/transport/context.h>
#include <trellis/transport/pipe.h>

namespace trellis::collectives {
namespace {

using namespace std::chrono_literals;

// TRELLIS_COLLECTIVES_ALGO for the groups a test creates.
class ScopedAlgo {
 public:
  explicit ScopedAlgo(const char* algo) {
    if (algo == nullptr) {
      unsetenv("TRELLIS_COLLECTIVES_ALGO");
    } else {
      setenv("TRELLIS_COLLECTIVES_ALGO", algo, 1);
    }
  }
  ~ScopedAlgo() { unsetenv("TRELLIS_COLLECTIVES_ALGO"); }
};

// TRELLIS_COLLECTIVES_RANKS_PER_HOST (0: unset, every rank on this host).
class ScopedRanksPerHost {
 public:
  explicit ScopedRanksPerHost(int k) {
    if (k > 0) {
      setenv("TRELLIS_COLLECTIVES_RANKS_PER_HOST", std::to_string(k).c_str(),
             1);
    }
  }
  ~ScopedRanksPerHost() { unsetenv("TRELLIS_COLLECTIVES_RANKS_PER_HOST"); }
};

// Options for ranks that share this process: a failed group must not end
// it.
ProcessGroupOptions sharedProcessOptions(Duration timeout) {
  ProcessGroupOptions o;
  o.timeout = timeout;
  o.watchdogMode = WatchdogMode::kFail;
  return o;
}

// Runs fn(pg) on n threads, one rank each (thread_ranks.h).
void runRanks(int n, const std::function<void(ProcessGroup&)>& fn,
              ProcessGroupOptions options = {},
              std::shared_ptr<store::Store> store = nullptr) {
  testing::runThreadRanks(
      n, [&](int, std::shared_ptr<ProcessGroup> pg) { fn(*pg); }, options,
      std::move(store));
}

// Rank r's deterministic input: small integers, so every reduction is exact
// in every dtype (float16 and bfloat16 included). Element i is
// i % 5 + rank + 1 (for bool: whether that is even), filled in place: a
// 4 MiB input costs one 4 MiB allocation, not int64 temporaries 8x larger
// (fresh pages fault in at a fraction of memcpy speed here).
torch::Tensor input(int rank, int64_t n, torch::ScalarType dtype) {
  auto t = torch::empty({n}, dtype);
  for (int64_t k = 0; k < std::min<int64_t>(n, 5); ++k) {
    const int64_t v = k + rank + 1;
    t.slice(0, k, n, 5)
        .fill_(dtype == torch::kBool ? c10::Scalar(v % 2 == 0)
                                     : c10::Scalar(v));
  }
  return t;
}

torch::Tensor reference(int size, int64_t n, torch::ScalarType dtype,
                        ReduceOp op) {
  if (n > 5) {
    // Every input has period 5, and every op is elementwise.
    const auto period = reference(size, 5, dtype, op);
    auto out = torch::empty({n}, dtype);
    for (int64_t k = 0; k < 5; ++k) {
      out.slice(0, k, n, 5).fill_(period[k].item());
    }
    return out;
  }
  torch::Tensor acc = input(0, n, dtype).to(torch::kDouble);
  for (int r = 1; r < size; ++r) {
    auto x = input(r, n, dtype).to(torch::kDouble);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc = acc + x;
        break;
      case ReduceOp::kProduct:
        acc = acc * x;
        break;
      case ReduceOp::kMin:
        acc = torch::minimum(acc, x);
        break;
      case ReduceOp::kMax:
        acc = torch::maximum(acc, x);
        break;
      default:
        ADD_FAILURE() << "no reference for this op";
    }
  }
  if (dtype == torch::kBool) {
    // Sum and max are "or", product and min "and".
    return (acc != 0);
  }
  if (op == ReduceOp::kAvg) {
    if (torch::isFloatingType(dtype)) {
      acc = acc / size;
    } else {
      acc = torch::div(acc, size, "trunc");
    }
  }
  return acc.to(dtype);
}

const std::vector<torch::ScalarType> kDtypes = {
    torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16, torch::kChar,
    torch::kByte,  torch::kInt,    torch::kLong, torch::kBool};

struct SweepCase {
  int size;
  const char* algo;
  // Ranks per (pretended) host; 0: all on this one.
  int ranksPerHost = 0;
};

class AllreduceSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(AllreduceSweep, EveryDtypeAndSizeMatchesTheReference) {
  const auto [n, algo, ranksPerHost] = GetParam();
  ScopedAlgo scoped(algo);
  ScopedRanksPerHost hosts(ranksPerHost);
  // 70001: more than one shared-memory block for the 8-byte dtypes.
  const std::vector<int64_t> sizes = {0, 1, 7, 1001, 70001};
  runRanks(n, [&](ProcessGroup& pg) {
    for (auto dtype : kDtypes) {
      for (int64_t count : sizes) {
        auto t = input(pg.rank(), count, dtype);
        pg.allreduce(t).wait();
        auto want = reference(n, count, dtype, ReduceOp::kSum);
        ASSERT_TRUE(torch::equal(t, want))
            << c10::toString(dtype) << "[" << count << "] rank " << pg.rank();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, AllreduceSweep,
    ::testing::Values(SweepCase{1, "ring"}, SweepCase{2, "ring"},
                      SweepCase{3, "ring"}, SweepCase{4, "ring"},
                      SweepCase{5, "ring"}, SweepCase{8, "ring"},
                      SweepCase{2, "rd"}, SweepCase{3, "rd"},
                      SweepCase{4, "rd"}, SweepCase{5, "rd"},
                      SweepCase{8, "rd"}, SweepCase{2, "hier"},
                      SweepCase{3, "hier"}, SweepCase{5, "hier"},
                      SweepCase{8, "hier"}, SweepCase{4, "hier", 2},
                      SweepCase{5, "hier", 2}, SweepCase{8, "hier", 3},
                      SweepCase{4, "hier", 1}, SweepCase{4, "auto", 3}),
    [](const auto& info) {
      return std::string(info.param.algo) + std::to_string(info.param.size) +
             (info.param.ranksPerHost > 0
                  ? "_per_host" + std::to_string(info.param.ranksPerHost)
                  : "");
    });

// Every other collective × every dtype × world sizes 1–8 × sizes 0, 1 and
// 7, and 4 MiB + 1 element at 2 and 3 ranks, against references computed
// locally (allreduce has its own sweep above, per algorithm).
struct OpSweepCase {
  int size;
  bool big;
};

class OpSweep : public ::testing::TestWithParam<OpSweepCase> {};

// The sweep's inputs of one dtype and count: in[q] is input(q, count,
// dtype) for q < n * n, and sum the sum over ranks 0..n-1. Made once
// before the ranks start and only read by them (a rank clones what a
// collective writes into): made per use, each 4 MiB case spent 55-120 s
// faulting in fresh pages for 32 MiB int64 temporaries.
struct SweepInputs {
  std::vector<torch::Tensor> in;
  torch::Tensor sum;
};

TEST_P(OpSweep, EveryOpAndDtypeMatchesTheReference) {
  const auto [n, big] = GetParam();
  std::map<std::pair<torch::ScalarType, int64_t>, SweepInputs> made;
  for (auto dtype : kDtypes) {
    const int64_t bigCount =
        (4 << 20) / static_cast<int64_t>(c10::elementSize(dtype)) + 1;
    for (int64_t count :
         big ? std::vector<int64_t>{bigCount} : std::vector<int64_t>{0, 1, 7}) {
      SweepInputs& x = made[{dtype, count}];
      for (int q = 0; q < n * n; ++q) {
        x.in.push_back(input(q, count, dtype));
      }
      x.sum = reference(n, count, dtype, ReduceOp::kSum);
    }
  }
  runRanks(n, [&, n = n](ProcessGroup& pg) {
    const int r = pg.rank();
    for (const auto& [key, x] : made) {
      const auto [dtype, count] = key;
      const auto in = [&x](int q) -> const torch::Tensor& {
        return x.in[static_cast<size_t>(q)];
      };
      const auto what = [&, dtype = dtype, count = count](const char* op) {
        return std::string(op) + " " + c10::toString(dtype) + "[" +
               std::to_string(count) + "] rank " + std::to_string(r) + " of " +
               std::to_string(n);
      };
      const int root = static_cast<int>(count % n);
      auto b = in(r).clone();
      pg.broadcast(b, root).wait();
      ASSERT_TRUE(torch::equal(b, in(root))) << what("broadcast");
      auto red = in(r).clone();
      pg.reduce(red, root).wait();
      ASSERT_TRUE(torch::equal(red, r == root ? x.sum : in(r)))
          << what("reduce");
      std::vector<torch::Tensor> all;
      for (int q = 0; q < n; ++q) {
        all.push_back(torch::empty({count}, dtype));
      }
      pg.allgather(all, in(r)).wait();
      for (int q = 0; q < n; ++q) {
        ASSERT_TRUE(torch::equal(all[static_cast<size_t>(q)], in(q)))
            << what("allgather") << " block " << q;
      }
      std::vector<torch::Tensor> gathered;
      if (r == root) {
        for (int q = 0; q < n; ++q) {
          gathered.push_back(torch::empty({count}, dtype));
        }
      }
      pg.gather(gathered, in(r), root).wait();
      for (size_t q = 0; q < gathered.size(); ++q) {
        ASSERT_TRUE(torch::equal(gathered[q], in(static_cast<int>(q))))
            << what("gather") << " block " << q;
      }
      std::vector<torch::Tensor> parts;
      if (r == root) {
        for (int q = 0; q < n; ++q) {
          parts.push_back(in(q));
        }
      }
      auto mine = torch::empty({count}, dtype);
      pg.scatter(mine, parts, root).wait();
      ASSERT_TRUE(torch::equal(mine, in(r))) << what("scatter");
      // Block q of every rank's input is its input rolled by q, so a
      // block mixed up with another gives a different sum.
      std::vector<torch::Tensor> blocks;
      for (int q = 0; q < n; ++q) {
        blocks.push_back(count > 0 ? in(r).roll(q) : in(r).clone());
      }
      auto reduced = torch::empty({count}, dtype);
      pg.reduceScatter(reduced, blocks).wait();
      ASSERT_TRUE(torch::equal(reduced, count > 0 ? x.sum.roll(r) : x.sum))
          << what("reduceScatter");
      // Rank r's block q is input(r * n + q): rank q gets it as block r.
      std::vector<torch::Tensor> outgoing;
      for (int q = 0; q < n; ++q) {
        outgoing.push_back(in(r * n + q));
      }
      auto received = torch::empty({count * n}, dtype);
      pg.alltoall(received, torch::cat(outgoing)).wait();
      for (int q = 0; q < n; ++q) {
        ASSERT_TRUE(
            torch::equal(received.narrow(0, q * count, count), in(q * n + r)))
            << what("alltoall") << " block " << q;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, OpSweep,
    ::testing::Values(OpSweepCase{1, false}, OpSweepCase{2, false},
                      OpSweepCase{3, false}, OpSweepCase{4, false},
                      OpSweepCase{5, false}, OpSweepCase{8, false},
                      OpSweepCase{2, true}, OpSweepCase{3, true}),
    [](const auto& info) {
      return std::to_string(info.param.size) + "ranks" +
             (info.param.big ? "_4MiB" : "");
    });

// The names of this process's threads (/proc/self/task/*/comm).
std::multiset<std::string> threadNames() {
  std::multiset<std::string> names;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    if (std::getline(in, name)) {
      names.insert(name);
    }
  }
  return names;
}

// docs/threads.md: every thread Trellis starts names itself. The cpu
// backend's worker runs each group's ops, so it is the thread that `top -H`
// and `perf` show busy during a collective.
TEST(ProcessGroup, EachGroupRunsItsOpsOnANamedThread) {
  runRanks(2, [&](ProcessGroup& pg) {
    auto t = torch::ones({4});
    pg.allreduce(t).wait();  // both groups exist, and have run an op
    if (pg.rank() == 0) {
      EXPECT_GE(threadNames().count("pg-cpu"), 2u);
    }
    pg.barrier().wait();  // neither group goes before rank 0 has looked
  });
}

TEST(ProcessGroup, AllreduceOpsMatchTheReference) {
  for (const char* algo : {"ring", "rd", "hier"}) {
    ScopedAlgo scoped(algo);
    runRanks(3, [&](ProcessGroup& pg) {
      for (auto op : {ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                      ReduceOp::kProduct}) {
        for (auto dtype : {torch::kFloat, torch::kLong, torch::kHalf}) {
          auto t = input(pg.rank(), 33, dtype);
          pg.allreduce(t, op).wait();
          ASSERT_TRUE(torch::equal(t, reference(3, 33, dtype, op)))
              << algo << " " << toString(op) << " " << c10::toString(dtype);
        }
      }
      // Bitwise ops on integers.
      auto a = torch::tensor({pg.rank() + 1, 6, 12}, torch::kInt);
      pg.allreduce(a, ReduceOp::kBor).wait();
      ASSERT_TRUE(torch::equal(a, torch::tensor({3, 6, 12}, torch::kInt)));
      auto b = torch::tensor({7, 6, 12 + pg.rank()}, torch::kLong);
      pg.allreduce(b, ReduceOp::kBxor).wait();
      ASSERT_TRUE(torch::equal(b, torch::tensor({7, 6, 15}, torch::kLong)));
    });
  }
}

TEST(ProcessGroup, LargeAllreduceAndAvgAgreeBitwiseOnEveryRank) {
  // 4 MiB + 1 element of float32, random values: every rank must end with
  // the same bits, and the values must match a double-precision sum.
  const int64_t count = (4 << 20) / 4 + 1;
  for (const char* algo : {"ring", "rd", "hier", "hier/2"}) {
    // hier/2: two pretended hosts of two ranks.
    ScopedAlgo scoped(std::string(algo).substr(0, 4).c_str());
    ScopedRanksPerHost hosts(std::string(algo) == "hier/2" ? 2 : 0);
    std::vector<torch::Tensor> results(4);
    runRanks(4, [&](ProcessGroup& pg) {
      auto gen = torch::make_generator<at::CPUGeneratorImpl>(pg.rank() + 7);
      auto t = torch::randn({count}, gen);
      pg.allreduce(t, ReduceOp::kAvg).wait();
      results[static_cast<size_t>(pg.rank())] = t;
    });
    torch::Tensor want = torch::zeros({count}, torch::kDouble);
    for (int r = 0; r < 4; ++r) {
      auto gen = torch::make_generator<at::CPUGeneratorImpl>(r + 7);
      want += torch::randn({count}, gen).to(torch::kDouble);
    }
    want /= 4;
    for (int r = 1; r < 4; ++r) {
      ASSERT_TRUE(torch::equal(results[0], results[static_cast<size_t>(r)]))
          << algo << " rank " << r;
    }
    EXPECT_TRUE(
        torch::allclose(results[0].to(torch::kDouble), want, 1e-5, 1e-5))
        << algo;
  }
}

// A ring step's chunk above 2 MiB travels in pieces, each reduced as it
// arrives: chunks of 3 MiB + a few elements (2 pieces, uneven) at 2 ranks
// and of 5 MiB (3 pieces) at 3, checked exactly (integers in float64).
TEST(ProcessGroup, RingChunksTravelInPiecesAndReduceExactly) {
  ScopedAlgo scoped("ring");
  for (const auto& [n, count] :
       {std::pair<int, int64_t>{2, (6 << 20) / 8 + 3},
        std::pair<int, int64_t>{3, 3 * ((5 << 20) / 8)}}) {
    runRanks(n, [&, n = n, count = count](ProcessGroup& pg) {
      auto t = torch::arange(count, torch::kDouble) + pg.rank();
      pg.allreduce(t).wait();
      auto want = torch::arange(count, torch::kDouble) * n + n * (n - 1) / 2;
      ASSERT_TRUE(torch::equal(t, want)) << "rank " << pg.rank() << " of " << n;
    });
  }
}

TEST(ProcessGroup, BroadcastAndReduceFromEveryRoot) {
  for (int n : {1, 2, 3, 5}) {
    runRanks(n, [&](ProcessGroup& pg) {
      for (int root = 0; root < n; ++root) {
        for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kBool}) {
          auto t = input(pg.rank(), 17, dtype);
          pg.broadcast(t, root).wait();
          ASSERT_TRUE(torch::equal(t, input(root, 17, dtype)))
              << "broadcast root " << root;
          auto u = input(pg.rank(), 17, dtype);
          pg.reduce(u, root, ReduceOp::kMax).wait();
          auto want = pg.rank() == root
                          ? reference(n, 17, dtype, ReduceOp::kMax)
                          : input(pg.rank(), 17, dtype);
          ASSERT_TRUE(torch::equal(u, want)) << "reduce root " << root;
        }
      }
    });
  }
}

TEST(ProcessGroup, GatherScatterAllgather) {
  for (int n : {1, 2, 3, 4}) {
    runRanks(n, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      for (int64_t count : {0, 1, 13}) {
        auto in = input(r, count, torch::kInt);
        std::vector<torch::Tensor> outs;
        for (int i = 0; i < n; ++i) {
          outs.push_back(torch::full({count}, -1, torch::kInt));
        }
        pg.allgather(outs, in).wait();
        for (int i = 0; i < n; ++i) {
          ASSERT_TRUE(torch::equal(outs[static_cast<size_t>(i)],
                                   input(i, count, torch::kInt)));
        }
        auto flat = torch::full({count * n}, -1, torch::kInt);
        pg.allgatherIntoTensor(flat, in).wait();
        for (int i = 0; i < n; ++i) {
          ASSERT_TRUE(torch::equal(flat.narrow(0, i * count, count),
                                   input(i, count, torch::kInt)));
        }
        const int root = n - 1;
        std::vector<torch::Tensor> gathered;
        if (r == root) {
          for (int i = 0; i < n; ++i) {
            gathered.push_back(torch::full({count}, -1, torch::kInt));
          }
        }
        pg.gather(gathered, in, root).wait();
        for (size_t i = 0; i < gathered.size(); ++i) {
          ASSERT_TRUE(torch::equal(
              gathered[i], input(static_cast<int>(i), count, torch::kInt)));
        }
        std::vector<torch::Tensor> pieces;
        if (r == 0) {
          for (int i = 0; i < n; ++i) {
            pieces.push_back(input(10 * i, count, torch::kInt));
          }
        }
        auto out = torch::full({count}, -1, torch::kInt);
        pg.scatter(out, pieces, 0).wait();
        ASSERT_TRUE(torch::equal(out, input(10 * r, count, torch::kInt)));
      }
    });
  }
}

TEST(ProcessGroup, ReduceScatterBothForms) {
  for (int n : {1, 2, 3, 5}) {
    runRanks(n, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      const int64_t count = 9;
      // Block i of rank r's input is input(r + 100 i): the reduction of
      // block i over ranks is reference-computable.
      std::vector<torch::Tensor> inputs;
      for (int i = 0; i < n; ++i) {
        inputs.push_back(input(r + 100 * i, count, torch::kDouble));
      }
      auto expected = torch::zeros({count}, torch::kDouble);
      for (int q = 0; q < n; ++q) {
        expected += input(q + 100 * r, count, torch::kDouble);
      }
      auto out = torch::zeros({count}, torch::kDouble);
      pg.reduceScatter(out, inputs).wait();
      ASSERT_TRUE(torch::equal(out, expected));
      auto flatIn = torch::cat(inputs);
      auto out2 = torch::zeros({count}, torch::kDouble);
      pg.reduceScatterTensor(out2, flatIn, ReduceOp::kAvg).wait();
      ASSERT_TRUE(torch::allclose(out2, expected / n));
    });
  }
}

TEST(ProcessGroup, AlltoallEqualAndUneven) {
  for (int n : {1, 2, 3, 4}) {
    runRanks(n, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      // Equal: 2 rows of 3 per peer; row value = 1000 * sender + 10 * dest.
      auto in = torch::empty({2 * n, 3}, torch::kLong);
      for (int d = 0; d < n; ++d) {
        in.narrow(0, 2 * d, 2).fill_(1000 * r + 10 * d);
      }
      auto out = torch::full({2 * n, 3}, -1, torch::kLong);
      pg.alltoall(out, in).wait();
      for (int s = 0; s < n; ++s) {
        ASSERT_TRUE(
            torch::equal(out.narrow(0, 2 * s, 2),
                         torch::full({2, 3}, 1000 * s + 10 * r, torch::kLong)));
      }
      // Uneven: rank s sends (s + d + 1) rows to rank d.
      std::vector<int64_t> inSplits, outSplits;
      for (int d = 0; d < n; ++d) {
        inSplits.push_back(r + d + 1);
        outSplits.push_back(d + r + 1);
      }
      int64_t inRows = 0, outRows = 0;
      for (int i = 0; i < n; ++i) {
        inRows += inSplits[static_cast<size_t>(i)];
        outRows += outSplits[static_cast<size_t>(i)];
      }
      auto uin = torch::empty({inRows, 2}, torch::kFloat);
      int64_t at = 0;
      for (int d = 0; d < n; ++d) {
        uin.narrow(0, at, inSplits[static_cast<size_t>(d)])
            .fill_(1000 * r + 10 * d);
        at += inSplits[static_cast<size_t>(d)];
      }
      auto uout = torch::full({outRows, 2}, -1, torch::kFloat);
      pg.alltoall(uout, uin, outSplits, inSplits).wait();
      at = 0;
      for (int s = 0; s < n; ++s) {
        const int64_t rows = outSplits[static_cast<size_t>(s)];
        ASSERT_TRUE(torch::equal(
            uout.narrow(0, at, rows),
            torch::full({rows, 2}, 1000 * s + 10 * r, torch::kFloat)));
        at += rows;
      }
    });
  }
}

TEST(ProcessGroup, CoalescedBarrierAndManyOpsInFlight) {
  runRanks(3, [&](ProcessGroup& pg) {
    std::vector<torch::Tensor> ts = {input(pg.rank(), 5, torch::kFloat),
                                     input(pg.rank(), 0, torch::kFloat),
                                     input(pg.rank(), 300, torch::kFloat)};
    pg.allreduceCoalesced(ts).wait();
    ASSERT_TRUE(
        torch::equal(ts[0], reference(3, 5, torch::kFloat, ReduceOp::kSum)));
    ASSERT_TRUE(
        torch::equal(ts[2], reference(3, 300, torch::kFloat, ReduceOp::kSum)));
    pg.barrier().wait();
    // 100 ops issued before any is waited for; they complete in order.
    std::vector<torch::Tensor> tensors;
    std::vector<Work> works;
    for (int i = 0; i < 100; ++i) {
      tensors.push_back(torch::full({64}, i + pg.rank(), torch::kLong));
      works.push_back(pg.allreduce(tensors.back()));
    }
    for (int i = 0; i < 100; ++i) {
      works[static_cast<size_t>(i)].wait();
      ASSERT_TRUE(torch::equal(tensors[static_cast<size_t>(i)],
                               torch::full({64}, 3 * i + 3, torch::kLong)));
    }
  });
}

// allreduceCoalesced reduces its tensors where they are when the group
// shares one host (no packing): pieces that start and end inside the
// segment's blocks (131072 floats each), empty ones, and a small total
// that takes the every-rank-reduces path. Each result must be the bits of
// an allreduce of the same values packed into one tensor, with the
// segment and with the packing path a forced ring algorithm takes.
TEST(ProcessGroup, CoalescedUnpackedEqualsPacked) {
  const std::vector<std::vector<int64_t>> layouts = {
      {1, 0, 70000, 3, 200001, 0, 5000},  // large blocks, pieces split
      {7, 1, 0, 300, 2},                  // one small block
  };
  for (const char* algo : {static_cast<const char*>(nullptr), "ring"}) {
    ScopedAlgo scoped(algo);
    for (int n : {2, 3}) {
      for (const auto& sizes : layouts) {
        for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kMax}) {
          SCOPED_TRACE(std::string(algo ? algo : "auto") + ", " +
                       std::to_string(n) + " ranks, " +
                       std::to_string(sizes.size()) + " tensors, op " +
                       std::to_string(static_cast<int>(op)));
          runRanks(n, [&](ProcessGroup& pg) {
            std::vector<torch::Tensor> ts;
            int64_t total = 0;
            for (int64_t s : sizes) {
              total += s;
            }
            // Different values per rank and position, not exact under kAvg.
            auto all =
                torch::arange(total, torch::kFloat).mul(0.37 + pg.rank()).sin();
            int64_t at = 0;
            for (int64_t s : sizes) {
              ts.push_back(all.narrow(0, at, s).clone());
              at += s;
            }
            auto packed = all.clone();
            pg.allreduceCoalesced(ts, op).wait();
            pg.allreduce(packed, op).wait();
            at = 0;
            for (size_t i = 0; i < ts.size(); ++i) {
              ASSERT_TRUE(torch::equal(ts[i], packed.narrow(0, at, sizes[i])))
                  << "tensor " << i;
              at += sizes[i];
            }
          });
        }
      }
    }
  }
}

TEST(ProcessGroup, SendRecvMatchByTagAndAnySource) {
  runRanks(3, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    if (r != 0) {
      // Tag 2 is sent before tag 1: receives match by tag, not arrival.
      pg.send(torch::full({4}, 10 * r + 2, torch::kInt), 0, 2).wait();
      pg.send(torch::full({4}, 10 * r + 1, torch::kInt), 0, 1).wait();
      return;
    }
    for (int src : {1, 2}) {
      auto a = torch::zeros({4}, torch::kInt);
      pg.recv(a, src, 1).wait();
      ASSERT_TRUE(torch::equal(a, torch::full({4}, 10 * src + 1, torch::kInt)));
    }
    std::set<int> sources;
    for (int i = 0; i < 2; ++i) {
      auto b = torch::zeros({4}, torch::kInt);
      Work w = pg.recvAnysource(b, 2);
      w.wait();
      sources.insert(w.sourceRank());
      ASSERT_TRUE(torch::equal(
          b, torch::full({4}, 10 * w.sourceRank() + 2, torch::kInt)));
    }
    ASSERT_EQ(sources, (std::set<int>{1, 2}));
    // A size mismatch fails that receive only; the group goes on.
  });
}

TEST(ProcessGroup, SubgroupsAndTwoGroupsAtOnce) {
  runRanks(4, [&](ProcessGroup& pg) {
    auto even = pg.newGroup({0, 2});
    auto odd = pg.newGroup({3, 1});
    auto mine = pg.rank() % 2 == 0 ? even : odd;
    ASSERT_TRUE(mine);
    ASSERT_EQ(pg.rank() % 2 == 0 ? odd : even, nullptr);
    ASSERT_EQ(mine->size(), 2);
    // Issue on both groups before waiting on either.
    auto t = torch::full({8}, pg.rank(), torch::kLong);
    auto u = torch::full({8}, pg.rank(), torch::kLong);
    Work a = mine->allreduce(t);
    Work b = pg.allreduce(u);
    a.wait();
    b.wait();
    const int64_t sub = pg.rank() % 2 == 0 ? 0 + 2 : 1 + 3;
    ASSERT_TRUE(torch::equal(t, torch::full({8}, sub, torch::kLong)));
    ASSERT_TRUE(torch::equal(u, torch::full({8}, 6, torch::kLong)));
    // The subgroup's rank 0 is ranks[0].
    if (pg.rank() == 3) {
      ASSERT_EQ(mine->rank(), 0);
    }
  });
}

std::string failureOf(const Work& w) {
  try {
    w.wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every rank learns of the desync, wherever it is: waiting for its op, in
// its next op (the broadcast's root may finish before it hears), or still
// in ProcessGroup::create, finishing its handshakes, when the rank that
// found the desync has already given up on the group (once in 40 runs
// under load, for rank 0). Each rank's error names both ops.
TEST(ProcessGroup, DifferentCollectivesFailOnEveryRankNamingBoth) {
  const auto errors = testing::runThreadRanksCollectingFailures(
      3, [](int rank, std::shared_ptr<ProcessGroup> pg) {
        auto t = torch::ones({16});
        Work w = rank == 1 ? pg->broadcast(t, 1) : pg->allreduce(t);
        w.wait();
        pg->barrier().wait();
      });
  for (size_t r = 0; r < errors.size(); ++r) {
    const std::string& e = errors[r];
    EXPECT_NE(e.find("desync"), std::string::npos) << "rank " << r << ": " << e;
    EXPECT_NE(e.find("seq 1 allreduce(float32[16], sum)"), std::string::npos)
        << "rank " << r << ": " << e;
    EXPECT_NE(e.find("seq 1 broadcast(float32[16], root 1)"), std::string::npos)
        << "rank " << r << ": " << e;
  }
}

TEST(ProcessGroup, SizesThatDifferBetweenRanksAreNamed) {
  std::vector<std::string> errors(2);
  runRanks(2, [&](ProcessGroup& pg) {
    auto t = torch::ones({pg.rank() == 0 ? 10 : 12});
    errors[static_cast<size_t>(pg.rank())] = failureOf(pg.allreduce(t));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("float32[10]"), std::string::npos) << e;
    EXPECT_NE(e.find("float32[12]"), std::string::npos) << e;
  }
}

TEST(ProcessGroup, BadArgumentsThrowAtTheCallSiteAndTheGroupGoesOn) {
  runRanks(2, [&](ProcessGroup& pg) {
    auto expectBad = [](const std::function<void()>& f,
                        const std::string& needle) {
      try {
        f();
        ADD_FAILURE() << "no error; expected " << needle;
      } catch (const InvalidArgumentError& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
            << e.what();
      }
    };
    expectBad(
        [&] { (void)pg.allreduce(torch::ones({2}, torch::kComplexFloat)); },
        "dtype");
    expectBad(
        [&] {
          (void)pg.allreduce(torch::ones({4, 4}).t());
        },
        "not contiguous");
    expectBad([&] { (void)pg.broadcast(torch::ones({2}), 2); }, "root 2");
    expectBad([&] { (void)pg.allreduce(torch::ones({2}), ReduceOp::kBand); },
              "integer");
    expectBad([&] { (void)pg.send(torch::ones({2}), pg.rank()); }, "this rank");
    expectBad([&] { (void)pg.allgather({torch::ones({2})}, torch::ones({2})); },
              "1 output tensors");
    expectBad(
        [&] {
          (void)pg.alltoall(torch::ones({4}), torch::ones({4}), {1, 1}, {3, 2});
        },
        "split sizes");
    expectBad([&] { (void)pg.newGroup({0, 0}); }, "twice");
    // The group is unharmed.
    auto t = torch::ones({3});
    pg.allreduce(t).wait();
    ASSERT_TRUE(torch::equal(t, torch::full({3}, 2.0f)));
  });
}

TEST(ProcessGroup, WorldSizesThatDisagreeFailAtCreate) {
  auto store = std::make_shared<store::HashStore>();
  std::string e0, e1;
  ProcessGroupOptions o;
  o.timeout = 10s;
  std::thread t0([&] {
    try {
      (void)ProcessGroup::create("cpu", store, 0, 2, o);
    } catch (const std::exception& e) {
      e0 = e.what();
    }
  });
  std::thread t1([&] {
    try {
      (void)ProcessGroup::create("cpu", store, 1, 3, o);
    } catch (const std::exception& e) {
      e1 = e.what();
    }
  });
  t0.join();
  t1.join();
  EXPECT_NE(e0.find("world sizes disagree"), std::string::npos) << e0;
  EXPECT_NE(e1.find("world sizes disagree"), std::string::npos) << e1;
}

// A name longer than the mesh's hello carries fails at create, on every
// rank, naming it (it failed the peers' hellos and left create to wait).
TEST(ProcessGroup, ANameTooLongFailsAtCreateNamingIt) {
  auto store = std::make_shared<store::HashStore>();
  ProcessGroupOptions o;
  o.timeout = 10s;
  o.name = std::string(600, 'g');
  std::string errors[2];
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        (void)ProcessGroup::create("cpu", store, r, 2, o);
      } catch (const trellis::InvalidArgumentError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) {
    t.join();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("group name of 600 bytes"), std::string::npos) << e;
  }
  // At the bound it forms.
  o.name = std::string(kMaxGroupNameBytes, 'g');
  std::vector<std::shared_ptr<ProcessGroup>> groups(2);
  ranks.clear();
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      groups[static_cast<size_t>(r)] =
          ProcessGroup::create("cpu", store, r, 2, o);
    });
  }
  for (auto& t : ranks) {
    t.join();
  }
  at::Tensor x = at::ones({4});
  at::Tensor y = at::ones({4});
  Work wx = groups[0]->allreduce(x);
  Work wy = groups[1]->allreduce(y);
  wx.wait();
  wy.wait();
  EXPECT_TRUE(x.equal(at::full({4}, 2.0)));
  EXPECT_TRUE(y.equal(at::full({4}, 2.0)));
}

// Strangers on a rank's mesh listener while its group forms (anything
// that passes the transport's handshake: here no job token is set): a
// first message that is not a hello, a hello from a rank that never
// connects to this one, and one from a rank out of range. The rank closes
// each such pipe; the group still forms and computes right.
TEST(ProcessGroup, StrangersOnTheMeshListenerAreRefusedAndTheGroupForms) {
  auto store = std::make_shared<store::HashStore>();
  const ProcessGroupOptions o = sharedProcessOptions(30s);
  std::shared_ptr<ProcessGroup> pg2;
  std::string error2;
  std::thread rank2([&] {
    try {
      pg2 = ProcessGroup::create("cpu", store, 2, 3, o);
    } catch (const std::exception& e) {
      error2 = e.what();
    }
  });
  // Rank 2 listens for ranks 0 and 1 under the group's prefix.
  store::PrefixStore groupStore("pg/default#1", store);
  groupStore.wait({"addr/2"}, 30s);
  const std::string address = groupStore.getString("addr/2");
  transport::ContextOptions co;
  co.name = "stranger";
  co.tokenFromEnvironment = false;
  auto ctx = transport::Context::create(co);

  auto hello = [](int rank, int worldSize, std::string group) {
    detail::Header h;
    h.kind = detail::Header::Kind::kHello;
    h.rank = rank;
    h.worldSize = worldSize;
    h.groupId = std::move(group);
    return detail::encode(h);
  };
  // Sends `descriptor` as the first message; the rank must close the pipe.
  auto refused = [&](const std::string& descriptor, const std::string& what) {
    auto pipe = ctx->connect(address);
    transport::Message m;
    m.descriptor = descriptor;
    std::promise<Error> closed;
    pipe->write(std::move(m), [](const Error&) {});
    pipe->readDescriptor([&closed](const Error& e, transport::Descriptor) {
      closed.set_value(e);
    });
    auto f = closed.get_future();
    ASSERT_EQ(f.wait_for(20s), std::future_status::ready) << what;
    EXPECT_FALSE(f.get().ok()) << what << ": the rank kept the pipe open";
    pipe->close();
  };
  refused("not a collectives message", "garbage");
  refused(hello(2, 3, "default#1"), "a hello from the rank itself");
  refused(hello(7, 3, "default#1"), "a rank out of range");

  std::vector<std::shared_ptr<ProcessGroup>> low(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> lows;
  for (int r = 0; r < 2; ++r) {
    lows.emplace_back([&, r] {
      try {
        low[static_cast<size_t>(r)] =
            ProcessGroup::create("cpu", store, r, 3, o);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : lows) {
    t.join();
  }
  rank2.join();
  ASSERT_EQ(error2, "");
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  std::vector<torch::Tensor> ts;
  std::vector<Work> works;
  for (int r = 0; r < 3; ++r) {
    ts.push_back(torch::full({1000}, r + 1, torch::kFloat));
    auto& pg = r == 2 ? pg2 : low[static_cast<size_t>(r)];
    works.push_back(pg->allreduce(ts.back()));
  }
  for (auto& w : works) {
    w.wait(30s);
  }
  for (const auto& t : ts) {
    EXPECT_TRUE(torch::equal(t, torch::full({1000}, 6, torch::kFloat)));
  }
}

// A rank failed by a peer's abort relays it to its other peers, naming the
// rank that gave up. Rank 0 here is a stand-in that tells only rank 1:
// rank 2, which never hears from rank 0 itself, still fails naming rank 0
// and its reason (before the relay it could see rank 1 leave first and
// blame rank 1, as in the two-hosts kill test).
TEST(Mesh, AnAbortIsRelayedNamingTheRankThatGaveUp) {
  auto store = std::make_shared<store::HashStore>();
  detail::MeshOptions mo;
  mo.groupId = "relay#1";
  mo.description = "group 'relay'";
  mo.localAddress = "127.0.0.1";
  mo.timeout = 30s;
  std::unique_ptr<detail::Mesh> m1;
  std::unique_ptr<detail::Mesh> m2;
  std::thread t1([&] { m1 = detail::Mesh::connect(*store, 1, 3, mo); });
  std::thread t2([&] { m2 = detail::Mesh::connect(*store, 2, 3, mo); });
  store->wait({"addr/1", "addr/2"}, 30s);
  transport::ContextOptions co;
  co.name = "stand-in rank 0";
  co.tokenFromEnvironment = false;
  auto ctx = transport::Context::create(co);
  auto say = [](const std::shared_ptr<transport::Pipe>& pipe,
                const detail::Header& h) {
    transport::Message m;
    m.descriptor = detail::encode(h);
    pipe->write(std::move(m), [](const Error&) {});
  };
  detail::Header hello;
  hello.kind = detail::Header::Kind::kHello;
  hello.rank = 0;
  hello.worldSize = 3;
  hello.groupId = mo.groupId;
  auto to1 = ctx->connect(store->getString("addr/1"));
  auto to2 = ctx->connect(store->getString("addr/2"));
  say(to1, hello);
  say(to2, hello);
  t1.join();
  t2.join();
  ASSERT_TRUE(m1 && m2);

  detail::Header abort;
  abort.kind = detail::Header::Kind::kAbort;
  abort.rank = 0;
  abort.code = Code::kUnavailable;
  abort.reason = "rank 0 lost its device";
  say(to1, abort);  // rank 2 is told nothing by rank 0
  const auto until = Clock::now() + 20s;
  while ((m1->error().ok() || m2->error().ok()) && Clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  const Error e1 = m1->error();
  const Error e2 = m2->error();
  EXPECT_EQ(e1.code(), Code::kUnavailable) << e1.what();
  EXPECT_NE(e1.message().find("group 'relay': rank 0 gave up on the group: "
                              "rank 0 lost its device"),
            std::string::npos)
      << e1.what();
  EXPECT_EQ(e2.code(), Code::kUnavailable) << e2.what();
  EXPECT_NE(e2.message().find("group 'relay': rank 0 gave up (relayed by rank "
                              "1) on the group: rank 0 lost its device"),
            std::string::npos)
      << e2.what();
  m1.reset();
  m2.reset();
  to1->close();
  to2->close();
  ctx->close();
  ASSERT_TRUE(ctx->join(30s));
}

// Both ranks of a 2-rank group in this process, each owned by the caller
// alone (the tests below drop one of them inside a callback).
std::pair<std::shared_ptr<ProcessGroup>, std::shared_ptr<ProcessGroup>>
twoRanks() {
  auto store = std::make_shared<store::HashStore>();
  const ProcessGroupOptions o = sharedProcessOptions(30s);
  std::shared_ptr<ProcessGroup> pg1;
  std::thread t1([&] { pg1 = ProcessGroup::create("cpu", store, 1, 2, o); });
  auto pg0 = ProcessGroup::create("cpu", store, 0, 2, o);
  t1.join();
  return {std::move(pg0), std::move(pg1)};
}

// A callback on a Work's future that drops the group's last owner runs on
// the backend's worker, which then destroys the backend: nothing hangs or
// crashes, and the op queued behind fails instead of being forgotten.
TEST(ProcessGroup, LastOwnerDroppedInACompletionCallback) {
  auto [pg0, pg1] = twoRanks();
  ASSERT_TRUE(pg0 && pg1);
  auto a = torch::ones({8});
  auto queued = torch::ones({8});
  auto first = pg0->allreduce(a);  // waits for rank 1's
  auto behind = pg0->allreduce(queued);
  std::promise<std::thread::id> dropped;
  auto chained =
      first.future().then([held = std::move(pg0),
                           &dropped](const std::vector<at::Tensor>&) mutable {
        held.reset();
        dropped.set_value(std::this_thread::get_id());
      });
  pg1->allreduce(torch::ones({8})).wait(30s);
  auto f = dropped.get_future();
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  EXPECT_NE(f.get(), std::this_thread::get_id())
      << "the callback ran on the test's thread, not the worker's";
  EXPECT_TRUE(torch::equal(a, torch::full({8}, 2.0)));
  EXPECT_THROW(behind.wait(30s), Exception);
  pg1.reset();
}

// The same from a point-to-point op, whose callback runs on the transport's
// loop thread: the group's teardown must not join that thread from itself,
// and a receive posted behind it fails instead of hanging.
TEST(ProcessGroup, LastOwnerDroppedInAPointToPointCallback) {
  auto [pg0, pg1] = twoRanks();
  ASSERT_TRUE(pg0 && pg1);
  auto a = torch::zeros({8});
  auto never = torch::zeros({8});
  auto first = pg0->recv(a, 1, 7);
  auto behind = pg0->recv(never, 1, 8);  // rank 1 never sends tag 8
  std::promise<std::thread::id> dropped;
  auto chained =
      first.future().then([held = std::move(pg0),
                           &dropped](const std::vector<at::Tensor>&) mutable {
        held.reset();
        dropped.set_value(std::this_thread::get_id());
      });
  pg1->send(torch::full({8}, 3.0), 0, 7).wait(30s);
  auto f = dropped.get_future();
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  EXPECT_NE(f.get(), std::this_thread::get_id());
  EXPECT_TRUE(torch::equal(a, torch::full({8}, 3.0)));
  EXPECT_THROW(behind.wait(30s), Exception);
  pg1.reset();
  // The teardown left the loop thread for one of its own: the test (and
  // its process) must not end before it has.
  EXPECT_TRUE(ProcessGroup::awaitDeferredTeardowns(30s));
}

TEST(ProcessGroup, UnknownBackendAndBadRankAreClearErrors) {
  auto store = std::make_shared<store::HashStore>();
  EXPECT_THROW((void)ProcessGroup::create("gloo", store, 0, 1),
               InvalidArgumentError);
  EXPECT_THROW((void)ProcessGroup::create("cpu", store, 1, 1),
               InvalidArgumentError);
  setenv("TRELLIS_COLLECTIVES_ALGO", "fastest", 1);
  try {
    (void)ProcessGroup::create("cpu", store, 0, 1);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("TRELLIS_COLLECTIVES_ALGO"),
              std::string::npos);
  }
  unsetenv("TRELLIS_COLLECTIVES_ALGO");
  for (const char* bad : {"0", "two", "3x", "-1", "99999999999"}) {
    setenv("TRELLIS_COLLECTIVES_RANKS_PER_HOST", bad, 1);
    try {
      (void)ProcessGroup::create("cpu", store, 0, 1);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "TRELLIS_COLLECTIVES_RANKS_PER_HOST='" + std::string(bad)),
                std::string::npos)
          << e.what();
    }
  }
  unsetenv("TRELLIS_COLLECTIVES_RANKS_PER_HOST");
}

// initTimeout bounds forming the group, apart from the ops' timeout: a
// rank that arrives 1.5 s late joins a group whose ops time out after
// 500 ms; without it, the early rank gives up at 500 ms, as torch does.
TEST(ProcessGroup, InitTimeoutBoundsFormingTheGroupApartFromTheOps) {
  auto formed = [](std::optional<Duration> initTimeout) {
    auto store = std::make_shared<store::HashStore>();
    ProcessGroupOptions o = sharedProcessOptions(500ms);
    o.initTimeout = initTimeout;
    std::string late;
    std::thread t([&] {
      std::this_thread::sleep_for(1500ms);  // the late rank's start
      try {
        auto pg = ProcessGroup::create("cpu", store, 1, 2, o);
        auto x = torch::ones({4});
        pg->allreduce(x).wait(10s);
      } catch (const std::exception& e) {
        late = e.what();
      }
    });
    std::string early;
    try {
      auto pg = ProcessGroup::create("cpu", store, 0, 2, o);
      auto x = torch::ones({4});
      pg->allreduce(x).wait(10s);
      EXPECT_EQ(x[0].item<float>(), 2.0f);
    } catch (const std::exception& e) {
      early = e.what();
    }
    t.join();
    return early;
  };
  EXPECT_EQ(formed(10s), "");
  const std::string e = formed(std::nullopt);
  EXPECT_NE(e.find("DEADLINE_EXCEEDED"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1 did not publish its address within 500 ms"),
            std::string::npos)
      << e;
}

TEST(ProcessGroup, ARankThatNeverComesTimesOutNamingItAndTheOp) {
  ProcessGroupOptions o;
  o.timeout = 1s;
  std::vector<std::string> errors(3);
  std::vector<Clock::duration> took(3);
  std::promise<void> othersDone;
  std::shared_future<void> othersDoneFuture = othersDone.get_future().share();
  std::atomic<int> finished{0};
  runRanks(
      3,
      [&](ProcessGroup& pg) {
        pg.barrier().wait();
        if (pg.rank() == 2) {
          // Skips the allreduce but keeps its group (a destroyed group
          // would tell the others at once) until they have failed.
          EXPECT_EQ(othersDoneFuture.wait_for(30s), std::future_status::ready);
          return;
        }
        auto t = torch::ones({4});
        const auto start = Clock::now();
        errors[static_cast<size_t>(pg.rank())] = failureOf(pg.allreduce(t));
        took[static_cast<size_t>(pg.rank())] = Clock::now() - start;
        // Sticky: a later op fails with the same error at once.
        EXPECT_NE(failureOf(pg.barrier()), "");
        if (++finished == 2) {
          othersDone.set_value();
        }
      },
      o);
  for (int r = 0; r < 2; ++r) {
    // Whichever rank's watchdog fires first tells the other; both errors
    // carry the same story.
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("seq 2 allreduce(float32[4], sum) on group 'default' "
                     "timed out on rank"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("likely culprit: rank 2; rank 2 never entered seq 2; "
                     "it last started seq 1 barrier(), which completed"),
              std::string::npos)
        << e;
    EXPECT_GE(took[static_cast<size_t>(r)], 1s);
    EXPECT_LT(took[static_cast<size_t>(r)], 5s);
  }
}

TEST(ProcessGroup, AGroupDestroyedOnOneRankFailsThePeersNamingIt) {
  std::string error;
  runRanks(2, [&](ProcessGroup& pg) {
    pg.barrier().wait();
    if (pg.rank() == 1) {
      return;  // its group is destroyed when runRanks' lambda returns
    }
    error = failureOf(pg.allreduce(torch::ones({4})));
  });
  EXPECT_NE(error.find("rank 1"), std::string::npos) << error;
}

}  // namespace
}  // namespace trellis::collectives
