// Matrix products of a decode batch (a few to a few dozen rows) straight from GGUF-quantized
// weights (Q4_1, Q8_0, in the split-rows layout of cpu_quant_gemv.cpp), float32 activations.
//
// At 32 rows a float32 matmul is arithmetic-bound, but the oneDNN path also streams the float32
// weights (540 MB a step for SmolLM2-135M, against 96 MB of blocks). Here each weight is
// dequantized once a step into a small float32 panel (24 output rows x K, in L2) and then used for
// every activation row: the panel is multiplied with the activations transposed into 16-row
// groups, [k][16], so one FMA applies one weight (broadcast from the panel) to 16 rows at once and
// no horizontal sums are needed. Result: the float32 product of the dequantized weights (d * q + m
// computed with one FMA) up to summation order, like the one-row kernel.
//
// AVX2 + FMA builds (no AVX-512) do the same with 8-float registers: 8-row groups, and 16 ymm
// registers hold 12 accumulators, so a tile is 6 panel rows x 2 groups (16 activation rows) or,
// for a last odd group, 12 panel rows x 1 group.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#define TM_GEMM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_GEMM_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanelRows = 24;  // output features per panel: 24 accumulators + 1 load register
constexpr int64_t kGroup = 16;      // activation rows per zmm

#if defined(TM_GEMM_AVX512) || defined(TM_GEMM_AVX2)
inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}
#endif

#if defined(TM_GEMM_AVX512)
// Dequantize weight row `row` (split layout) into the panel: block b's 32 weights at
// panel_row + b * kPanelRows * 32 (the panel is [block][panel row][32], so the product below reads
// every weight at a constant offset from one pointer per block).
void dequantize_row(const uint8_t* row, int64_t quant_type, int64_t num_blocks, float* panel_row) {
  constexpr int64_t stride = kPanelRows * kBlock;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  if (quant_type == 0) {
    const uint8_t* d_bytes = row + num_blocks * 16;
    const uint8_t* m_bytes = row + num_blocks * 18;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m512 d = _mm512_set1_ps(half_bits_to_float(d_bytes + 2 * b));
      const __m512 m = _mm512_set1_ps(half_bits_to_float(m_bytes + 2 * b));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, low_mask)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), low_mask)));
      _mm512_storeu_ps(panel_row + b * stride, _mm512_fmadd_ps(lo, d, m));
      _mm512_storeu_ps(panel_row + b * stride + 16, _mm512_fmadd_ps(hi, d, m));
    }
  } else {
    const uint8_t* d_bytes = row + num_blocks * 32;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m512 d = _mm512_set1_ps(half_bits_to_float(d_bytes + 2 * b));
      const __m512 lo = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32))));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16))));
      _mm512_storeu_ps(panel_row + b * stride, _mm512_mul_ps(lo, d));
      _mm512_storeu_ps(panel_row + b * stride + 16, _mm512_mul_ps(hi, d));
    }
  }
}

// acc[n] (16 activation rows each) = sum_k panel[block k/32][n][k%32] * xt[k][0..16).
// The 24 accumulators are named variables: GCC spills an __m512 array to the stack every iteration.
#define TM_ACC_LIST(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
  X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
void panel_times_group(const float* panel, const float* xt, int64_t num_blocks, float* out_tile) {
  static_assert(kPanelRows == 24, "TM_ACC_LIST names 24 accumulators");
#define TM_DECLARE(n) __m512 acc##n = _mm512_setzero_ps();
  TM_ACC_LIST(TM_DECLARE)
#undef TM_DECLARE
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* pb = panel + b * kPanelRows * kBlock;
    const float* xb = xt + b * kBlock * kGroup;
    for (int j = 0; j < kBlock; ++j) {
      const __m512 xv = _mm512_loadu_ps(xb + j * kGroup);
#define TM_FMA(n) acc##n = _mm512_fmadd_ps(_mm512_set1_ps(pb[(n) * kBlock + j]), xv, acc##n);
      TM_ACC_LIST(TM_FMA)
#undef TM_FMA
    }
  }
#define TM_STORE(n) _mm512_storeu_ps(out_tile + (n) * kGroup, acc##n);
  TM_ACC_LIST(TM_STORE)
#undef TM_STORE
}
#undef TM_ACC_LIST
#endif

#if defined(TM_GEMM_AVX2)
constexpr int64_t kGroup8 = 8;  // activation rows per ymm

// As dequantize_row above, with 8-float registers: block b's 32 weights at
// panel_row + b * kPanelRows * 32.
void dequantize_row_avx2(const uint8_t* row, int64_t quant_type, int64_t num_blocks, float* panel_row) {
  constexpr int64_t stride = kPanelRows * kBlock;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  if (quant_type == 0) {
    const uint8_t* d_bytes = row + num_blocks * 16;
    const uint8_t* m_bytes = row + num_blocks * 18;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m256 d = _mm256_set1_ps(half_bits_to_float(d_bytes + 2 * b));
      const __m256 m = _mm256_set1_ps(half_bits_to_float(m_bytes + 2 * b));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      const __m128i lo = _mm_and_si128(qs, low_mask);                     // weights 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low_mask);  // weights 16..31
      float* dst = panel_row + b * stride;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m));
      _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m));
      _mm256_storeu_ps(dst + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m));
      _mm256_storeu_ps(dst + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m));
    }
  } else {
    const uint8_t* d_bytes = row + num_blocks * 32;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m256 d = _mm256_set1_ps(half_bits_to_float(d_bytes + 2 * b));
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16));
      float* dst = panel_row + b * stride;
      _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d));
      _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d));
      _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d));
      _mm256_storeu_ps(dst + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d));
    }
  }
}

