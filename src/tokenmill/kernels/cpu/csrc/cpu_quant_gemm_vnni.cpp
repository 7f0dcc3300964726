// Batched matmuls (decode batches above the few-row kernel's 4 rows, and prefill chunks) from GGUF
// Q4_1 / Q8_0 weights with 16-bit integer activations, on AVX-512 VNNI: `vpdpwssd` does 32
// int16 multiply-adds an instruction where the float kernel (cpu_quant_gemm.cpp) does 16 float32
// FMAs, and the weights need only widening to int16, not converting and scaling.
//
// Numerics: as the one-to-four-row kernel at 16 bits (cpu_quant_gemv_int8.cpp, quantize_row): each
// activation row is quantized per block of 32 with d_x = max|x| / 32767, round to nearest even;
// the integer dot of a block is exact (int32), then scaled by d_w * d_x in float32; Q4_1's offset
// term m * sum(x) uses the exact float sum of the block. So decode rows get the same products
// (up to float32 summation order) whether a step has 4 rows or 5, and the error is ~float32's
// (greedy tokens of the default model stay transformers'; tests/engine/test_default_model.py).
//
// Weights are read in the few-row kernel's layout (kernels/cpu/quant_gemv_int8.vnni_rows: chunks of
// 4 / 2 / 1 blocks whose 4-byte groups interleave the chunk's blocks, then the float16 d, then m),
// so one copy of the blocks serves both kernels. A panel of 24 output rows is unpacked once a call
// into int16 in natural order, [block][panel row][32]; the activations are quantized once a call
// into groups of 16 rows, [group][block][pair j][row] of int16 pairs (weights 2j, 2j + 1), so one
// `vpdpwssd` applies one broadcast weight pair to 16 rows (no horizontal sums). Per block and
// weight row the int32 sums become float32 once: acc += float(isum) * (d_x[rows] * d_w).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "helper_pool.h"
#include "int16_panel.h"
#include "quant_gemm_int16_avx2.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define TM_GEMM_VNNI 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(TM_GEMM_VNNI)
constexpr int64_t kBlock = 32;
constexpr int64_t kPairs = 16;      // int16 pairs a block
constexpr int64_t kGroup = 16;      // activation rows a zmm (one int32 lane each)
constexpr int64_t kTileRows = 12;   // weight rows a micro-kernel: 12 int32 + 12 float accumulators
constexpr int64_t kPanelRows = 24;  // weight rows unpacked at a time (two tiles)
constexpr float kLevels = 32767.f;

// Row r of x (its K = 32 num_blocks values at `x`) into its group's lane of `out`. The numbers are
// quantize_row's in cpu_quant_gemv_int8.cpp: scale = amax / 32767, q = lrint(clamp(x * (32767 /
// amax))), and a block whose sum is not finite gets a NaN scale (so a NaN / inf activation reaches
// the output).
void quantize_activation_row(const float* x, int64_t r, int64_t num_blocks, tokenmill_cpu::QuantizedActivations& out) {
  const __m512 high = _mm512_set1_ps(kLevels), low = _mm512_set1_ps(-kLevels);
  alignas(64) int32_t words[kPairs];
  const int64_t g = r / kGroup, lane = r % kGroup;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    // Summed in quantize_row's order (sequential) would differ from this in the last bit only;
    // the sum is the float term of Q4_1's offsets, not part of the integer product.
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    const int64_t at = (g * num_blocks + b) * kGroup + lane;
    out.sum[at] = s;
    float inverse;
    if (!std::isfinite(s)) {
      out.scale[at] = std::numeric_limits<float>::quiet_NaN();
      inverse = 0.f;
    } else {
      out.scale[at] = amax / kLevels;
      inverse = amax > 0.f ? kLevels / amax : 0.f;
    }
    const __m512 inv = _mm512_set1_ps(inverse);
    // max first: a NaN product (inverse 0 times inf) becomes -32767, as std::max makes it there.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, inv), low), high));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, inv), low), high));
    // 32 int16 in order = 16 words, word j holding values 2j (low half) and 2j + 1.
    _mm256_store_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtepi32_epi16(q0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(words + 8), _mm512_cvtepi32_epi16(q1));
    int32_t* dst = out.pairs.data() + (g * num_blocks + b) * kPairs * kGroup + lane;
    for (int64_t j = 0; j < kPairs; ++j) dst[j * kGroup] = words[j];
  }
}

