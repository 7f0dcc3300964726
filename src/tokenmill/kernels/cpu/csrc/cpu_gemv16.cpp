// The CPU's few-row matmul over 16-bit weights: out [M, N] = x [M, K] @ w [N, K]^T with x and w both
// bfloat16 or both float16, M <= 4 (decode rows), float32 accumulation and one rounding to the
// output's dtype, as a 16-bit F.linear rounds.
//
// Why: with --dtype bfloat16 / float16 on the CPU, one-row products through at::mm read the weights
// at 9-28 GB/s on the 2-core dev machine (a mixture-of-experts decode step spent 90 % of its time
// there), where the machine copies ~30 GB/s; a one-row product is a weight read and nothing else.
// Here x is widened to float32 once per call (it is small), each weight row is streamed once,
// widened 16 values at a time (bfloat16: a 16-bit shift; float16: vcvtph2ps) and multiply-added
// into two float32 accumulators per x row, then reduced. Output rows are split among threads as the
// quantized GEMV splits them (the helper pool with one or two torch threads, else at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "helper_pool.h"

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kPrefetchAhead = 1024;  // weights (2 KiB) ahead of the loads, into L1

inline float widen(uint16_t bits, bool bf16) {
  if (bf16) {
    const uint32_t word = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
  }
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__AVX512F__)
inline __m512 widen16(const uint16_t* p, bool bf16) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  return _mm512_cvtph_ps(v);
}

// y[r * n] = x[r] . w for one weight row; x is float32 [R, k].
template <int R>
void dot_rows(const uint16_t* w, const float* x, int64_t k, bool bf16, float* y, int64_t n) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchAhead), _MM_HINT_T0);
    const __m512 w0 = widen16(w + i, bf16), w1 = widen16(w + i + 16, bf16);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * k + i), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * k + i + 16), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
    for (int64_t j = i; j < k; ++j) sum += widen(w[j], bf16) * x[r * k + j];
    y[r * n] = sum;
  }
}

// One x row against two weight rows at once: two streams in flight for the memory system.
void dot_two_weight_rows(const uint16_t* w, const float* x, int64_t k, bool bf16, float* y) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const uint16_t* v = w + k;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + i + kPrefetchAhead), _MM_HINT_T0);
    const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
    a0 = _mm512_fmadd_ps(widen16(w + i, bf16), x0, a0);
    a1 = _mm512_fmadd_ps(widen16(w + i + 16, bf16), x1, a1);
    b0 = _mm512_fmadd_ps(widen16(v + i, bf16), x0, b0);
    b1 = _mm512_fmadd_ps(widen16(v + i + 16, bf16), x1, b1);
  }
  float sa = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), sb = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
  for (int64_t j = i; j < k; ++j) {
    sa += widen(w[j], bf16) * x[j];
    sb += widen(v[j], bf16) * x[j];
  }
  y[0] = sa;
  y[1] = sb;
}
#define TOKENMILL_GEMV16_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 widen8(const uint16_t* p, bool bf16) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  return _mm256_cvtph_ps(v);
}

inline float reduce8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int R>
void dot_rows(const uint16_t* w, const float* x, int64_t k, bool bf16, float* y, int64_t n) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m256 w0 = widen8(w + i, bf16), w1 = widen8(w + i + 8, bf16);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = reduce8(_mm256_add_ps(acc0[r], acc1[r]));
    for (int64_t j = i; j < k; ++j) sum += widen(w[j], bf16) * x[r * k + j];
    y[r * n] = sum;
  }
}
#define TOKENMILL_GEMV16_VECTOR 1
#endif

#if defined(__AVX512F__)
#define TOKENMILL_GEMV16_VECTOR 1
#endif

#if defined(TOKENMILL_GEMV16_VECTOR)
void rows_range(const uint16_t* w, const float* x, int64_t m, int64_t k, int64_t n, bool bf16, float* y,
                int64_t begin, int64_t end) {
  int64_t row = begin;
#if defined(TOKENMILL_GEMV16_PAIRS)
  if (m == 1) {
    for (; row + 2 <= end; row += 2) dot_two_weight_rows(w + row * k, x, k, bf16, y + row);
  }
#endif
  for (; row < end; ++row) {
    const uint16_t* wrow = w + row * k;
    float* yr = y + row;
    switch (m) {
      case 1: dot_rows<1>(wrow, x, k, bf16, yr, n); break;
      case 2: dot_rows<2>(wrow, x, k, bf16, yr, n); break;
      case 3: dot_rows<3>(wrow, x, k, bf16, yr, n); break;
      default: dot_rows<4>(wrow, x, k, bf16, yr, n); break;
    }
  }
}
#endif

// out [M, N] (x's dtype) = x [M, K] @ w [N, K]^T; x and w bfloat16 or float16, contiguous, M <= 4.
void gemv16(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
#if defined(TOKENMILL_GEMV16_VECTOR)
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "gemv16: x must be bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "gemv16: x must be a contiguous [M, K] tensor with 1 <= M <= ", kMaxRows);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == dtype && w.size(1) == x.size(1),
              "gemv16: w must be a contiguous [N, ", x.size(1), "] tensor of x's dtype");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == m && out.size(1) == n &&
                  (out.scalar_type() == dtype || out.scalar_type() == at::kFloat),
              "gemv16: out must be a contiguous [", m, ", ", n, "] tensor of x's dtype or float32");
  const bool bf16 = dtype == at::kBFloat16;
  std::vector<float> x32(m * k);
  const uint16_t* xbits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int64_t i = 0; i < m * k; ++i) x32[i] = widen(xbits[i], bf16);
  const bool out_float = out.scalar_type() == at::kFloat;
  std::vector<float> sums(out_float ? 0 : m * n);
  float* y = out_float ? out.data_ptr<float>() : sums.data();
  const uint16_t* wbits = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto run = [&](int64_t begin, int64_t end) {
    rows_range(wbits, x32.data(), m, k, n, bf16, y, begin, end);
    if (out_float) return;
    for (int64_t r = 0; r < m; ++r) {  // one rounding per output, in the thread that summed it
      const int64_t first = r * n + begin, last = r * n + end;
      if (bf16) {
        c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
        for (int64_t i = first; i < last; ++i) o[i] = c10::BFloat16(sums[i]);
      } else {
        c10::Half* o = out.data_ptr<c10::Half>();
        for (int64_t i = first; i < last; ++i) o[i] = c10::Half(sums[i]);
      }
    }
  };
  const int64_t work = m * n * k;
  if (n > 64 && tokenmill_cpu::use_helper_pool(work)) {
    const int64_t rows = std::max<int64_t>(64, n / 32);
    tokenmill_cpu::parallel_chunks((n + rows - 1) / rows,
                                   [&](int64_t c) { run(c * rows, std::min(n, (c + 1) * rows)); });
  } else {
    at::parallel_for(0, n, 64, run);
  }
#else
  TORCH_CHECK(false, "gemv16: this build has no vector path (AVX-512 or AVX2 + FMA + F16C); use F.linear");
#endif
}

// Whether gemv16 runs here (an AVX-512 or AVX2 + FMA + F16C build); callers fall back to F.linear.
bool gemv16_available() {
#if defined(TOKENMILL_GEMV16_VECTOR)
  return true;
#else
  return false;
#endif
}

int64_t gemv16_max_rows() { return kMaxRows; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gemv16(Tensor(a!) out, Tensor x, Tensor w) -> ()");
  m.def("gemv16_available() -> bool", &gemv16_available);
  m.def("gemv16_max_rows() -> int", &gemv16_max_rows);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("gemv16", &gemv16); }
