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
#include <cmath>
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
// Weight rows [begin, end) of y [m, n] (float32) = x [m, k] (float32) @ w [n, k]^T (16-bit). A row's
// sum does not depend on m or on the pairing below: every path splits k the same way.
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
    for (int64_t first = 0; first < m; first += kMaxRows) {  // x rows up to 4 at a time
      const float* xr = x + first * k;
      float* yr = y + first * n + row;
      switch (std::min<int64_t>(kMaxRows, m - first)) {
        case 1: dot_rows<1>(wrow, xr, k, bf16, yr, n); break;
        case 2: dot_rows<2>(wrow, xr, k, bf16, yr, n); break;
        case 3: dot_rows<3>(wrow, xr, k, bf16, yr, n); break;
        default: dot_rows<4>(wrow, xr, k, bf16, yr, n); break;
      }
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

#if defined(TOKENMILL_GEMV16_VECTOR)
// A 16-bit value rounded from float32 (round to nearest even), back as float32: the rounding a
// 16-bit tensor op does when it stores its float32 result.
inline float round16(float value, bool bf16) {
  if (bf16) return static_cast<float>(c10::BFloat16(value));
  return static_cast<float>(c10::Half(value));
}

inline void store16(void* base, int64_t i, float value, bool bf16) {
  if (bf16) {
    static_cast<c10::BFloat16*>(base)[i] = c10::BFloat16(value);
  } else {
    static_cast<c10::Half*>(base)[i] = c10::Half(value);
  }
}

// Runs fn(expert slot, first row, end row) over every used expert's `rows` output rows, in chunks
// of whole row blocks, on the caller and the helper (or at::parallel_for's threads).
template <typename F>
void over_expert_rows(int64_t num_used, int64_t rows, int64_t work, const F& fn) {
  const int64_t block = 64;
  const int64_t blocks_per_expert = (rows + block - 1) / block;
  const int64_t total = num_used * blocks_per_expert;
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t slot = c / blocks_per_expert, first = (c % blocks_per_expert) * block;
      fn(slot, first, std::min(rows, first + block));
    }
  };
  if (total > 1 && tokenmill_cpu::use_helper_pool(work)) {
    tokenmill_cpu::parallel_chunks(total, [&](int64_t c) { run(c, c + 1); });
  } else {
    at::parallel_for(0, total, 1, run);
  }
}
#endif