// Unpacking a chunk of c blocks (4-byte group t of its sequence is block t % c, weights
// 4 (t / c) .. + 3) into natural order. Q4_1: sequence value s is the low nibble of byte s (s < 16c)
// or the high nibble of byte s - 16c, so block i's weights 0..15 are the low nibbles of byte groups
// c p + i (p = 0..3) and 16..31 the high nibbles of the same groups. Q8_0 (q + 128 stored): block
// i's weights are byte groups c p + i, p = 0..7, the first four in the first 16c bytes. Either
// way one two-source dword permute per pair of blocks puts them in order.
inline void store_widened(int16_t* dst, __m256i bytes, bool q4) {
  _mm512_storeu_si512(dst, q4 ? _mm512_cvtepu8_epi16(bytes)
                              : _mm512_cvtepi8_epi16(_mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)))));
}

template <bool Q4>
inline void unpack_chunk4(const uint8_t* chunk, int16_t* dst, int64_t stride) {
  __m512i first, second;
  if (Q4) {
    const __m512i packed = _mm512_loadu_si512(chunk), mask = _mm512_set1_epi8(0x0F);
    first = _mm512_and_si512(packed, mask);
    second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
  } else {
    first = _mm512_loadu_si512(chunk);
    second = _mm512_loadu_si512(chunk + 64);
  }
  const __m512i blocks01 = _mm512_permutex2var_epi32(
      first, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29), second);
  const __m512i blocks23 = _mm512_permutex2var_epi32(
      first, _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31), second);
  store_widened(dst, _mm512_castsi512_si256(blocks01), Q4);
  store_widened(dst + stride, _mm512_extracti64x4_epi64(blocks01, 1), Q4);
  store_widened(dst + 2 * stride, _mm512_castsi512_si256(blocks23), Q4);
  store_widened(dst + 3 * stride, _mm512_extracti64x4_epi64(blocks23, 1), Q4);
}

template <bool Q4>
inline void unpack_chunk2(const uint8_t* chunk, int16_t* dst, int64_t stride) {
  __m256i first, second;
  if (Q4) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
    const __m256i mask = _mm256_set1_epi8(0x0F);
    first = _mm256_and_si256(packed, mask);
    second = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
  } else {
    first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
    second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  }
  store_widened(dst, _mm256_permutex2var_epi32(first, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), second), Q4);
  store_widened(dst + stride, _mm256_permutex2var_epi32(first, _mm256_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15), second),
                Q4);
}

template <bool Q4>
inline void unpack_chunk1(const uint8_t* chunk, int16_t* dst) {
  if (Q4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)), mask = _mm_set1_epi8(0x0F);
    store_widened(dst, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask)),
                  true);
  } else {
    store_widened(dst, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)), false);
  }
}

// Weight row (vnni layout) -> panel_row[b * kPanelRows * 32 ..] int16 in natural order, and its
// float scales d (and Q4_1 offsets m) into d_panel / m_panel [block] (the panel's row r of them
// at r * num_blocks: the tile reads them one broadcast at a time, so contiguous per row is free).
template <bool Q4>
void unpack_row(const uint8_t* row, int64_t num_blocks, int16_t* panel_row, float* d_panel, float* m_panel) {
  constexpr int64_t stride = kPanelRows * kBlock;
  const uint8_t* chunk = row;
  int64_t b = 0;
  for (; b + 4 <= num_blocks; b += 4, chunk += (Q4 ? 64 : 128)) unpack_chunk4<Q4>(chunk, panel_row + b * stride, stride);
  if (b + 2 <= num_blocks) {
    unpack_chunk2<Q4>(chunk, panel_row + b * stride, stride);
    chunk += Q4 ? 32 : 64;
    b += 2;
  }
  if (b < num_blocks) unpack_chunk1<Q4>(chunk, panel_row + b * stride);
  const uint16_t* d = reinterpret_cast<const uint16_t*>(row + num_blocks * (Q4 ? 16 : 32));
  for (int64_t i = 0; i < num_blocks; i += 16) {
    const __mmask16 mask = num_blocks - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (num_blocks - i)) - 1);
    _mm512_mask_storeu_ps(d_panel + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + i)));
    if (Q4) {
      _mm512_mask_storeu_ps(m_panel + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + num_blocks + i)));
    }
  }
}

