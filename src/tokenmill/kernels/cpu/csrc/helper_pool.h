// Opportunistic helper threads for the CPU kernels' products and attention (cpu_helper_pool.cpp).
//
// On a small machine the serving engine runs one torch thread and leaves the other core(s) to the
// API server and the client. A one-row decode step is then ~120 matrix-vector products of 25 us
// to 1.5 ms each, bound by one core's memory stream, while the other core is mostly idle. OpenMP
// cannot use that core safely: its parallel regions end in a barrier that every team thread must
// reach, so whenever the second core is busy with the API server the product waits for the
// scheduler (served one-row decode fell to 0.48-0.60x with two torch threads).
//
// parallel_chunks never waits for a helper that has not started: the calling thread claims chunks
// from a shared counter and runs them itself; a helper that wakes in time claims some too, and the
// caller waits only for chunks a helper has already claimed (each a few microseconds of work).
// With the other core busy the product runs as it would on one thread, plus one wake-up call.
#pragma once

#include <cstdint>
#include <functional>

namespace tokenmill_cpu {

// Chunk `c` of `num_chunks`: fn(c). Runs on the calling thread and on free helpers; returns once
// every chunk has run. Without helpers (the default) it is a plain loop on the calling thread.
void parallel_chunks(int64_t num_chunks, const std::function<void(int64_t)>& fn);

// How many helper threads parallel_chunks may use (0 or 1).
int64_t helper_threads();

// Below this many multiply-adds (a few microseconds of one core) a call runs on the caller alone:
// waking the helper (a futex call when it sleeps, then its polling) costs more than it saves. Tiny
// models (the test suite's hidden-64 checkpoints) stay off the helper; SmolLM2-135M's smallest
// product (576 x 576) and a decode row's attention at a 200-token context are above it.
constexpr int64_t kHelperMinWork = int64_t{1} << 16;

// Whether a kernel should split a call of `work` multiply-adds with parallel_chunks rather than
// at::parallel_for: the work is worth sharing, a helper is running and the process has at most two
// torch threads, so the caller and the helper are as many threads as an OpenMP team would be, and
// they adapt to a core taken by something else (an OpenMP team splits statically and waits for its
// slowest member).
bool use_helper_pool(int64_t work);

}  // namespace tokenmill_cpu