// The routed experts of a few tokens in one call, as TorchMoEOps.experts computes them with 16-bit
// tensors (the same roundings, the products' float32 sums in another order): for each token and
// each of its experts, g = x @ gate_up[e]^T (rounded), h = silu(g[:I]) (rounded) * g[I:] (rounded),
// y = h @ down[e]^T (rounded), y * weight (rounded), summed into the token's row in ascending expert
// order (each addition rounded). Each used expert's weights are read once for all its tokens.
// out [T, H] 16-bit; x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids [T, k] int64;
// weights [T, k] float32 or x's dtype.
void moe_experts16(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                   const at::Tensor& ids, const at::Tensor& weights) {
#if defined(TOKENMILL_GEMV16_VECTOR)
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "moe_experts16: x must be bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_experts16: x must be a contiguous [T, H] tensor");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.is_contiguous() && gate_up.scalar_type() == dtype && gate_up.size(2) == h &&
                  gate_up.size(1) % 2 == 0,
              "moe_experts16: gate_up must be a contiguous [E, 2I, ", h, "] tensor of x's dtype");
  const int64_t num_experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(down.dim() == 3 && down.is_contiguous() && down.scalar_type() == dtype && down.size(0) == num_experts &&
                  down.size(1) == h && down.size(2) == inter,
              "moe_experts16: down must be a contiguous [", num_experts, ", ", h, ", ", inter, "] tensor of x's dtype");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "moe_experts16: ids must be a contiguous int64 [", t, ", k] tensor");
  const int64_t top_k = ids.size(1);
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == dtype),
              "moe_experts16: weights must be a contiguous [", t, ", ", top_k, "] tensor, float32 or x's dtype");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == dtype,
              "moe_experts16: out must be a contiguous tensor like x");
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t* id = ids.data_ptr<int64_t>();
  // Used experts in ascending order, each with its tokens (ascending) and their weights.
  std::vector<int64_t> used;
  std::vector<std::vector<std::pair<int64_t, float>>> tokens_of;
  std::vector<int64_t> slot_of(num_experts, -1);
  for (int64_t e_rank = 0; e_rank < t * top_k; ++e_rank) {
    const int64_t e = id[e_rank];
    TORCH_CHECK(e >= 0 && e < num_experts, "moe_experts16: expert id ", e, " is outside [0, ", num_experts, ")");
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t tok = 0; tok < t; ++tok) {
      for (int64_t j = 0; j < top_k; ++j) {
        if (id[tok * top_k + j] != e) continue;
        const float wt = weights.scalar_type() == at::kFloat
                             ? weights.data_ptr<float>()[tok * top_k + j]
                             : widen(reinterpret_cast<const uint16_t*>(weights.data_ptr())[tok * top_k + j], bf16);
        if (slot_of[e] < 0) {
          slot_of[e] = static_cast<int64_t>(used.size());
          used.push_back(e);
          tokens_of.emplace_back();
        }
        tokens_of[slot_of[e]].emplace_back(tok, wt);
      }
    }
  }
  const int64_t num_used = static_cast<int64_t>(used.size());
  // Each used expert's x rows (its tokens', float32), then its g and h rows.
  const uint16_t* xbits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<int64_t> first_row(num_used + 1, 0);
  for (int64_t u = 0; u < num_used; ++u) first_row[u + 1] = first_row[u] + static_cast<int64_t>(tokens_of[u].size());
  const int64_t pairs = first_row[num_used];
  std::vector<float> xs(pairs * h), g(pairs * 2 * inter), hs(pairs * inter), ys(pairs * h);
  for (int64_t u = 0; u < num_used; ++u) {
    for (int64_t i = 0; i < static_cast<int64_t>(tokens_of[u].size()); ++i) {
      const int64_t tok = tokens_of[u][i].first;
      float* row = xs.data() + (first_row[u] + i) * h;
      for (int64_t c = 0; c < h; ++c) row[c] = widen(xbits[tok * h + c], bf16);
    }
  }
  const uint16_t* gu = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  const uint16_t* dn = reinterpret_cast<const uint16_t*>(down.data_ptr());
  over_expert_rows(num_used, 2 * inter, pairs * 2 * inter * h, [&](int64_t u, int64_t begin, int64_t end) {
    rows_range(gu + used[u] * 2 * inter * h, xs.data() + first_row[u] * h, first_row[u + 1] - first_row[u], h,
                 2 * inter, bf16, g.data() + first_row[u] * 2 * inter, begin, end);
  });
  for (int64_t p = 0; p < pairs; ++p) {
    const float* gp = g.data() + p * 2 * inter;
    float* hp = hs.data() + p * inter;
    for (int64_t c = 0; c < inter; ++c) {
      const float gate = round16(gp[c], bf16), up = round16(gp[inter + c], bf16);
      hp[c] = round16(round16(gate / (1.f + std::exp(-gate)), bf16) * up, bf16);
    }
  }
  over_expert_rows(num_used, h, pairs * h * inter, [&](int64_t u, int64_t begin, int64_t end) {
    rows_range(dn + used[u] * h * inter, hs.data() + first_row[u] * inter, first_row[u + 1] - first_row[u], inter,
                 h, bf16, ys.data() + first_row[u] * h, begin, end);
  });
  std::vector<float> acc(t * h, 0.f);
  for (int64_t u = 0; u < num_used; ++u) {  // ascending expert order, as index_add_ over sorted pairs
    for (int64_t i = 0; i < static_cast<int64_t>(tokens_of[u].size()); ++i) {
      const auto [tok, wt] = tokens_of[u][i];
      const float* y = ys.data() + (first_row[u] + i) * h;
      float* a = acc.data() + tok * h;
      for (int64_t c = 0; c < h; ++c) a[c] = round16(a[c] + round16(round16(y[c], bf16) * wt, bf16), bf16);
    }
  }
  for (int64_t i = 0; i < t * h; ++i) store16(out.data_ptr(), i, acc[i], bf16);
#else
  TORCH_CHECK(false, "moe_experts16: this build has no vector path (AVX-512 or AVX2 + FMA + F16C)");
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
  m.def("moe_experts16(Tensor(a!) out, Tensor x, Tensor gate_up, Tensor down, Tensor ids, Tensor weights) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("gemv16", &gemv16);
  m.impl("moe_experts16", &moe_experts16);
}