// One tile: 12 panel rows x 16 activation rows over every block; out_tile [12][16].
// Accumulators are named variables: GCC spills an __m512 array to the stack in the loop.
#define TM_TILE(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
template <bool Q4>
void tile_dot(const int16_t* panel, const float* d_panel, const float* m_panel, const tokenmill_cpu::QuantizedActivations& xq,
              int64_t group, int64_t num_blocks, float* out_tile) {
  static_assert(kTileRows == 12, "TM_TILE names 12 accumulators");
#define TM_DECLARE(n) __m512 acc##n = _mm512_setzero_ps();
  TM_TILE(TM_DECLARE)
#undef TM_DECLARE
  const int32_t* xg = xq.pairs.data() + group * num_blocks * kPairs * kGroup;
  const float* scale_g = xq.scale.data() + group * num_blocks * kGroup;
  const float* sum_g = xq.sum.data() + group * num_blocks * kGroup;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int32_t* wb = reinterpret_cast<const int32_t*>(panel + b * kPanelRows * kBlock);
    const int32_t* xb = xg + b * kPairs * kGroup;
#define TM_DECLARE(n) __m512i isum##n = _mm512_setzero_si512();
    TM_TILE(TM_DECLARE)
#undef TM_DECLARE
    for (int64_t j = 0; j < kPairs; ++j) {
      const __m512i xv = _mm512_loadu_si512(xb + j * kGroup);
      // Inline asm, the weight pair an embedded broadcast: with the intrinsic GCC 12 copied every
      // int32 accumulator twice an instruction (26 register moves a 12 vpdpwssd).
#define TM_DOT(n) __asm__("vpdpwssd %[w]%{1to16%}, %[x], %[acc]" : [acc] "+v"(isum##n) : [x] "v"(xv), [w] "m"(wb[(n) * kPairs + j]));
      TM_TILE(TM_DOT)
#undef TM_DOT
    }
    const __m512 dx = _mm512_loadu_ps(scale_g + b * kGroup);
#define TM_SCALE(n) \
  acc##n = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum##n), _mm512_mul_ps(dx, _mm512_set1_ps(d_panel[(n) * num_blocks + b])), acc##n);
    TM_TILE(TM_SCALE)
#undef TM_SCALE
    if (Q4) {
      const __m512 sx = _mm512_loadu_ps(sum_g + b * kGroup);
#define TM_OFFSET(n) acc##n = _mm512_fmadd_ps(_mm512_set1_ps(m_panel[(n) * num_blocks + b]), sx, acc##n);
      TM_TILE(TM_OFFSET)
#undef TM_OFFSET
    }
  }
#define TM_STORE(n) _mm512_storeu_ps(out_tile + (n) * kGroup, acc##n);
  TM_TILE(TM_STORE)
#undef TM_STORE
}
#undef TM_TILE

template <bool Q4>
void gemm_vnni16(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t num_blocks) {
  tokenmill_cpu::QuantizedActivations xq;
  tokenmill_cpu::quantize_activations<kGroup>(x, m, num_blocks, xq,
                                  [&](const float* row, int64_t r) { quantize_activation_row(row, r, num_blocks, xq); });
  const int64_t groups = (m + kGroup - 1) / kGroup;
  const int64_t row_bytes = num_blocks * (Q4 ? 20 : 34);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  const auto panel_range = [&](int64_t begin, int64_t end) {
    tokenmill_cpu::AlignedVector<int16_t> panel(num_blocks * kPanelRows * kBlock);
    tokenmill_cpu::AlignedVector<float> d_panel(num_blocks * kPanelRows), m_panel(num_blocks * kPanelRows);
    alignas(64) float tile[kTileRows * kGroup];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanelRows, rows = std::min(kPanelRows, n - first);
      const int64_t next_rows = p + 1 < end ? std::min(kPanelRows, n - first - kPanelRows) : 0;
      const auto unpack = [&](const uint8_t* row, int16_t* panel_row, float* d_row, float* m_row) {
        unpack_row<Q4>(row, num_blocks, panel_row, d_row, m_row);
      };
      tokenmill_cpu::fill_panel<kPanelRows>(w, row_bytes, num_blocks, first, rows, next_rows, panel.data(), d_panel.data(),
                                     m_panel.data(), unpack);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t group_rows = std::min(kGroup, m - g * kGroup);
        for (int64_t t = 0; t * kTileRows < rows; ++t) {
          const int64_t at = t * kTileRows;
          tile_dot<Q4>(panel.data() + at * kBlock, d_panel.data() + at * num_blocks, m_panel.data() + at * num_blocks,
                       xq, g, num_blocks, tile);
          const int64_t tile_rows = std::min(kTileRows, rows - at);
          for (int64_t j = 0; j < group_rows; ++j) {
            float* yr = y + (g * kGroup + j) * n + first + at;
            for (int64_t r = 0; r < tile_rows; ++r) yr[r] = tile[r * kGroup + j];
          }
        }
      }
    }
  };
  if (panels > 1 && tokenmill_cpu::use_helper_pool(m * n * num_blocks * kBlock)) {
    // A small machine: ~16 chunks of panels shared by the caller and the helper thread
    // (helper_pool.h), each panel computed by one thread as before.
    const int64_t per = (panels + 15) / 16;
    tokenmill_cpu::parallel_chunks((panels + per - 1) / per,
                                   [&](int64_t c) { panel_range(c * per, std::min(panels, (c + 1) * per)); });
  } else {
    at::parallel_for(0, panels, 1, panel_range);
  }
}
#endif  // TM_GEMM_VNNI

