// The cuda_ipc channel on its own: record encoding (everywhere), and on a
// machine with a GPU, copies from a writer process (cuda_ipc_peer_helper)
// into this one, lying records, a reader in the writer's own process, and
// the copy rate of 64 MiB (printed, not asserted).

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <gtest/gtest.h>

#include "peer_process.h"
#include <trellis/transport/channel.h>
#include <trellis/transport/cuda_ipc/factory.h>
#include <trellis/transport/cuda_ipc/record.h>
#include <trellis/transport/transport.h>

namespace trellis::transport {
namespace {

using cuda_ipc::Record;
using testing::Child;
using testing::spawnHelper;

uint8_t patternByte(size_t i) {  // as in cuda_ipc_peer_helper.cc
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ 0x5a);
}

std::string unhex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) {
    out += static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16));
  }
  return out;
}

Record sampleRecord() {
  Record r;
  r.deviceIndex = 1;
  r.offset = 4096;
  r.length = 1000;
  r.allocationSize = 8192;
  r.writerPid = 1234;
  r.bufferId = 77;
  r.baseAddress = 0x7f0000000000;
  for (size_t i = 0; i < cuda_ipc::kHandleBytes; ++i) {
    r.memHandle[i] = static_cast<uint8_t>(i);
    r.eventHandle[i] = static_cast<uint8_t>(255 - i);
  }
  return r;
}

TEST(CudaIpcRecordTest, RoundTrip) {
  const Record r = sampleRecord();
  const std::string bytes = cuda_ipc::encodeRecord(r);
  EXPECT_EQ(bytes.size(), cuda_ipc::kRecordBytes);
  EXPECT_LE(bytes.size(), Channel::kMaxOutOfBandRecordBytes);
  Record back;
  ASSERT_TRUE(cuda_ipc::decodeRecord(bytes, &back).ok());
  EXPECT_EQ(back.deviceIndex, r.deviceIndex);
  EXPECT_EQ(back.offset, r.offset);
  EXPECT_EQ(back.length, r.length);
  EXPECT_EQ(back.allocationSize, r.allocationSize);
  EXPECT_EQ(back.writerPid, r.writerPid);
  EXPECT_EQ(back.bufferId, r.bufferId);
  EXPECT_EQ(back.baseAddress, r.baseAddress);
  EXPECT_EQ(back.memHandle, r.memHandle);
  EXPECT_EQ(back.eventHandle, r.eventHandle);
}

TEST(CudaIpcRecordTest, RejectsMalformed) {
  const std::string good = cuda_ipc::encodeRecord(sampleRecord());
  Record out;
  auto expectLoss = [&](const std::string& bytes, const char* what) {
    const Error e = cuda_ipc::decodeRecord(bytes, &out);
    EXPECT_EQ(e.code(), Code::kDataLoss) << what << ": " << e.what();
  };
  expectLoss("", "empty");
  expectLoss(good.substr(0, good.size() - 1), "truncated");
  expectLoss(good + "x", "trailing byte");
  std::string magic = good;
  magic[0] ^= 1;
  expectLoss(magic, "magic");

  Record r = sampleRecord();
  r.length = r.allocationSize - r.offset + 1;
  expectLoss(cuda_ipc::encodeRecord(r), "past the allocation");
  r = sampleRecord();
  r.offset = ~uint64_t{0};
  r.length = 2;
  expectLoss(cuda_ipc::encodeRecord(r), "offset + length overflows");
}

TEST(CudaIpcChannelTest, Basics) {
  auto c = cuda_ipc::create();
  EXPECT_EQ(c->name(), "cuda_ipc");
  EXPECT_TRUE(c->sameHostOnly());
  EXPECT_TRUE(c->drivesOutOfBand());
  EXPECT_FALSE(c->inlineThroughConnection());
  EXPECT_TRUE(c->supportsDevice(Device::cuda(0)));
  EXPECT_FALSE(c->supportsDevice(Device::cpu()));
  Message::Tensor t;
  t.length = 10;
  t.device = Device::cuda(0);
  EXPECT_TRUE(c->sendsOutOfBand(t));
  t.length = 0;
  EXPECT_FALSE(c->sendsOutOfBand(t));
  t.length = 10;
  t.device = Device::cpu();
  EXPECT_FALSE(c->sendsOutOfBand(t));

  int n = 0;
  const bool gpu = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  const Error v = c->viable();
  EXPECT_EQ(v.ok(), gpu) << v.what();
  if (!gpu) {
    EXPECT_EQ(v.code(), Code::kFailedPrecondition);
    EXPECT_NE(v.message().find("cuda_ipc not viable"), std::string::npos)
        << v.what();
  }
}