// Tile of 6 panel rows x 2 activation groups (16 rows): acc[n][g] = sum_k panel[n][k] * xt_g[k][0..8).
// `panel` points at the tile's first row within the panel ([block][kPanelRows][32]); out_tile is
// [6][16]. Named accumulators, as above, so that GCC keeps all 12 in registers.
#define TM_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
void panel6_times_groups2(const float* panel, const float* xt0, const float* xt1, int64_t num_blocks,
                          float* out_tile) {
#define TM_DECLARE(n) __m256 acc##n##a = _mm256_setzero_ps(), acc##n##b = _mm256_setzero_ps();
  TM_ROWS6(TM_DECLARE)
#undef TM_DECLARE
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* pb = panel + b * kPanelRows * kBlock;
    const float* xa = xt0 + b * kBlock * kGroup8;
    const float* xb = xt1 + b * kBlock * kGroup8;
    for (int j = 0; j < kBlock; ++j) {
      const __m256 va = _mm256_loadu_ps(xa + j * kGroup8);
      const __m256 vb = _mm256_loadu_ps(xb + j * kGroup8);
#define TM_FMA(n)                                              \
  {                                                            \
    const __m256 w = _mm256_broadcast_ss(pb + (n) * kBlock + j); \
    acc##n##a = _mm256_fmadd_ps(w, va, acc##n##a);             \
    acc##n##b = _mm256_fmadd_ps(w, vb, acc##n##b);             \
  }
      TM_ROWS6(TM_FMA)
#undef TM_FMA
    }
  }
#define TM_STORE(n)                                                   \
  _mm256_storeu_ps(out_tile + (n) * 2 * kGroup8, acc##n##a);          \
  _mm256_storeu_ps(out_tile + (n) * 2 * kGroup8 + kGroup8, acc##n##b);
  TM_ROWS6(TM_STORE)
#undef TM_STORE
}
#undef TM_ROWS6

// Tile of 12 panel rows x 1 activation group (8 rows), for an odd last group; out_tile is [12][8].
#define TM_ROWS12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
void panel12_times_group(const float* panel, const float* xt0, int64_t num_blocks, float* out_tile) {
#define TM_DECLARE(n) __m256 acc##n = _mm256_setzero_ps();
  TM_ROWS12(TM_DECLARE)
#undef TM_DECLARE
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* pb = panel + b * kPanelRows * kBlock;
    const float* xa = xt0 + b * kBlock * kGroup8;
    for (int j = 0; j < kBlock; ++j) {
      const __m256 va = _mm256_loadu_ps(xa + j * kGroup8);
#define TM_FMA(n) acc##n = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + (n) * kBlock + j), va, acc##n);
      TM_ROWS12(TM_FMA)
#undef TM_FMA
    }
  }
#define TM_STORE(n) _mm256_storeu_ps(out_tile + (n) * kGroup8, acc##n);
  TM_ROWS12(TM_STORE)
#undef TM_STORE
}
#undef TM_ROWS12

void quant_gemm_avx2(const float* x_data, const uint8_t* w, float* y, int64_t m, int64_t k, int64_t n,
                     int64_t quant_type, int64_t num_blocks, int64_t block_bytes) {
  // Activations transposed into groups of 8 rows (zero rows pad the last group): xt[g][k][8].
  const int64_t groups = (m + kGroup8 - 1) / kGroup8;
  std::vector<float> xt(groups * k * kGroup8, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    float* dst = xt.data() + (r / kGroup8) * k * kGroup8 + (r % kGroup8);
    const float* src = x_data + r * k;
    for (int64_t i = 0; i < k; ++i) dst[i * kGroup8] = src[i];
  }
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k);
    float tile[12 * kGroup8];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanelRows, rows = std::min(kPanelRows, n - first);
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row_avx2(w + (first + r) * num_blocks * block_bytes, quant_type, num_blocks,
                            panel.data() + r * kBlock);
      }
      if (rows < kPanelRows) {  // zero weights for the missing rows (their outputs are dropped)
        for (int64_t b = 0; b < num_blocks; ++b) {
          std::fill_n(panel.data() + (b * kPanelRows + rows) * kBlock, (kPanelRows - rows) * kBlock, 0.f);
        }
      }
      // Pairs of groups: 4 tiles of 6 panel rows each (tiles past `rows` are skipped).
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        for (int64_t t = 0; t * 6 < rows; ++t) {
          panel6_times_groups2(panel.data() + t * 6 * kBlock, xt.data() + g * k * kGroup8,
                               xt.data() + (g + 1) * k * kGroup8, num_blocks, tile);
          const int64_t tile_rows = std::min<int64_t>(6, rows - t * 6);
          const int64_t group_rows = std::min(2 * kGroup8, m - g * kGroup8);
          for (int64_t j = 0; j < group_rows; ++j) {
            float* yr = y + (g * kGroup8 + j) * n + first + t * 6;
            for (int64_t r = 0; r < tile_rows; ++r) yr[r] = tile[r * 2 * kGroup8 + j];
          }
        }
      }
      if (g < groups) {  // the last, odd group: 2 tiles of 12 panel rows
        for (int64_t t = 0; t * 12 < rows; ++t) {
          panel12_times_group(panel.data() + t * 12 * kBlock, xt.data() + g * k * kGroup8, num_blocks, tile);
          const int64_t tile_rows = std::min<int64_t>(12, rows - t * 12);
          const int64_t group_rows = std::min(kGroup8, m - g * kGroup8);
          for (int64_t j = 0; j < group_rows; ++j) {
            float* yr = y + (g * kGroup8 + j) * n + first + t * 12;
            for (int64_t r = 0; r < tile_rows; ++r) yr[r] = tile[r * kGroup8 + j];
          }
        }
      }
    }
  });
}
#endif

