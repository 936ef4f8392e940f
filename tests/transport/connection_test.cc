// The Connection contract (transport/connection.h), written once and
// instantiated per transport: byte streams below any pipe, driven straight
// on a Loop.

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <trellis/core/future.h>
#include <trellis/transport/connection.h>
#include <trellis/transport/loop.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/uv/factory.h>

namespace trellis::transport::testing {
namespace {

constexpr auto kWait = std::chrono::seconds(30);

struct ConnBackend {
  std::string name;
  std::string listenAddr;
  std::shared_ptr<Transport> (*make)();
};

void PrintTo(const ConnBackend& b, std::ostream* os) { *os << b.name; }

std::shared_ptr<Transport> makeUv() { return uv::create(); }
std::shared_ptr<Transport> makeShm() { return shm::create(); }

// Runs `fn` on the loop thread and waits for it.
template <typename Fn>
void onLoop(Loop& loop, Fn fn) {
  Promise<void> done;
  loop.defer([&fn, done]() mutable {
    fn();
    done.setValue();
  });
  done.getFuture().wait(kWait);
}

// Sink that reads into a fixed buffer and collects the bytes.
class CollectSink : public ReadSink {
 public:
  void readBuffer(char** base, size_t* length) override {
    *base = buf_;
    *length = sizeof(buf_);
  }
  void onRead(size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    got_.append(buf_, n);
  }
  void onReadError(const Error&) override {}
  std::string got() {
    std::lock_guard<std::mutex> lock(mu_);
    return got_;
  }

 private:
  char buf_[4096];
  std::mutex mu_;
  std::string got_;
};

class ConnectionContract : public ::testing::TestWithParam<ConnBackend> {
 protected:
  void SetUp() override {
    transport_ = GetParam().make();
    if (Error e = transport_->viable(); !e.ok()) {
      GTEST_SKIP() << e.what();
    }
    loop_ = Loop::create("conntest");
    Promise<std::shared_ptr<Connection>> accepted;
    Promise<std::shared_ptr<Connection>> connected;
    onLoop(*loop_, [&] {
      Error e = transport_->listen(
          *loop_, GetParam().listenAddr,
          [accepted](const Error& err, std::shared_ptr<Connection> c) mutable {
            if (err.ok()) {
              accepted.setValue(std::move(c));
            }
          },
          &listener_);
      ASSERT_TRUE(e.ok()) << e.what();
      transport_->connect(
          *loop_, listener_->address(),
          [connected](const Error& err, std::shared_ptr<Connection> c) mutable {
            err.ok() ? connected.setValue(std::move(c))
                     : connected.setError(err);
          });
    });
    client_ = connected.getFuture().wait(kWait);
    server_ = accepted.getFuture().wait(kWait);
  }

  void TearDown() override {
    if (loop_ == nullptr) {
      return;
    }
    onLoop(*loop_, [&] {
      client_->close();
      server_->close();
      listener_->close();
      listener_.reset();
      loop_->stopFromLoop();
    });
    EXPECT_TRUE(loop_->join(Deadline::after(kWait)))
        << "loop thread still running after stopFromLoop()";
  }

  std::shared_ptr<Transport> transport_;
  std::shared_ptr<Loop> loop_;
  std::unique_ptr<ConnectionListener> listener_;
  std::shared_ptr<Connection> client_;
  std::shared_ptr<Connection> server_;
  CollectSink sink_;  // outlives server_, which may read into it
};

// A write the connection finishes within the call (a few bytes into an
// empty socket buffer or ring) still calls back, once, and not inline.
TEST_P(ConnectionContract, WriteCallsBackOnceEvenWhenDoneAtOnce) {
  onLoop(*loop_, [&] { server_->startReading(&sink_); });
  constexpr int kWrites = 100;
  const std::string bytes = "0123456789";
  std::atomic<int> fired{0};
  std::atomic<int> failed{0};
  std::atomic<int> inlined{0};
  Promise<void> all;
  bool inWrite = false;  // loop thread only
  onLoop(*loop_, [&] {
    for (int i = 0; i < kWrites; ++i) {
      const IoBuf b{bytes.data(), bytes.size()};
      inWrite = true;
      client_->write(&b, 1, [&, all](const Error& e) {
        if (!e.ok()) {
          failed++;
        }
        if (inWrite) {
          inlined++;
        }
        if (fired.fetch_add(1) + 1 == kWrites) {
          Promise<void>(all).setValue();
        }
      });
      inWrite = false;
    }
  });
  all.getFuture().wait(kWait);
  EXPECT_EQ(fired.load(), kWrites);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(inlined.load(), 0);
  const Deadline deadline = Deadline::after(kWait);
  while (sink_.got().size() < bytes.size() * kWrites && !deadline.expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(sink_.got().size(), bytes.size() * kWrites);
}

// After close(), a write fails, through its callback, once.
TEST_P(ConnectionContract, WriteAfterCloseCallsBackWithAnError) {
  Promise<void> done;
  std::atomic<int> fired{0};
  onLoop(*loop_, [&] {
    client_->close();
    const char byte = 'x';
    const IoBuf b{&byte, 1};
    client_->write(&b, 1, [&, done](const Error& e) mutable {
      fired++;
      e.ok() ? done.setError(Error::internal("write after close succeeded"))
             : done.setValue();
    });
    EXPECT_EQ(fired.load(), 0);
  });
  done.getFuture().wait(kWait);
  // Negative check: 20 ms for a wrong second call of the callback to show.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(fired.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Transports, ConnectionContract,
    ::testing::Values(ConnBackend{"uv", "uv://127.0.0.1:0", &makeUv},
                      ConnBackend{"shm", "shm://", &makeShm}),
    [](const ::testing::TestParamInfo<ConnBackend>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace trellis::transport::testing