// Runs readOutOfBand and waits (bounded) for its single callback.
Error readRecord(const Channel& c, const std::string& record, void* dst,
                 size_t length, bool settle = true) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto p = std::make_shared<std::promise<Error>>();
  auto f = p->get_future();
  c.readOutOfBand(record, Allocation::Buffer{dst, length}, Device::cuda(0),
                  "peer", [calls, p](const Error& e) {
                    if (calls->fetch_add(1) == 0) {
                      p->set_value(e);
                    }
                  });
  if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "readOutOfBand did not call back within 30 s";
    return Error::timeout("no callback");
  }
  const Error e = f.get();
  if (settle) {
    // A second call would be a bug; give it a moment to show.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(calls->load(), 1);
  }
  return e;
}

TEST(CudaIpcChannelTest, RecordMustNameThePeersPid) {
  auto c = cuda_ipc::create();
  const std::string record = cuda_ipc::encodeRecord(sampleRecord());
  const Descriptor::TensorInfo tensor{sampleRecord().length, Device::cuda(0)};
  EXPECT_TRUE(c->checkOutOfBandRecord(record, tensor, 1234).ok());
  EXPECT_EQ(c->checkOutOfBandRecord(record, tensor, 1235).code(),
            Code::kDataLoss);
  EXPECT_EQ(c->checkOutOfBandRecord("x", tensor, 1234).code(), Code::kDataLoss);
  // And it must have the tensor's length.
  EXPECT_EQ(c->checkOutOfBandRecord(
                 record, {sampleRecord().length + 1, Device::cuda(0)}, 1234)
                .code(),
            Code::kDataLoss);
}

TEST(CudaIpcChannelTest, BadRecordFailsTheReadOnce) {
  auto c = cuda_ipc::create();
  char dst[16];
  const Error e = readRecord(*c, "not a record", dst, sizeof(dst));
  EXPECT_FALSE(e.ok());
}

class CudaIpcGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      GTEST_SKIP() << "no CUDA device";
    }
    channel_ = cuda_ipc::create();
    ASSERT_TRUE(channel_->viable().ok()) << channel_->viable().what();
  }

  // Starts a writer of `bytes` on cuda:0 exporting `specs`
  // ("offset:length"); returns its records.
  std::vector<std::string> startWriter(size_t bytes,
                                       std::vector<std::string> specs) {
    specs.insert(specs.begin(), std::to_string(bytes));
    // The build tree's path, unless the binaries were moved (to a GPU
    // machine, tests/transport/run_cuda_ipc_on_gpu.sh).
    const char* moved = std::getenv("TRELLIS_CUDA_IPC_PEER_HELPER");
    writer_ = spawnHelper(moved ? moved : CUDA_IPC_PEER_HELPER, specs);
    std::vector<std::string> records;
    for (;;) {
      const std::string line = writer_->readLine(60000);
      if (line.rfind("RECORD ", 0) == 0) {
        records.push_back(unhex(line.substr(7)));
        continue;
      }
      EXPECT_EQ(line, "READY");
      break;
    }
    return records;
  }

  void* deviceBuffer(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xee, bytes), cudaSuccess);
    buffers_.push_back(p);
    return p;
  }

  // Checks that `dst` holds the writer's pattern for [offset, +length).
  static void expectPattern(const void* dst, size_t offset, size_t length) {
    std::vector<uint8_t> host(length);
    ASSERT_EQ(cudaMemcpy(host.data(), dst, length, cudaMemcpyDeviceToHost),
              cudaSuccess);
    size_t bad = 0;
    size_t first = length;
    for (size_t i = 0; i < length; ++i) {
      if (host[i] != patternByte(offset + i)) {
        ++bad;
        first = std::min(first, i);
      }
    }
    EXPECT_EQ(bad, 0u) << "first wrong byte at " << first << " of " << length;
  }

  void TearDown() override {
    for (void* p : buffers_) {
      cudaFree(p);
    }
    channel_.reset();
  }

  std::shared_ptr<Channel> channel_;
  std::unique_ptr<Child> writer_;
  std::vector<void*> buffers_;
};

