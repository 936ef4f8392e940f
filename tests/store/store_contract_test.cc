// One contract suite for every Store, instantiated per backend: HashStore,
// FileStore, TCPStore (client of an embedded server, with and without a job
// token), and PrefixStore over each of those.
#include "store_contract.h"

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

#include "store_test_util.h"
#include <trellis/core/error.h>
#include <trellis/store/file_store.h>
#include <trellis/store/hash_store.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>

namespace trellis::store {
namespace {

using namespace std::chrono_literals;
using testing::TempPath;
using testing::timed;

class HashBackend : public Backend {
 public:
  std::shared_ptr<Store> connect() override { return store_; }

 private:
  std::shared_ptr<Store> store_ = std::make_shared<HashStore>();
};

class FileBackend : public Backend {
 public:
  std::shared_ptr<Store> connect() override {
    return std::make_shared<FileStore>(path_.str());
  }

 private:
  TempPath path_{"contract"};
};

class TcpBackend : public Backend {
 public:
  explicit TcpBackend(bool withToken) {
    TCPStoreServerOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    if (withToken) {
      token_ = auth::JobToken::generate();
      o.jobToken = token_;
    }
    server_ = std::make_unique<TCPStoreServer>(std::move(o));
  }
  std::shared_ptr<Store> connect() override {
    TCPStoreOptions o;
    o.host = "127.0.0.1";
    o.port = server_->port();
    o.timeout = 60s;
    o.jobToken = token_;
    return std::make_shared<TCPStore>(std::move(o));
  }

 private:
  std::optional<auth::JobToken> token_;
  std::unique_ptr<TCPStoreServer> server_;
};

class PrefixBackend : public Backend {
 public:
  explicit PrefixBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)) {}
  std::shared_ptr<Store> connect() override {
    return std::make_shared<PrefixStore>("job7", inner_->connect());
  }

 private:
  std::unique_ptr<Backend> inner_;
};

std::vector<BackendParam> backends() {
  return {
      {"Hash", [] { return std::make_unique<HashBackend>(); }},
      {"File", [] { return std::make_unique<FileBackend>(); }},
      {"Tcp", [] { return std::make_unique<TcpBackend>(false); }},
      {"TcpWithToken", [] { return std::make_unique<TcpBackend>(true); }},
      {"PrefixOverHash",
       [] {
         return std::make_unique<PrefixBackend>(
             std::make_unique<HashBackend>());
       }},
      {"PrefixOverFile",
       [] {
         return std::make_unique<PrefixBackend>(
             std::make_unique<FileBackend>());
       }},
      {"PrefixOverTcp",
       [] {
         return std::make_unique<PrefixBackend>(
             std::make_unique<TcpBackend>(false));
       }},
  };
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreContractTest,
                         ::testing::ValuesIn(backends()),
                         [](const auto& info) { return info.param.name; });

// PrefixStore isolation, over each kind of backing store.
class PrefixIsolationTest : public ::testing::TestWithParam<BackendParam> {};

TEST_P(PrefixIsolationTest, PrefixesDoNotSeeEachOther) {
  auto backend = GetParam().make();
  auto base = backend->connect();
  PrefixStore a("a", base);
  PrefixStore b("b", backend->connect());
  a.set("k", "from-a");
  b.set("k", "from-b");
  EXPECT_EQ(a.getString("k"), "from-a");
  EXPECT_EQ(b.getString("k"), "from-b");
  EXPECT_EQ(base->getString("a/k"), "from-a");
  EXPECT_FALSE(base->check({"k"}));
  a.add("n", 5);
  EXPECT_FALSE(b.check({"n"}));
  EXPECT_TRUE(b.deleteKey("k"));
  EXPECT_EQ(a.getString("k"), "from-a");
  b.setTimeout(100ms);
  EXPECT_THROW(b.get("n"), TimeoutError);
  // Nesting composes.
  PrefixStore nested("inner", std::make_shared<PrefixStore>("a", base));
  nested.set("x", "1");
  EXPECT_EQ(base->getString("a/inner/x"), "1");
  EXPECT_THROW(PrefixStore("p", nullptr), InvalidArgumentError);
}

INSTANTIATE_TEST_SUITE_P(
    AllStores, PrefixIsolationTest,
    ::testing::Values(
        BackendParam{"Hash", [] { return std::make_unique<HashBackend>(); }},
        BackendParam{"File", [] { return std::make_unique<FileBackend>(); }},
        BackendParam{"Tcp",
                     [] { return std::make_unique<TcpBackend>(false); }}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace trellis::store
