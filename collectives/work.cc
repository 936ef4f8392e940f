#include <trellis/collectives/work.h>

namespace trellis::collectives {

Work::Work(Future<std::vector<at::Tensor>> future, std::string description)
    : Work(std::move(future), std::move(description), nullptr) {}

Work::Work(Future<std::vector<at::Tensor>> future, std::string description,
           std::shared_ptr<Source> source)
    : Work(std::move(future), std::move(description), std::move(source),
           nullptr) {}

Work::Work(Future<std::vector<at::Tensor>> future, std::string description,
           std::shared_ptr<Source> source, std::function<Error()> streamWait)
    : future_(std::move(future)),
      description_(std::move(description)),
      source_(std::move(source)),
      streamWait_(std::move(streamWait)) {}

void Work::wait() const {
  if (streamWait_ && !future_.completed()) {
    if (Error e = streamWait_(); !e.ok()) {
      throwError(e);
    }
    return;
  }
  (void)future_.wait();
}

void Work::wait(Duration timeout) const {
  if (!future_.waitFor(timeout)) {
    throwError(Error::timeout(
        "Work::wait gave up after " +
        std::to_string(
            std::chrono::duration_cast<std::chrono::milliseconds>(timeout)
                .count()) +
        " ms on " + description_ + " (the op goes on)"));
  }
  (void)future_.value();
}

bool Work::isCompleted() const { return future_.completed(); }

Error Work::exception() const { return future_.error(); }

int Work::sourceRank() const {
  return source_ && future_.completed() ? source_->rank.load() : -1;
}

}  // namespace trellis::collectives
