// Batched matmuls (decode batches above the one-row kernel, and prefill chunks) from GGUF Q4_1 /
// Q8_0 weights with 16-bit integer activations, for AVX2 builds without AVX-512 VNNI (AMD Zen 2/3,
// Intel before Ice Lake). `vpmaddwd` does 16 int16 multiply-adds an instruction where the float
// kernel's FMA (cpu_quant_gemm.cpp) does 8; tight loops on a Zen 3 core: 71-82 G int16
// multiply-adds/s against 42 G float32 FMA/s (78-79 G for the 2 x 4 tile's step below). The weights need
// only widening to int16, not converting and scaling.
//
// Numerics: the AVX-512 VNNI kernel's (cpu_quant_gemm_vnni.cpp) and so the few-row kernel's at 16
// bits: each activation row is quantized per block of 32 with d_x = max|x| / 32767, round to
// nearest even; a block's integer dot is exact (int32), then scaled by d_w * d_x in float32; Q4_1's
// offset term m * sum(x) uses the float sum of the block. A product's rows do not depend on which
// other rows share the call (up to float32 summation order of that sum).
//
// Layout: a panel of 24 weight rows is unpacked from the vnni layout into int16 in natural order,
// [block][panel row][32]; activations are quantized into groups of 8 rows, [group][block][pair j]
// [row] of int16 pairs (weights 2j, 2j + 1), so one `vpmaddwd` applies one broadcast weight pair to
// 8 rows (no horizontal sums). Tiles of 8 int32 accumulators: 2 weight rows x 4 groups, 4 x 2, or
// 8 x 1 for what is left; each block's sums become float32 into a small array in L1, and a pass's
// outputs leave through 8 x 8 transposes as row pieces. Buffers are 64-byte aligned
// (int16_panel.h: from misaligned heap blocks half the 32-byte activation loads split lines).

#include "quant_gemm_int16_avx2.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "helper_pool.h"
#include "int16_panel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__))
#define TM_GEMM_INT16_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tokenmill_cpu {

#if defined(TM_GEMM_INT16_AVX2)
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPairs = 16;      // int16 pairs a block
constexpr int64_t kGroup = 8;       // activation rows a ymm (one int32 lane each)
constexpr int64_t kPanelRows = 24;  // weight rows unpacked at a time (a multiple of the tiles' 2, 4 and 8)
// Blocks a pass of the panel's tiles covers before the next pass, so that the tiles of a panel
// find these blocks' activations (4 groups: 2 KiB a block) and weights (1.5 KiB) in L1 whatever K
// is (a tile over all of K = 1536 reads 96 KiB of activations). Passes of 2 and 6 blocks measured
// the same as whole-K passes at the default model's K (576, 1536); the asm tiles (below) mattered.
constexpr int64_t kChunkBlocks = 2;
constexpr float kLevels = 32767.f;

inline float horizontal_max(__m256 v) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

inline float horizontal_sum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 16 floats (already scaled) -> 16 int16 in order, clamped to +-32767, rounded to nearest even.
inline __m256i to_int16(__m256 a, __m256 b, __m256 low, __m256 high) {
  // max first: a NaN product (inverse 0 times inf) becomes -32767, as in the VNNI kernel.
  const __m256i qa = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(a, low), high));
  const __m256i qb = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(b, low), high));
  // packs works within 128-bit lanes: [a0-3, b0-3, a4-7, b4-7] -> reorder the 64-bit quarters.
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(qa, qb), 0xD8);
}

