// Opportunistic helper thread for the CPU kernels: see helper_pool.h for why.
//
// One job at a time. A job is published as one 64-bit word, (generation, number of chunks, next
// chunk), so a helper checks "same job, chunks left" and claims a chunk in one compare-and-swap;
// the caller claims by fetch_add. Every chunk is claimed exactly once. The caller counts its own
// chunks and waits until the helper has finished the rest, which it had claimed, so it is running
// them; the job's function stays alive until then. A helper that wakes after the job is over sees
// a newer generation or no chunk left and goes back to waiting.

#include "helper_pool.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <sched.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tokenmill_cpu {
namespace {

constexpr int kIndexBits = 20;  // chunks a job: < 2^20
constexpr int kCountBits = 20;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
constexpr uint32_t kGenerationMask = (uint32_t{1} << (64 - kIndexBits - kCountBits)) - 1;
// How long a helper polls for the next job before it sleeps: a one-row decode step's products come
// a few to tens of microseconds apart, and a sleeping helper takes ~10 us or more to wake.
constexpr auto kPollFor = std::chrono::microseconds(200);
// How long the caller spins for the helper's last chunks before it sleeps on them: a chunk is a few
// to tens of microseconds of work, so a running helper finishes within this; a helper the scheduler
// parked mid-chunk (more busy threads than cores) may take a time slice, and the caller's spinning
// would only burn the core the helper needs.
constexpr auto kCallerSpinFor = std::chrono::microseconds(30);

inline uint64_t pack(uint32_t generation, int64_t count, int64_t index) {
  return (static_cast<uint64_t>(generation) << (kIndexBits + kCountBits)) |
         (static_cast<uint64_t>(count) << kIndexBits) | static_cast<uint64_t>(index);
}
inline uint32_t generation_of(uint64_t word) { return static_cast<uint32_t>(word >> (kIndexBits + kCountBits)); }
inline int64_t count_of(uint64_t word) { return static_cast<int64_t>((word >> kIndexBits) & kCountMask); }
inline int64_t index_of(uint64_t word) { return static_cast<int64_t>(word & kIndexMask); }

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

struct Pool {
  std::atomic<uint64_t> claim{0};
  std::atomic<uint32_t> published{0};  // the current job's generation; the helper sleeps on it
  std::atomic<uint32_t> helper_done{0};  // chunks the helper finished in the current job (futex word)
  std::atomic<bool> caller_sleeping{false};  // the caller waits on helper_done in the kernel
  std::atomic<const std::function<void(int64_t)>*> fn{nullptr};
  std::atomic<int64_t> helpers{0};
  std::atomic<bool> busy{false};  // a job is running (a second caller runs its chunks inline)
  std::mutex start;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: the detached helper may outlive static destructors
  return *p;
}

// Claims and runs chunks of job `generation` until none are left or a newer job replaced it.
void help_with(Pool& p, uint32_t generation) {
  uint64_t word = p.claim.load(std::memory_order_acquire);
  for (;;) {
    if (generation_of(word) != generation || index_of(word) >= count_of(word)) return;
    if (!p.claim.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      continue;  // `word` now holds the current value
    }
    (*p.fn.load(std::memory_order_acquire))(index_of(word));
    // seq_cst pairs with the caller's store of caller_sleeping then load of helper_done: either the
    // caller sees this chunk done or this thread sees it asleep and wakes it.
    p.helper_done.fetch_add(1, std::memory_order_seq_cst);
    if (p.caller_sleeping.load(std::memory_order_seq_cst)) p.helper_done.notify_one();
    word = p.claim.load(std::memory_order_acquire);
  }
}

[[noreturn]] void helper_loop() {
  Pool& p = pool();
  uint32_t seen = p.published.load(std::memory_order_acquire);
  for (;;) {
    uint32_t now = p.published.load(std::memory_order_acquire);
    if (now == seen) {
      // Poll a little (yielding the core to anything runnable), then sleep until the next job.
      const auto until = std::chrono::steady_clock::now() + kPollFor;
      int spins = 0;
      while ((now = p.published.load(std::memory_order_acquire)) == seen) {
        relax();
        if (++spins % 64 == 0) {
          if (std::chrono::steady_clock::now() > until) break;
          sched_yield();
        }
      }
      if (now == seen) {
        p.published.wait(seen, std::memory_order_acquire);
        continue;
      }
    }
    seen = now;
    help_with(p, now);
  }
}

// Returns once the helper has finished `theirs` chunks: spins briefly, then sleeps in the kernel.
void wait_for_helper(Pool& p, uint32_t theirs) {
  if (p.helper_done.load(std::memory_order_acquire) >= theirs) return;
  const auto until = std::chrono::steady_clock::now() + kCallerSpinFor;
  int spins = 0;
  while (p.helper_done.load(std::memory_order_acquire) < theirs) {
    relax();
    if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
  }
  p.caller_sleeping.store(true, std::memory_order_seq_cst);
  for (uint32_t done; (done = p.helper_done.load(std::memory_order_seq_cst)) < theirs;) {
    p.helper_done.wait(done, std::memory_order_acquire);
  }
  p.caller_sleeping.store(false, std::memory_order_relaxed);
}

}  // namespace