bool quant_gemm_vnni16_available();

// out [M, N] float32 = x [M, K] float32 (16-bit-quantized per block of 32) @ dequant(blocks)^T,
// `blocks` [N, row_bytes] uint8 in the vnni layout; quant_type 0 = Q4_1, 1 = Q8_0. On AVX2 builds
// without VNNI the same product runs on `vpmaddwd` (cpu_quant_gemm_int16_avx2.cpp).
void quant_gemm_vnni16(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type) {
  TORCH_CHECK(quant_gemm_vnni16_available(),
              "quant_gemm_vnni16 needs AVX-512 VNNI or AVX2 (quant_gemm_vnni16_available() is false on this build)");
  TORCH_CHECK(quant_type == 0 || quant_type == 1,
              "quant_gemm_vnni16: quant_type must be 0 (Q4_1) or 1 (Q8_0), got ", quant_type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_gemm_vnni16: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "quant_gemm_vnni16: out must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "quant_gemm_vnni16: blocks must be a contiguous uint8 [N, row_bytes] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % 32 == 0, "quant_gemm_vnni16: K (", k, ") must be a multiple of 32");
  const int64_t num_blocks = k / 32;
  const int64_t block_bytes = quant_type == 0 ? 20 : 34;
  TORCH_CHECK(blocks.size(1) == num_blocks * block_bytes, "quant_gemm_vnni16: blocks have ", blocks.size(1),
              " bytes a row; K = ", k, " needs ", num_blocks * block_bytes);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_gemm_vnni16: out must be [", m, ", ", n, "]");
  if (m == 0 || n == 0) return;
#if defined(TM_GEMM_VNNI)
  if (quant_type == 0) {
    gemm_vnni16<true>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), m, n, num_blocks);
  } else {
    gemm_vnni16<false>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), m, n, num_blocks);
  }
#else
  tokenmill_cpu::gemm_int16_avx2(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), out.data_ptr<float>(), m, n, num_blocks,
                                 quant_type == 0);
#endif
}

// quant_gemm_vnni16 into a new [M, N] float32 tensor (no torch.empty from Python a product).
at::Tensor quant_linear_vnni16(const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "quant_linear_vnni16: x [M, K] and blocks [N, row_bytes] expected");
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options().dtype(at::kFloat));
  quant_gemm_vnni16(out, x, blocks, quant_type);
  return out;
}

// Whether this build (-march=native, so the CPU it was built on) has the kernel. The Python side
// sends batched products here only then; elsewhere the float kernel or oneDNN serves them.
bool quant_gemm_vnni16_available() {
#if defined(TM_GEMM_VNNI)
  return true;
#else
  return tokenmill_cpu::gemm_int16_avx2_available();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quant_gemm_vnni16(Tensor(a!) out, Tensor x, Tensor blocks, int quant_type) -> ()");
  m.def("quant_linear_vnni16(Tensor x, Tensor blocks, int quant_type) -> Tensor");
  m.def("quant_gemm_vnni16_available() -> bool", &quant_gemm_vnni16_available);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("quant_gemm_vnni16", &quant_gemm_vnni16);
  m.impl("quant_linear_vnni16", &quant_linear_vnni16);
}