// Row r of x (its 32 num_blocks values at `x`) into its group's lane of `out`.
void quantize_activation_row(const float* x, int64_t r, int64_t num_blocks, QuantizedActivations& out) {
  const __m256 high = _mm256_set1_ps(kLevels), low = _mm256_set1_ps(-kLevels);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  alignas(32) int32_t words[kPairs];
  const int64_t g = r / kGroup, lane = r % kGroup;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const float amax = horizontal_max(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                                    _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask))));
    const float s = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    const int64_t at = (g * num_blocks + b) * kGroup + lane;
    out.sum[at] = s;
    float inverse;
    if (!std::isfinite(s)) {  // a NaN / inf activation reaches the output through a NaN scale
      out.scale[at] = std::numeric_limits<float>::quiet_NaN();
      inverse = 0.f;
    } else {
      out.scale[at] = amax / kLevels;
      inverse = amax > 0.f ? kLevels / amax : 0.f;
    }
    const __m256 inv = _mm256_set1_ps(inverse);
    _mm256_store_si256(reinterpret_cast<__m256i*>(words),
                       to_int16(_mm256_mul_ps(v0, inv), _mm256_mul_ps(v1, inv), low, high));
    _mm256_store_si256(reinterpret_cast<__m256i*>(words + 8),
                       to_int16(_mm256_mul_ps(v2, inv), _mm256_mul_ps(v3, inv), low, high));
    int32_t* dst = out.pairs.data() + (g * num_blocks + b) * kPairs * kGroup + lane;
    for (int64_t j = 0; j < kPairs; ++j) dst[j * kGroup] = words[j];
  }
}

// Widening one block into 32 int16 in natural order. Q4_1: 16 bytes, weights 0..15 the low nibbles,
// 16..31 the high ones. Q8_0: 32 bytes of q + 128.
inline void widen_q4(__m128i packed, int16_t* dst) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_cvtepu8_epi16(_mm_and_si128(packed, mask)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                      _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
}

inline void widen_q8(__m256i stored, int16_t* dst) {
  const __m256i q = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A chunk of c blocks (vnni layout: 4-byte group t of the chunk belongs to block t % c; block i's
// groups c p + i in order of p, p = 0..3 for Q4_1's 16 bytes, 0..7 for Q8_0's 32) into natural order:
// block i of the chunk at dst + i * stride.
template <bool Q4>
inline void unpack_chunk4(const uint8_t* chunk, int16_t* dst, int64_t stride) {
  // Within 8 groups, [0, 4, 1, 5, 2, 6, 3, 7] puts block i's two groups in 64-bit quarter i.
  const __m256i by_block = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  if (Q4) {
    const __m256i a = _mm256_permutevar8x32_epi32(load256(chunk), by_block);       // p = 0, 1
    const __m256i b = _mm256_permutevar8x32_epi32(load256(chunk + 32), by_block);  // p = 2, 3
    const __m256i blocks02 = _mm256_unpacklo_epi64(a, b), blocks13 = _mm256_unpackhi_epi64(a, b);
    widen_q4(_mm256_castsi256_si128(blocks02), dst);
    widen_q4(_mm256_castsi256_si128(blocks13), dst + stride);
    widen_q4(_mm256_extracti128_si256(blocks02, 1), dst + 2 * stride);
    widen_q4(_mm256_extracti128_si256(blocks13, 1), dst + 3 * stride);
  } else {
    const __m256i p01 = _mm256_permutevar8x32_epi32(load256(chunk), by_block);
    const __m256i p23 = _mm256_permutevar8x32_epi32(load256(chunk + 32), by_block);
    const __m256i p45 = _mm256_permutevar8x32_epi32(load256(chunk + 64), by_block);
    const __m256i p67 = _mm256_permutevar8x32_epi32(load256(chunk + 96), by_block);
    const __m256i first02 = _mm256_unpacklo_epi64(p01, p23), first13 = _mm256_unpackhi_epi64(p01, p23);
    const __m256i second02 = _mm256_unpacklo_epi64(p45, p67), second13 = _mm256_unpackhi_epi64(p45, p67);
    widen_q8(_mm256_permute2x128_si256(first02, second02, 0x20), dst);
    widen_q8(_mm256_permute2x128_si256(first13, second13, 0x20), dst + stride);
    widen_q8(_mm256_permute2x128_si256(first02, second02, 0x31), dst + 2 * stride);
    widen_q8(_mm256_permute2x128_si256(first13, second13, 0x31), dst + 3 * stride);
  }
}

template <bool Q4>
inline void unpack_chunk2(const uint8_t* chunk, int16_t* dst, int64_t stride) {
  // Within 8 groups, [0, 2, 4, 6, 1, 3, 5, 7] puts block 0's four groups in the low half.
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  if (Q4) {
    const __m256i a = _mm256_permutevar8x32_epi32(load256(chunk), by_block);
    widen_q4(_mm256_castsi256_si128(a), dst);
    widen_q4(_mm256_extracti128_si256(a, 1), dst + stride);
  } else {
    const __m256i first = _mm256_permutevar8x32_epi32(load256(chunk), by_block);        // p = 0..3
    const __m256i second = _mm256_permutevar8x32_epi32(load256(chunk + 32), by_block);  // p = 4..7
    widen_q8(_mm256_permute2x128_si256(first, second, 0x20), dst);
    widen_q8(_mm256_permute2x128_si256(first, second, 0x31), dst + stride);
  }
}

template <bool Q4>
inline void unpack_chunk1(const uint8_t* chunk, int16_t* dst) {
  if (Q4) {
    widen_q4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)), dst);
  } else {
    widen_q8(load256(chunk), dst);
  }
}