// out [M, N] float32 = x [M, K] float32 @ dequant(blocks [N, row_bytes])^T; quant_type 0 = Q4_1, 1 = Q8_0.
void quant_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type) {
#if !defined(TM_GEMM_AVX512) && !defined(TM_GEMM_AVX2)
  TORCH_CHECK(false, "quant_gemm needs AVX-512 or AVX2+FMA (quant_gemm_available() is false on this build)");
#else
  TORCH_CHECK(quant_type == 0 || quant_type == 1, "quant_gemm: quant_type must be 0 (Q4_1) or 1 (Q8_0), got ",
              quant_type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_gemm: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "quant_gemm: out must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "quant_gemm: blocks must be a contiguous uint8 [N, row_bytes] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t block_bytes = quant_type == 0 ? 20 : 34;
  TORCH_CHECK(k % kBlock == 0, "quant_gemm: K (", k, ") must be a multiple of 32");
  const int64_t num_blocks = k / kBlock;
  TORCH_CHECK(blocks.size(1) == num_blocks * block_bytes, "quant_gemm: blocks have ", blocks.size(1),
              " bytes a row; K = ", k, " needs ", num_blocks * block_bytes);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_gemm: out must be [", m, ", ", n, "]");
  if (m == 0 || n == 0) return;
  const float* x_data = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
#if defined(TM_GEMM_AVX2)
  quant_gemm_avx2(x_data, w, y, m, k, n, quant_type, num_blocks, block_bytes);
#else
  // Activations transposed into groups of 16 rows (zero rows pad the last group): xt[g][k][16].
  const int64_t groups = (m + kGroup - 1) / kGroup;
  std::vector<float> xt(groups * k * kGroup, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    float* dst = xt.data() + (r / kGroup) * k * kGroup + (r % kGroup);
    const float* src = x_data + r * k;
    for (int64_t i = 0; i < k; ++i) dst[i * kGroup] = src[i];
  }
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanelRows * k);
    float tile[kPanelRows * kGroup];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanelRows, rows = std::min(kPanelRows, n - first);
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row(w + (first + r) * num_blocks * block_bytes, quant_type, num_blocks,
                       panel.data() + r * kBlock);
      }
      if (rows < kPanelRows) {  // zero weights for the missing rows (their outputs are dropped)
        for (int64_t b = 0; b < num_blocks; ++b) {
          std::fill_n(panel.data() + (b * kPanelRows + rows) * kBlock, (kPanelRows - rows) * kBlock, 0.f);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        panel_times_group(panel.data(), xt.data() + g * k * kGroup, num_blocks, tile);
        const int64_t group_rows = std::min(kGroup, m - g * kGroup);
        for (int64_t j = 0; j < group_rows; ++j) {
          float* yr = y + (g * kGroup + j) * n + first;
          for (int64_t r = 0; r < rows; ++r) yr[r] = tile[r * kGroup + j];
        }
      }
    }
  });
#endif  // TM_GEMM_AVX2
#endif
}

bool quant_gemm_available() {
#if defined(TM_GEMM_AVX512) || defined(TM_GEMM_AVX2)
  return true;
#else
  return false;
#endif
}

// Which path this build has: "avx512", "avx2" or "" (none). The Python side picks the row counts
// the kernel serves by it (kernels/cpu/quant_gemv.prefill_rows_limit).
std::string quant_gemm_isa() {
#if defined(TM_GEMM_AVX512)
  return "avx512";
#elif defined(TM_GEMM_AVX2)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quant_gemm(Tensor(a!) out, Tensor x, Tensor blocks, int quant_type) -> ()");
  m.def("quant_gemm_available() -> bool", &quant_gemm_available);
  m.def("quant_gemm_isa() -> str", &quant_gemm_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("quant_gemm", &quant_gemm); }