TEST_F(CudaIpcGpuTest, CopiesFromAnotherProcessAfterTheWritersWork) {
  const size_t bytes = (size_t{4} << 20) + 4096;
  const size_t offset = 4096 + 17;
  const size_t length = (size_t{1} << 20) + 3;
  auto records = startWriter(
      bytes, {std::to_string(offset) + ":" + std::to_string(length)});
  ASSERT_EQ(records.size(), 1u);
  void* dst = deviceBuffer(length);
  const Error e = readRecord(*channel_, records[0], dst, length);
  ASSERT_TRUE(e.ok()) << e.what();
  expectPattern(dst, offset, length);
}

TEST_F(CudaIpcGpuTest, OneAllocationManyTensorsAndRepeatedReads) {
  const size_t bytes = size_t{2} << 20;
  auto records = startWriter(bytes, {"0:1000", "65536:300000", "1048576:7"});
  ASSERT_EQ(records.size(), 3u);
  const size_t offsets[] = {0, 65536, 1048576};
  const size_t lengths[] = {1000, 300000, 7};
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < 3; ++i) {
      void* dst = deviceBuffer(lengths[i]);
      const Error e = readRecord(*channel_, records[i], dst, lengths[i]);
      ASSERT_TRUE(e.ok()) << "round " << round << " tensor " << i << ": "
                          << e.what();
      expectPattern(dst, offsets[i], lengths[i]);
    }
  }
}

TEST_F(CudaIpcGpuTest, LyingRecordsFailThatReadOnly) {
  const size_t bytes = size_t{1} << 20;
  auto records = startWriter(bytes, {"4096:8192"});
  ASSERT_EQ(records.size(), 1u);
  Record good;
  ASSERT_TRUE(cuda_ipc::decodeRecord(records[0], &good).ok());
  void* dst = deviceBuffer(bytes * 2);

  auto expectFails = [&](const Record& r, size_t length, const char* what) {
    const Error e =
        readRecord(*channel_, cuda_ipc::encodeRecord(r), dst, length);
    EXPECT_FALSE(e.ok()) << what;
    EXPECT_NE(e.message().find("peer"), std::string::npos) << e.what();
  };
  // Claims a larger allocation than the handle maps.
  Record r = good;
  r.allocationSize = bytes * 2;
  r.length = bytes;
  r.offset = bytes / 2;
  expectFails(r, r.length, "past the real allocation");
  // A length other than the tensor's.
  expectFails(good, good.length + 1, "length mismatch");
  // A device this host does not have.
  r = good;
  r.deviceIndex = 4096;
  expectFails(r, r.length, "device index");
  // Garbage handles.
  r = good;
  r.bufferId ^= 1;  // not cached yet: the handle is opened
  r.memHandle.fill(0x41);
  expectFails(r, r.length, "memory handle");
  r = good;
  r.eventHandle.fill(0x41);
  expectFails(r, r.length, "event handle");
  // Claims to come from this process, with addresses it does not have.
  r = good;
  r.writerPid = static_cast<uint64_t>(::getpid());
  expectFails(r, r.length, "own pid");

  // The channel goes on.
  const Error e = readRecord(*channel_, records[0], dst, good.length);
  ASSERT_TRUE(e.ok()) << e.what();
  expectPattern(dst, 4096, 8192);
}