// Weight row (vnni layout) -> panel_row[b * kPanelRows * 32 ..] int16 in natural order, and its
// float scales d (and Q4_1 offsets m) into d_panel / m_panel [block].
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
  int64_t i = 0;
  for (; i + 8 <= num_blocks; i += 8) {
    _mm256_storeu_ps(d_panel + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + i))));
    if (Q4) {
      _mm256_storeu_ps(m_panel + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + num_blocks + i))));
    }
  }
  for (; i < num_blocks; ++i) {
    d_panel[i] = _cvtsh_ss(d[i]);
    if (Q4) m_panel[i] = _cvtsh_ss(d[num_blocks + i]);
  }
}

// One tile: R panel rows x G groups of 8 activation rows (R G = 8) over every block, into
// sums [R][G][8]. Accumulators are named variables (GCC spills an array of __m256i in the loop).
#define TM_R4G2(X) X(0, 0) X(0, 1) X(1, 0) X(1, 1) X(2, 0) X(2, 1) X(3, 0) X(3, 1)
#define TM_R8G1(X) X(0, 0) X(1, 0) X(2, 0) X(3, 0) X(4, 0) X(5, 0) X(6, 0) X(7, 0)
#define TM_R2G4(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3)
#define TM_G1(X) X(0, 0)
#define TM_G2(X) X(0, 0) X(0, 1)
#define TM_G4(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3)
#define TM_ZERO(r, g) __m256i isum_##r##_##g = _mm256_setzero_si256();
#define TM_SCALE(r, g)                                                                                     \
  {                                                                                                        \
    float* s = sums + ((g) * kPanelRows + (r)) * kGroup;                                                   \
    __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_##r##_##g),                                       \
                                 _mm256_mul_ps(dx##g, _mm256_set1_ps(d_panel[(r) * num_blocks + b])),      \
                                 _mm256_loadu_ps(s));                                                      \
    if (Q4) acc = _mm256_fmadd_ps(_mm256_set1_ps(m_panel[(r) * num_blocks + b]), sx##g, acc);             \
    _mm256_storeu_ps(s, acc);                                                                              \
  }
// The tiles' pair j, each as one asm block (left to allocate the ymm registers, GCC reloaded
// activation vectors and spilled: ~28 G multiply-adds/s a core). The activation vectors are
// `vpmaddwd` memory operands, read once per weight row: on Zen 3 the load folds into the
// instruction, and the 2 x 4 tile's tight loop ran at 78-79 G that way against 63-66 G loading
// them into registers first (18 instructions per 8 `vpmaddwd` instead of 22).
// 2 x 4: 8 accumulators, 2 broadcasts, a product.
#define TM_STEP_R2G4()                                                          \
  {                                                                                               \
    __m256i w0, w1, product;                                                                      \
    const int32_t* xj = xb + j * kGroup;                                                          \
    __asm__(                                                                                      \
        "vpbroadcastd %[w0m], %[w0]\n\t"                                                          \
        "vpbroadcastd %[w1m], %[w1]\n\t"                                                          \
        "vpmaddwd (%[xj]), %[w0], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a00], %[a00]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w0], %[p]\n\t"                                                \
        "vpaddd %[p], %[a01], %[a01]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],8), %[w0], %[p]\n\t"                                                \
        "vpaddd %[p], %[a02], %[a02]\n\t"                                                         \
        "vpmaddwd (%[xj3]), %[w0], %[p]\n\t"                                                       \
        "vpaddd %[p], %[a03], %[a03]\n\t"                                                         \
        "vpmaddwd (%[xj]), %[w1], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a10], %[a10]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w1], %[p]\n\t"                                                \
        "vpaddd %[p], %[a11], %[a11]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],8), %[w1], %[p]\n\t"                                                \
        "vpaddd %[p], %[a12], %[a12]\n\t"                                                         \
        "vpmaddwd (%[xj3]), %[w1], %[p]\n\t"                                                       \
        "vpaddd %[p], %[a13], %[a13]"                                                             \
        : [a00] "+x"(isum_0_0), [a01] "+x"(isum_0_1), [a02] "+x"(isum_0_2), [a03] "+x"(isum_0_3), \
          [a10] "+x"(isum_1_0), [a11] "+x"(isum_1_1), [a12] "+x"(isum_1_2), [a13] "+x"(isum_1_3), \
          [w0] "=&x"(w0), [w1] "=&x"(w1), [p] "=&x"(product)                                      \
        : [xj] "r"(xj), [gs] "r"(group_stride), [xj3] "r"(xj + 3 * group_stride),                 \
          [w0m] "m"(wb[0 * kPairs + j]), [w1m] "m"(wb[1 * kPairs + j])                            \
        : "memory");                                                                              \
  }
// 4 x 2: 8 accumulators, 4 broadcasts, a product; the 2 activation vectors as memory operands.
#define TM_STEP_R4G2()                                                          \
  {                                                                                               \
    __m256i w0, w1, w2, w3, product;                                                              \
    const int32_t* xj = xb + j * kGroup;                                                          \
    __asm__(                                                                                      \
        "vpbroadcastd %[w0m], %[w0]\n\t"                                                          \
        "vpbroadcastd %[w1m], %[w1]\n\t"                                                          \
        "vpbroadcastd %[w2m], %[w2]\n\t"                                                          \
        "vpbroadcastd %[w3m], %[w3]\n\t"                                                          \
        "vpmaddwd (%[xj]), %[w0], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a00], %[a00]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w0], %[p]\n\t"                                                \
        "vpaddd %[p], %[a01], %[a01]\n\t"                                                         \
        "vpmaddwd (%[xj]), %[w1], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a10], %[a10]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w1], %[p]\n\t"                                                \
        "vpaddd %[p], %[a11], %[a11]\n\t"                                                         \
        "vpmaddwd (%[xj]), %[w2], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a20], %[a20]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w2], %[p]\n\t"                                                \
        "vpaddd %[p], %[a21], %[a21]\n\t"                                                         \
        "vpmaddwd (%[xj]), %[w3], %[p]\n\t"                                                        \
        "vpaddd %[p], %[a30], %[a30]\n\t"                                                         \
        "vpmaddwd (%[xj],%[gs],4), %[w3], %[p]\n\t"                                                \
        "vpaddd %[p], %[a31], %[a31]"                                                             \
        : [a00] "+x"(isum_0_0), [a01] "+x"(isum_0_1), [a10] "+x"(isum_1_0), [a11] "+x"(isum_1_1), \
          [a20] "+x"(isum_2_0), [a21] "+x"(isum_2_1), [a30] "+x"(isum_3_0), [a31] "+x"(isum_3_1), \
          [w0] "=&x"(w0), [w1] "=&x"(w1), [w2] "=&x"(w2), [w3] "=&x"(w3), [p] "=&x"(product)     \
        : [xj] "r"(xj), [gs] "r"(group_stride), [w0m] "m"(wb[0 * kPairs + j]),                    \
          [w1m] "m"(wb[1 * kPairs + j]), [w2m] "m"(wb[2 * kPairs + j]),                           \
          [w3m] "m"(wb[3 * kPairs + j])                                                           \
        : "memory");                                                                              \
  }
// 8 x 1: 8 accumulators, 1 activation vector, one broadcast register reused, a product.
#define TM_STEP_R8G1()                                                          \
  {                                                                                               \
    __m256i x0, w0, product;                                                                      \
    const int32_t* xj = xb + j * kGroup;                                                          \
    __asm__(                                                                                      \
        "vmovdqu (%[xj]), %[x0]\n\t"                                                              \
        "vpbroadcastd %[w0m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a00], %[a00]\n\t"                                                         \
        "vpbroadcastd %[w1m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a10], %[a10]\n\t"                                                         \
        "vpbroadcastd %[w2m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a20], %[a20]\n\t"                                                         \
        "vpbroadcastd %[w3m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a30], %[a30]\n\t"                                                         \
        "vpbroadcastd %[w4m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a40], %[a40]\n\t"                                                         \
        "vpbroadcastd %[w5m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a50], %[a50]\n\t"                                                         \
        "vpbroadcastd %[w6m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a60], %[a60]\n\t"                                                         \
        "vpbroadcastd %[w7m], %[w0]\n\t"                                                          \
        "vpmaddwd %[w0], %[x0], %[p]\n\t"                                                         \
        "vpaddd %[p], %[a70], %[a70]"                                                             \
        : [a00] "+x"(isum_0_0), [a10] "+x"(isum_1_0), [a20] "+x"(isum_2_0), [a30] "+x"(isum_3_0), \
          [a40] "+x"(isum_4_0), [a50] "+x"(isum_5_0), [a60] "+x"(isum_6_0), [a70] "+x"(isum_7_0), \
          [x0] "=&x"(x0), [w0] "=&x"(w0), [p] "=&x"(product)                                      \
        : [xj] "r"(xj), [w0m] "m"(wb[0 * kPairs + j]), [w1m] "m"(wb[1 * kPairs + j]),             \
          [w2m] "m"(wb[2 * kPairs + j]), [w3m] "m"(wb[3 * kPairs + j]),                           \
          [w4m] "m"(wb[4 * kPairs + j]), [w5m] "m"(wb[5 * kPairs + j]),                           \
          [w6m] "m"(wb[6 * kPairs + j]), [w7m] "m"(wb[7 * kPairs + j])                            \
        : "memory");                                                                              \
  }
// Group g's scales and sums of block b.
#define TM_LOAD_SCALES(r, g)                                                       \
  const __m256 dx##g = _mm256_loadu_ps(scale_b + (g) * num_blocks * kGroup);        \
  const __m256 sx##g = _mm256_loadu_ps(sum_b + (g) * num_blocks * kGroup);          \
  (void)sx##g;
#define TM_TILE_BODY(TILE, GROUPS, STEP)                                                   \
  const int64_t group_stride = num_blocks * kPairs * kGroup;                               \
  for (int64_t b = block_begin; b < block_end; ++b) {                                      \
    const int32_t* wb = reinterpret_cast<const int32_t*>(panel + b * kPanelRows * kBlock); \
    const int32_t* xb = xq.pairs.data() + group * group_stride + b * kPairs * kGroup;      \
    TILE(TM_ZERO)                                                                          \
    for (int64_t j = 0; j < kPairs; ++j) {                                                 \
      STEP()                                                                               \
    }                                                                                      \
    const float* scale_b = xq.scale.data() + (group * num_blocks + b) * kGroup;            \
    const float* sum_b = xq.sum.data() + (group * num_blocks + b) * kGroup;                \
    GROUPS(TM_LOAD_SCALES)                                                                 \
    TILE(TM_SCALE)                                                                         \
  }

// 2 panel rows x 4 groups (32 activation rows): the fewest broadcasts per vpmaddwd (0.25).
template <bool Q4>
void tile_r2g4(const int16_t* panel, const float* d_panel, const float* m_panel, const QuantizedActivations& xq,
               int64_t group, int64_t num_blocks, int64_t block_begin, int64_t block_end, float* sums) {
  constexpr int64_t R = 2, G = 4;
  TM_TILE_BODY(TM_R2G4, TM_G4, TM_STEP_R2G4)
}

// 4 panel rows x 2 groups (16 activation rows).
template <bool Q4>
void tile_r4g2(const int16_t* panel, const float* d_panel, const float* m_panel, const QuantizedActivations& xq,
               int64_t group, int64_t num_blocks, int64_t block_begin, int64_t block_end, float* sums) {
  constexpr int64_t R = 4, G = 2;
  TM_TILE_BODY(TM_R4G2, TM_G2, TM_STEP_R4G2)
}

// 8 panel rows x 1 group (a last odd group, or a product of at most 8 rows).
template <bool Q4>
void tile_r8g1(const int16_t* panel, const float* d_panel, const float* m_panel, const QuantizedActivations& xq,
               int64_t group, int64_t num_blocks, int64_t block_begin, int64_t block_end, float* sums) {
  constexpr int64_t R = 8, G = 1;
  TM_TILE_BODY(TM_R8G1, TM_G1, TM_STEP_R8G1)
}
#undef TM_TILE_BODY
#undef TM_STEP_R2G4
#undef TM_STEP_R4G2
#undef TM_STEP_R8G1
#undef TM_SCALE
#undef TM_ZERO
#undef TM_R8G1
#undef TM_R4G2
#undef TM_R2G4
#undef TM_G1
#undef TM_G2
#undef TM_G4
#undef TM_LOAD_SCALES

// Columns c .. c + 7 of 8 rows: v[i] holds column c + i's 8 rows -> v[r] holds row r's 8 columns.
inline void transpose8(__m256 v[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  v[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  v[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// sums [G][panel row][8] of a pass over groups group .. group + G - 1 -> y rows (only the real
// ones), 8 columns at a time through a transpose: y's rows are n apart, and one scalar store per
// output (a row's 24 columns written 2 at a time by 12 tiles) stalled on the store buffer's
// misses (~12 % of the kernel's time at 64 rows).
void store_pass(const float* sums, int64_t G, int64_t group, int64_t rows, int64_t m, int64_t n, int64_t first,
                float* y) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t group_rows = std::min(kGroup, m - (group + g) * kGroup);
    const float* sg = sums + g * kPanelRows * kGroup;
    float* yg = y + (group + g) * kGroup * n + first;
    int64_t c = 0;
    if (group_rows == kGroup) {
      for (; c + 8 <= rows; c += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(sg + (c + i) * kGroup);
        transpose8(v);
        for (int lane = 0; lane < 8; ++lane) _mm256_storeu_ps(yg + lane * n + c, v[lane]);
      }
    }
    for (int64_t lane = 0; lane < group_rows; ++lane) {
      for (int64_t col = c; col < rows; ++col) yg[lane * n + col] = sg[col * kGroup + lane];
    }
  }
}

template <bool Q4>
void gemm(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t num_blocks) {
  QuantizedActivations xq;
  quantize_activations<kGroup>(x, m, num_blocks, xq,
                                  [&](const float* row, int64_t r) { quantize_activation_row(row, r, num_blocks, xq); });
  const int64_t groups = (m + kGroup - 1) / kGroup;
  const int64_t row_bytes = num_blocks * (Q4 ? 20 : 34);
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  const auto panel_range = [&](int64_t begin, int64_t end) {
    AlignedVector<int16_t> panel(num_blocks * kPanelRows * kBlock);
    AlignedVector<float> d_panel(num_blocks * kPanelRows), m_panel(num_blocks * kPanelRows);
    AlignedVector<float> sums(4 * kPanelRows * kGroup);  // [group][panel row][8] of the groups in flight
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanelRows, rows = std::min(kPanelRows, n - first);
      const int64_t next_rows = p + 1 < end ? std::min(kPanelRows, n - first - kPanelRows) : 0;
      const auto unpack = [&](const uint8_t* row, int16_t* panel_row, float* d_row, float* m_row) {
        unpack_row<Q4>(row, num_blocks, panel_row, d_row, m_row);
      };
      fill_panel<kPanelRows>(w, row_bytes, num_blocks, first, rows, next_rows, panel.data(), d_panel.data(),
                                     m_panel.data(), unpack);
      for (int64_t g = 0; g < groups;) {
        // The widest tile the remaining groups fill: 4, then 2, then 1 groups.
        const int64_t tile_groups = groups - g >= 4 ? 4 : groups - g >= 2 ? 2 : 1;
        const int64_t tile_rows = kGroup / tile_groups;
        std::fill_n(sums.data(), kPanelRows * tile_groups * kGroup, 0.f);
        for (int64_t b = 0; b < num_blocks; b += kChunkBlocks) {
          const int64_t b_end = std::min(num_blocks, b + kChunkBlocks);
          for (int64_t at = 0; at < rows; at += tile_rows) {
            const int16_t* tile_panel = panel.data() + at * kBlock;
            const float* tile_d = d_panel.data() + at * num_blocks;
            const float* tile_m = m_panel.data() + at * num_blocks;
            float* tile_sums = sums.data() + at * kGroup;
            if (tile_groups == 4) {
              tile_r2g4<Q4>(tile_panel, tile_d, tile_m, xq, g, num_blocks, b, b_end, tile_sums);
            } else if (tile_groups == 2) {
              tile_r4g2<Q4>(tile_panel, tile_d, tile_m, xq, g, num_blocks, b, b_end, tile_sums);
            } else {
              tile_r8g1<Q4>(tile_panel, tile_d, tile_m, xq, g, num_blocks, b, b_end, tile_sums);
            }
          }
        }
        store_pass(sums.data(), tile_groups, g, rows, m, n, first, y);
        g += tile_groups;
      }
    }
  };
  if (panels > 1 && use_helper_pool(m * n * num_blocks * kBlock)) {
    // A small machine: ~16 chunks of panels shared by the caller and the helper thread
    // (helper_pool.h), each panel computed by one thread as before.
    const int64_t per = (panels + 15) / 16;
    parallel_chunks((panels + per - 1) / per, [&](int64_t c) { panel_range(c * per, std::min(panels, (c + 1) * per)); });
  } else {
    at::parallel_for(0, panels, 1, panel_range);
  }
}

}  // namespace

bool gemm_int16_avx2_available() { return true; }

void gemm_int16_avx2(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t num_blocks, bool q4) {
  if (q4) {
    gemm<true>(x, w, y, m, n, num_blocks);
  } else {
    gemm<false>(x, w, y, m, n, num_blocks);
  }
}

#else  // !TM_GEMM_INT16_AVX2

bool gemm_int16_avx2_available() { return false; }

void gemm_int16_avx2(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "gemm_int16_avx2: this build has no AVX2 (or has AVX-512 VNNI, whose kernel serves instead)");
}

#endif  // TM_GEMM_INT16_AVX2

}  // namespace tokenmill_cpu
