// ThreadSanitizer suppressions, linked into every test binary of the tsan
// preset (cmake/TrellisHelpers.cmake). Each entry says why it is not ours
// to fix; add one only with that reason.

extern "C" const char* __tsan_default_suppressions();

extern "C" const char* __tsan_default_suppressions() {
  return
      // libtorch is not built with TSan: the reference counts of tensors
      // and autograd nodes are atomics TSan cannot see, so a buffer or node
      // that libtorch frees after its last reference drops (say a tensor the
      // transport finished sending from another thread) looks unordered
      // with the earlier use. ASan runs the same tests and sees no
      // use-after-free.
      "called_from_lib:libtorch_cpu.so\n"
      "called_from_lib:libc10.so\n"
      // oneDNN, which libtorch's CPU convolutions call (ddp_test's CNN with
      // ranks as threads), is not built with TSan either: its primitive
      // cache, shared by the threads, is read (memcmp of the keys) under a
      // lock TSan cannot see.
      "called_from_lib:libdnnl.so\n"
      // The same library, seen from a mutex: Engine::queue_callback locks
      // the graph task's callback mutex and unlocks it; TSan reports the
      // unlock as one of an unlocked mutex, and without libtorch's frames
      // (no frame pointers there) the report lands on our caller, which
      // does nothing else (ddp/reducer.cc).
      "mutex:trellis::ddp::detail::Reducer::queueFinalize\n"
      // This libtsan does not intercept memfd_create: the shm transport's
      // memfd gets an fd number TSan still attributes to an earlier,
      // closed socket of another loop thread, and closing it looks like a
      // race with that socket's epoll_ctl.
      "race:closeFd\n"
      // The same for the memfd of the shm viability probe, closed on
      // whichever loop thread first asks whether shm is viable.
      "race:ShmTransport::viable\n"
      // And for the collectives' shared-memory segment, whose memfd a
      // rank's thread closes once every rank of its host opened it
      // (collectives_test's ranks are threads beside the loop threads).
      "race:HostShm::Impl::closeDescriptor\n";
}
