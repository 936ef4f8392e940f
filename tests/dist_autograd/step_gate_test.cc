// StepGate alone (dist_autograd/step_gate.h): readers, writers, writer
// preference, deadlines, release and destruction, without agents.

#include <chrono>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include <trellis/core/error.h>
#include <trellis/dist_autograd/step_gate.h>

using namespace std::chrono_literals;
using trellis::Deadline;
using trellis::Future;
using trellis::dist_autograd::detail::GateSlot;
using trellis::dist_autograd::detail::StepGate;

namespace {

std::shared_ptr<GateSlot> slot(uint64_t rank, uint64_t n) {
  return std::make_shared<GateSlot>(rank << 48 | n);
}

Deadline never() { return Deadline::never(); }

TEST(DistAutogradStepGate, FastPathAdmitsAndCounts) {
  StepGate gate("ps");
  auto a = slot(1, 1);
  Future<void> f = gate.admit(a, never());
  ASSERT_TRUE(f.completed());
  EXPECT_FALSE(f.hasError());
  EXPECT_EQ(gate.counts().reading, 1u);
  gate.requestDone(*a);
  EXPECT_EQ(gate.counts().reading, 0u);
  // A request that recorded a send reads until the send is answered.
  (void)gate.admit(a, never());
  gate.sendRecorded(*a);
  gate.requestDone(*a);
  EXPECT_EQ(gate.counts().reading, 1u);
  gate.sendAnswered(*a);
  EXPECT_EQ(gate.counts().reading, 0u);
}

TEST(DistAutogradStepGate, WriterWaitsForOtherReadersNotItsOwn) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1);
  for (auto& s : {a, b}) {
    (void)gate.admit(s, never());
    gate.sendRecorded(*s);
    gate.requestDone(*s);
  }
  gate.sendAnswered(*a);
  // A's own unanswered send would not count; B's does.
  gate.sendRecorded(*a);
  Future<void> w = gate.beginWrite(a, never(), "step of A");
  EXPECT_FALSE(w.completed());
  gate.sendAnswered(*b);
  ASSERT_TRUE(w.completed());
  EXPECT_FALSE(w.hasError());
  gate.endWrite(*a);
  EXPECT_EQ(gate.counts().writers, 0u);
}

TEST(DistAutogradStepGate, WritersOfTwoReadingContextsDoNotWaitForEachOther) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1);
  for (auto& s : {a, b}) {
    (void)gate.admit(s, never());
    gate.sendRecorded(*s);  // never answered (a result left out of the loss)
    gate.requestDone(*s);
  }
  Future<void> wa = gate.beginWrite(a, never(), "step of A");
  EXPECT_FALSE(wa.completed());  // B reads
  Future<void> wb = gate.beginWrite(b, never(), "step of B");
  EXPECT_TRUE(wa.completed());
  EXPECT_TRUE(wb.completed());
  gate.endWrite(*a);
  gate.endWrite(*b);
}

TEST(DistAutogradStepGate, NewReadersAreHeldWhileAWriterWaitsOldOnesAreNot) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1), c = slot(3, 1);
  (void)gate.admit(a, never());
  Future<void> w = gate.beginWrite(b, never(), "step of B");
  EXPECT_FALSE(w.completed());
  // A already reads: its next request goes in.
  EXPECT_TRUE(gate.admit(a, never()).completed());
  gate.requestDone(*a);
  // C does not: held.
  Future<void> held = gate.admit(c, never());
  EXPECT_FALSE(held.completed());
  EXPECT_EQ(gate.counts().held, 1u);
  gate.requestDone(*a);  // A stops reading: the step goes
  ASSERT_TRUE(w.completed());
  EXPECT_FALSE(held.completed());  // still held while the step runs
  gate.endWrite(*b);
  ASSERT_TRUE(held.completed());
  EXPECT_FALSE(held.hasError());
  EXPECT_EQ(gate.counts().reading, 1u);  // C, counted as running
  gate.requestDone(*c);
  EXPECT_EQ(gate.counts().reading, 0u);
}

