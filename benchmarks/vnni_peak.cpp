// Tight-loop throughput of `vpdpwssd` on this core (the batched VNNI GEMM's multiply-add), for
// benchmarks/quant_gemm_microbench.py --peak: G multiply-adds/s (32 int16 pairs a zmm instruction)
// on 1 thread and on 2 threads at once, for
//   reg:       12 independent zmm accumulators, register operands only;
//   bcast:     the GEMM tile's form: the weight pair an embedded 32-bit broadcast from memory,
//              12 accumulators, one activation load a 12 instructions;
//   mix:       bcast plus the tile's per-block float work (per 16 dpwssd: cvtdq2ps, mulps,
//              2 fmadd), the instruction mix of cpu_quant_gemm_vnni.cpp's 12 x 16 tile.
//   mix-nomul: the same without the mulps (3 float ops a 16 dpwssd).
//   ymm:       reg with ymm registers (Zen 4 splits a zmm op into two 256-bit halves).
// Build: g++ -O2 -march=native -fopenmp vnni_peak.cpp -o vnni_peak; run: ./vnni_peak [seconds]
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;
volatile int sink;

#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// Returns multiply-adds done.
int64_t run_reg(int64_t iters) {
#define D(n) __m512i a##n = _mm512_set1_epi32(n);
  R12(D)
#undef D
  __m512i x = _mm512_set1_epi32(0x00010001), w = _mm512_set1_epi32(0x00020003);
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+v"(x), "+v"(w));
#define D(n) a##n = _mm512_dpwssd_epi32(a##n, w, x);
    R12(D)
#undef D
  }
  __m512i s = _mm512_setzero_si512();
#define D(n) s = _mm512_add_epi32(s, a##n);
  R12(D)
#undef D
  sink = _mm512_reduce_add_epi32(s);
  return iters * 12 * 32;
}

int64_t run_ymm(int64_t iters) {
#define D(n) __m256i a##n = _mm256_set1_epi32(n);
  R12(D)
#undef D
  __m256i x = _mm256_set1_epi32(0x00010001), w = _mm256_set1_epi32(0x00020003);
  for (int64_t i = 0; i < iters; ++i) {
    __asm__ volatile("" : "+v"(x), "+v"(w));
#define D(n) a##n = _mm256_dpwssd_epi32(a##n, w, x);
    R12(D)
#undef D
  }
  __m256i s = _mm256_setzero_si256();
#define D(n) s = _mm256_add_epi32(s, a##n);
  R12(D)
#undef D
  int32_t out[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), s);
  sink = out[0];
  return iters * 12 * 16;
}

// The tile's shape: 16 pairs a block, 12 broadcast weight words a pair, one activation vector.
template <int FloatOps>
int64_t run_tile(int64_t blocks) {
  alignas(64) static int32_t wb[18][12 * 16];
  alignas(64) static int32_t xb[18][16 * 16];
  alignas(64) static float scale[18][16];
  for (int b = 0; b < 18; ++b) {
    for (int i = 0; i < 12 * 16; ++i) wb[b][i] = (i * 7 + b) & 0x00FF00FF;
    for (int i = 0; i < 16 * 16; ++i) xb[b][i] = (i * 13 + b) & 0x0FFF0FFF;
    for (int i = 0; i < 16; ++i) scale[b][i] = 1e-6f * (i + 1);
  }
#define D(n) __m512 acc##n = _mm512_setzero_ps();
  R12(D)
#undef D
  for (int64_t i = 0; i < blocks; ++i) {
    const int b = static_cast<int>(i % 18);
    const int32_t* w = wb[b];
    const int32_t* x = xb[b];
#define D(n) __m512i isum##n = _mm512_setzero_si512();
    R12(D)
#undef D
    for (int j = 0; j < 16; ++j) {
      const __m512i xv = _mm512_load_si512(x + 16 * j);
#define D(n) isum##n = _mm512_dpwssd_epi32(isum##n, _mm512_set1_epi32(w[(n) * 16 + j]), xv);
      R12(D)
#undef D
    }
    if (FloatOps > 0) {
      const __m512 dx = _mm512_load_ps(scale[b]);
      if (FloatOps == 4) {
#define D(n) \
  acc##n = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum##n), _mm512_mul_ps(dx, _mm512_set1_ps(scale[b][n])), acc##n);
        R12(D)
#undef D
      } else {
#define D(n) acc##n = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum##n), dx, acc##n);
        R12(D)
#undef D
      }
#define D(n) acc##n = _mm512_fmadd_ps(_mm512_set1_ps(scale[b][(n) + 1]), dx, acc##n);
      R12(D)
#undef D
    } else {
#define D(n) acc##n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc##n), isum##n));
      R12(D)
#undef D
    }
  }
  __m512 s = _mm512_setzero_ps();
#define D(n) s = _mm512_add_ps(s, acc##n);
  R12(D)
#undef D
  sink = static_cast<int>(_mm512_reduce_add_ps(s));
  return blocks * 12 * 16 * 32;
}

template <typename F>
double rate(F fn, int threads, double seconds) {
  // Calibrate, then every thread runs the same count; G multiply-adds/s of all threads together.
  int64_t n = 1 << 16;
  for (;;) {
    const auto t0 = Clock::now();
    fn(n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0.05) {
      n = static_cast<int64_t>(n * seconds / s) + 1;
      break;
    }
    n *= 4;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    int64_t total = 0;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += fn(n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, total / s / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 0.3;
  struct Case {
    const char* name;
    int64_t (*fn)(int64_t);
  } cases[] = {
      {"reg", run_reg},           {"ymm", run_ymm},         {"bcast", run_tile<0>},
      {"mix", run_tile<4>},       {"mix-nomul", run_tile<3>},
  };
  for (const auto& c : cases) {
    const double one = rate(c.fn, 1, seconds), two = rate(c.fn, 2, seconds);
    std::printf("%-10s 1 thread %7.1f G MAC/s   2 threads %7.1f G MAC/s (%.2fx)\n", c.name, one, two, two / one);
  }
  return 0;
}