// A writer that ended before its handles were opened took its memory with
// it: that read fails as the peer's departure (UNAVAILABLE naming its pid),
// not as a lying record, and the channel goes on.
TEST_F(CudaIpcGpuTest, WriterGoneBeforeTheReadIsUnavailable) {
  const size_t bytes = size_t{1} << 20;
  auto records = startWriter(bytes, {"0:4096"});
  ASSERT_EQ(records.size(), 1u);
  const pid_t pid = writer_->pid;
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  writer_->wait();
  void* dst = deviceBuffer(bytes);
  const Error e = readRecord(*channel_, records[0], dst, 4096);
  EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
  EXPECT_NE(e.message().find("is gone"), std::string::npos) << e.what();
  EXPECT_NE(e.message().find("pid " + std::to_string(pid)), std::string::npos)
      << e.what();
  Record r;
  ASSERT_TRUE(cuda_ipc::decodeRecord(records[0], &r).ok());
  EXPECT_EQ(r.writerPid, static_cast<uint64_t>(pid));
  // A live writer: the channel reads on.
  auto again = startWriter(bytes, {"4096:8192"});
  ASSERT_EQ(again.size(), 1u);
  const Error ok = readRecord(*channel_, again[0], dst, 8192);
  ASSERT_TRUE(ok.ok()) << ok.what();
  expectPattern(dst, 4096, 8192);
}

TEST_F(CudaIpcGpuTest, ReaderInTheWritersProcess) {
  const size_t length = 123457;
  void* src = deviceBuffer(length + 512);
  std::vector<uint8_t> host(length + 512);
  for (size_t i = 0; i < host.size(); ++i) {
    host[i] = patternByte(i);
  }
  ASSERT_EQ(cudaMemcpy(src, host.data(), host.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  auto writer = cuda_ipc::create();
  Message::Tensor t{static_cast<char*>(src) + 512, length, Device::cuda(0)};
  std::string record;
  Error d;
  // On a thread that has made no CUDA call yet, like a context's loop.
  std::thread([&] { d = writer->describeOutOfBand(t, &record); }).join();
  ASSERT_TRUE(d.ok()) << d.what();
  void* dst = deviceBuffer(length);
  const Error e = readRecord(*channel_, record, dst, length);
  ASSERT_TRUE(e.ok()) << e.what();
  expectPattern(dst, 512, length);
}

TEST_F(CudaIpcGpuTest, DescribeRejectsMemoryItCannotExport) {
  std::vector<char> host(4096);
  Message::Tensor t{host.data(), host.size(), Device::cuda(0)};
  std::string record;
  EXPECT_EQ(channel_->describeOutOfBand(t, &record).code(),
            Code::kInvalidArgument);
  t.device = Device::cuda(1000);
  EXPECT_EQ(channel_->describeOutOfBand(t, &record).code(),
            Code::kInvalidArgument);
}

TEST_F(CudaIpcGpuTest, ChannelDroppedWithAHandleOpenAndAFreshOneWorks) {
  const size_t length = size_t{1} << 16;
  auto records = startWriter(length, {"0:" + std::to_string(length)});
  ASSERT_EQ(records.size(), 1u);
  void* dst = deviceBuffer(length);
  ASSERT_TRUE(readRecord(*channel_, records[0], dst, length).ok());
  // The handle is closed with the channel, so a new channel (as in a new
  // Context of this process) may open it again.
  channel_ = cuda_ipc::create();
  const Error e = readRecord(*channel_, records[0], dst, length);
  ASSERT_TRUE(e.ok()) << e.what();
  expectPattern(dst, 0, length);
}

TEST_F(CudaIpcGpuTest, CopyRate64MiB) {
  const size_t length = size_t{64} << 20;
  auto records = startWriter(length, {"0:" + std::to_string(length)});
  ASSERT_EQ(records.size(), 1u);
  void* dst = deviceBuffer(length);
  ASSERT_TRUE(readRecord(*channel_, records[0], dst, length).ok());
  expectPattern(dst, 0, length);
  const int n = 50;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(readRecord(*channel_, records[0], dst, length, false).ok());
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const double gbps = static_cast<double>(length) * n / s / 1e9;
  std::printf(
      "cuda_ipc 64 MiB: %.1f us per read (callback included), "
      "%.1f GB/s\n",
      s / n * 1e6, gbps);
  RecordProperty("copy_gbps", std::to_string(gbps));
}

}  // namespace
}  // namespace trellis::transport