TEST(DistAutogradStepGate, HeldRequestsGoInWhenAWriterEndsEvenIfOthersWait) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1), c = slot(3, 1), d = slot(4, 1);
  (void)gate.admit(a, never());
  Future<void> wb = gate.beginWrite(b, never(), "step of B");
  Future<void> held = gate.admit(c, never());
  gate.requestDone(*a);
  ASSERT_TRUE(wb.completed());
  Future<void> wd = gate.beginWrite(d, never(), "step of D");
  EXPECT_TRUE(wd.completed());  // nobody reads
  gate.endWrite(*b);
  EXPECT_TRUE(held.completed());  // phase change: C goes in
  gate.endWrite(*d);
  gate.requestDone(*c);
}

TEST(DistAutogradStepGate, WriterTimeoutNamesTheReaders) {
  StepGate gate("ps");
  auto a = slot(1, 7), b = slot(2, 1);
  (void)gate.admit(a, never());
  const auto start = std::chrono::steady_clock::now();
  Future<void> w = gate.beginWrite(b, Deadline::after(200ms), "step of B");
  Future<void> held = gate.admit(slot(3, 1), never());
  ASSERT_TRUE(w.waitFor(5s));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 200ms);
  ASSERT_TRUE(w.hasError());
  EXPECT_EQ(w.error().code(), trellis::Code::kDeadlineExceeded);
  const std::string what = w.error().message();
  EXPECT_NE(what.find("context 1:7"), std::string::npos) << what;
  EXPECT_NE(what.find("'ps'"), std::string::npos) << what;
  EXPECT_NE(what.find("step of B"), std::string::npos) << what;
  // The failed writer no longer holds anyone (completed right after it).
  ASSERT_TRUE(held.waitFor(5s));
  EXPECT_FALSE(held.hasError());
  EXPECT_EQ(gate.counts().writers, 0u);
}

TEST(DistAutogradStepGate, HeldRequestHonoursItsDeadline) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1), c = slot(3, 1);
  (void)gate.admit(a, never());
  Future<void> w = gate.beginWrite(b, never(), "step of B");
  Future<void> held = gate.admit(c, Deadline::after(100ms));
  ASSERT_TRUE(held.waitFor(5s));
  ASSERT_TRUE(held.hasError());
  EXPECT_EQ(held.error().code(), trellis::Code::kDeadlineExceeded);
  EXPECT_EQ(gate.counts().held, 0u);
  EXPECT_EQ(gate.counts().reading, 1u);  // C never counted
  gate.requestDone(*a);
  ASSERT_TRUE(w.completed());
  gate.endWrite(*b);
}

TEST(DistAutogradStepGate, ReleaseEndsReadingAndRefusesItsHeldRequests) {
  StepGate gate("ps");
  auto a = slot(1, 1), b = slot(2, 1), c = slot(3, 1);
  (void)gate.admit(a, never());
  gate.sendRecorded(*a);
  Future<void> w = gate.beginWrite(b, never(), "step of B");
  Future<void> held = gate.admit(c, never());
  gate.release(*c);
  gate.release(*a);  // running and pending forgotten
  ASSERT_TRUE(w.completed());
  gate.endWrite(*b);
  ASSERT_TRUE(held.completed());
  EXPECT_EQ(held.error().code(), trellis::Code::kFailedPrecondition);
  EXPECT_TRUE(gate.admit(a, never()).hasError());
  gate.requestDone(*a);  // harmless after release
  EXPECT_EQ(gate.counts().reading, 0u);
}

TEST(DistAutogradStepGate, DestructionCancelsWaiters) {
  Future<void> w, held;
  {
    StepGate gate("ps");
    auto a = slot(1, 1);
    (void)gate.admit(a, never());
    w = gate.beginWrite(slot(2, 1), Deadline::after(30s), "step of B");
    held = gate.admit(slot(3, 1), Deadline::after(30s));
  }
  ASSERT_TRUE(w.completed());
  ASSERT_TRUE(held.completed());
  EXPECT_EQ(w.error().code(), trellis::Code::kCancelled);
  EXPECT_EQ(held.error().code(), trellis::Code::kCancelled);
}

}  // namespace
