// A user program built against an installed Trellis.
#include <cstdio>

#include <trellis/core/future.h>
#include <trellis/core/thread_pool.h>
#include <trellis/core/wire.h>
#include <trellis/store/hash_store.h>
#include <trellis/store/prefix_store.h>

int main() {
  trellis::ThreadPool pool(1, "consumer");
  auto f =
      pool.submit([] { return 41; }).then([](const int& v) { return v + 1; });
  trellis::wire::WireWriter w;
  w.putVarint(static_cast<uint64_t>(f.wait(std::chrono::seconds(5))));
  trellis::wire::WireReader r(w.bytes());
  const auto v = r.varint();
  if (!r.ok() || v != 42) {
    std::fprintf(stderr, "consumer: unexpected result\n");
    return 1;
  }
  auto base = std::make_shared<trellis::store::HashStore>();
  trellis::store::PrefixStore store("job", base);
  store.set("answer", std::to_string(v));
  if (store.add("count", 2) != 2 || base->getString("job/answer") != "42") {
    std::fprintf(stderr, "consumer: store misbehaved\n");
    return 1;
  }
  std::printf("consumer: ok (%llu)\n", static_cast<unsigned long long>(v));
  return 0;
}