void parallel_chunks(int64_t num_chunks, const std::function<void(int64_t)>& fn) {
  Pool& p = pool();
  if (num_chunks <= 1 || p.helpers.load(std::memory_order_relaxed) == 0 || num_chunks >= int64_t{kIndexMask} - 1 ||
      p.busy.exchange(true, std::memory_order_acquire)) {
    for (int64_t c = 0; c < num_chunks; ++c) fn(c);
    return;
  }
  const uint32_t generation = (p.published.load(std::memory_order_relaxed) + 1) & kGenerationMask;
  p.fn.store(&fn, std::memory_order_relaxed);
  p.helper_done.store(0, std::memory_order_relaxed);
  p.claim.store(pack(generation, num_chunks, 0), std::memory_order_release);
  p.published.store(generation, std::memory_order_release);
  p.published.notify_one();
  int64_t mine = 0;
  for (;;) {
    const int64_t c = index_of(p.claim.fetch_add(1, std::memory_order_acq_rel));
    if (c >= num_chunks) break;
    fn(c);
    ++mine;
  }
  wait_for_helper(p, static_cast<uint32_t>(num_chunks - mine));
  p.busy.store(false, std::memory_order_release);
}

int64_t helper_threads() { return pool().helpers.load(std::memory_order_relaxed); }

bool use_helper_pool(int64_t work) {
  return work >= kHelperMinWork && helper_threads() > 0 && at::get_num_threads() <= 2;
}

namespace {

// 0: parallel_chunks runs everything on the caller; 1: one helper thread (started once, then
// only paused and resumed).
void set_helper_threads(int64_t n) {
  TORCH_CHECK(n == 0 || n == 1, "set_helper_threads: 0 or 1 helper threads, got ", n);
  Pool& p = pool();
  std::lock_guard<std::mutex> guard(p.start);
  static bool started = false;
  if (n == 1 && !started) {
    std::thread(helper_loop).detach();
    started = true;
  }
  p.helpers.store(n, std::memory_order_relaxed);
}

// Runs `num_chunks` chunks of ~`work_us` microseconds of arithmetic each through parallel_chunks and
// returns how many the calling thread ran (the rest ran on the helper): the tests' way to see the
// pool at work without a kernel.
int64_t helper_pool_probe(int64_t num_chunks, int64_t work_us) {
  std::atomic<int64_t> on_caller{0};
  const auto caller = std::this_thread::get_id();
  parallel_chunks(num_chunks, [&](int64_t) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us);
    while (std::chrono::steady_clock::now() < until) relax();
    if (std::this_thread::get_id() == caller) on_caller.fetch_add(1, std::memory_order_relaxed);
  });
  return on_caller.load();
}

}  // namespace
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("set_helper_threads(int n) -> ()", &tokenmill_cpu::set_helper_threads);
  m.def("helper_threads() -> int", &tokenmill_cpu::helper_threads);
  m.def("helper_pool_probe(int num_chunks, int work_us) -> int", &tokenmill_cpu::helper_pool_probe);
  m.def("helper_pool_used_for(int work) -> bool", &tokenmill_cpu::use_helper_pool);
}
