// One-to-four-row matmuls from GGUF Q4_1 / Q8_0 weights with integer-quantized activations, 8-bit
// (what llama.cpp does on the CPU) or 16-bit (the default: KernelConfig.cpu_activation_bits).
// 8 bits: AVX-512 VNNI `vpdpbusd` multiplies 64 unsigned weight bytes with 64 signed activation
// bytes and adds them in groups of 4 into 16 int32 lanes; 16 bits: the weights are widened to
// int16 and `vpdpwssd` does 32 pairs. Either replaces the float kernel's (cpu_quant_gemv.cpp)
// widen / convert / multiply of every weight, on which the one-row decode step was arithmetic-bound;
// both are now bound by streaming the weights, so 16 bits cost nothing over 8.
//
// Numerics: each activation row is quantized per block of 32 with scale d_x = max|x| / 127 (or
// / 32767), round to nearest, so the result is NOT the float32 product: each block's error is at
// most d_x / 2 * sum |d_w q_w| (tests/unit/test_cpu_quant_gemv_int8.py checks that bound). Q4_1's
// offset term m * sum(x) uses the exact float sum of the block.
//
// Weight layout (kernels/cpu/quant_gemv.vnni_rows, made once at load): per output row, the blocks
// in chunks of 4 (then one of 2, then one of 1 for the remainder). Within a chunk of c blocks the
// 32c weights are in "sequence order": 4-byte groups interleaved across the c blocks (group g is
// block g % c, weights 4 (g / c) .. 4 (g / c) + 3), so lane i of a dpbusd belongs to block i % c
// and one broadcast of the c scales scales every lane. Q4_1 packs sequence value s into the low
// nibble of byte s (s < 16c) or the high nibble of byte s - 16c: 16c bytes a chunk. Q8_0 stores
// q + 128 (unsigned for dpbusd; the activations' block sums times 128 are subtracted back):
// 32c bytes a chunk. After the chunks: the blocks' float16 d (and m for Q4_1), as in split_rows.
// The activations are quantized into the same sequence order per call (int8 or int16).
//
// AVX2 without VNNI (e.g. AMD Zen 3): the same layout and the same integer math (so the same
// result up to float32 summation order), with `vpmaddubsw` (unsigned x signed bytes, pairs added
// into int16) and `vpmaddwd` (int16 pairs into int32) instead of dpbusd / dpwssd:
// - 8 bits, Q4_1: maddubs(w 0..15, x) pairs stay within +-3810, so the 4 pieces of a chunk add in
//   int16 (+-15240) before one madd by ones widens them.
// - 8 bits, Q8_0: the stored q + 128 is flipped back to q; maddubs(|q|, sign(x, q)) (pairs within
//   +-32512, no saturation) replaces the +128 correction.
// - 16 bits, Q4_1: each activation is split into its high (signed) and low (unsigned) byte,
//   x = 256 xh + xl, so both halves multiply the 4-bit weights with maddubs (pairs +-3840 and
//   0..7650; 4 pieces add in int16 within +-15360 and 0..30600), then madd by 256 and by 1.
// - 16 bits, Q8_0: the weights are widened to int16 and multiplied with madd (lanes hold pairs, so
//   lane i is block (i / 2) % c).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "helper_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TOKENMILL_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_INT8_AVX2 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetchRows = 4;  // rows ahead; 4 measured best of 0, 2, 4, 8, 16 (one core, cold weights)

// The chunk sizes (blocks) of a row of `num_blocks` blocks, in order: 4, ..., 4, then 2 and/or 1.
inline int chunk_blocks(int64_t num_blocks, int64_t first_block) {
  const int64_t left = num_blocks - first_block;
  return left >= 4 ? 4 : (left >= 2 ? 2 : 1);
}

// One activation row, quantized: int8 values in sequence order, per-block scales and float sums,
// and (for Q8_0) per chunk the int32 lanes' -128 * sum(q) corrections.
struct QuantizedRow {
  std::vector<int8_t> q;      // 8-bit activations, or
  std::vector<int16_t> q16;   // 16-bit ones
  std::vector<float> scale;   // d_x per block
  std::vector<float> sum;     // exact float sum of x per block
  std::vector<int32_t> corr;  // per chunk, 4c lanes: -128 * the lane's sum of q (Q8_0 only)
  std::vector<int8_t> hi;     // AVX2, 16 bits, Q4_1: q16 = 256 hi + lo, in sequence order
  std::vector<uint8_t> lo;
};

void quantize_row(const float* x, int64_t num_blocks, bool want_corr, int bits, QuantizedRow& out) {
  const float levels = bits == 16 ? 32767.f : 127.f;
  if (bits == 16) {
    out.q16.assign(num_blocks * kBlock, 0);
    want_corr = false;  // the 16-bit kernel widens the weights and subtracts Q8_0's 128 itself
  } else {
    out.q.assign(num_blocks * kBlock, 0);
  }
  out.scale.assign(num_blocks, 0.f);
  out.sum.assign(num_blocks, 0.f);
  out.corr.assign(want_corr ? num_blocks * 4 : 0, 0);  // 4c lanes for a chunk of c blocks
  std::vector<float> inverse(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, s = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      s += xb[j];
    }
    out.sum[b] = s;
    if (!std::isfinite(s)) {
      // A NaN / inf activation must reach the output, as in the float kernel (the sampler
      // refuses non-finite logits): a NaN scale does that; the quants are then irrelevant.
      out.scale[b] = std::numeric_limits<float>::quiet_NaN();
      inverse[b] = 0.f;
      continue;
    }
    out.scale[b] = amax / levels;
    inverse[b] = amax > 0.f ? levels / amax : 0.f;
  }
  int64_t corr_at = 0;
  for (int64_t b0 = 0; b0 < num_blocks;) {
    const int c = chunk_blocks(num_blocks, b0);
    for (int s = 0; s < 32 * c; ++s) {
      const int g = s / 4, block = g % c, idx = (g / c) * 4 + s % 4;
      const float v = x[(b0 + block) * kBlock + idx] * inverse[b0 + block];
      const int qv = static_cast<int>(std::lrintf(std::min(levels, std::max(-levels, v))));
      if (bits == 16) {
        out.q16[b0 * kBlock + s] = static_cast<int16_t>(qv);
        continue;
      }
      out.q[b0 * kBlock + s] = static_cast<int8_t>(qv);
      if (want_corr) out.corr[corr_at + (s % (16 * c)) / 4] -= 128 * qv;
    }
    corr_at += 4 * c;
    b0 += c;
  }
}


#if defined(TOKENMILL_VNNI)
// Q4_1's offsets: sum over blocks of the weight block's m (fp16, after the scales) x the exact
// float sum of the activations in that block (both dot products add it).
inline float q4_offsets(const uint16_t* m_w, int64_t num_blocks, const QuantizedRow& xq) {
  __m512 offsets = _mm512_setzero_ps();
  for (int64_t i = 0; i < num_blocks; i += 16) {
    const __mmask16 mask = num_blocks - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (num_blocks - i)) - 1);
    const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_w + i));
    offsets = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, xq.sum.data() + i), offsets);
  }
  return _mm512_reduce_add_ps(offsets);
}

// One output: weight row `row` (vnni layout) . the quantized activation row.
template <bool Q4>
float dot_row(const uint8_t* row, int64_t num_blocks, const QuantizedRow& xq) {
  const int64_t quant_bytes = num_blocks * (Q4 ? 16 : 32);
  const uint16_t* d_w = reinterpret_cast<const uint16_t*>(row + quant_bytes);
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  __m512 acc = _mm512_setzero_ps();
  __m256 acc2 = _mm256_setzero_ps();
  __m128 acc1 = _mm_setzero_ps();
  const uint8_t* w = row;
  const int8_t* q = xq.q.data();
  const int32_t* corr = xq.corr.data();
  int64_t b = 0;
  for (; b + 4 <= num_blocks; b += 4) {
    __m512i isum;
    if (Q4) {
      const __m512i packed = _mm512_loadu_si512(w);
      isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(packed, low_mask), _mm512_loadu_si512(q));
      isum = _mm512_dpbusd_epi32(isum, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask),
                                 _mm512_loadu_si512(q + 64));
      w += 64;
    } else {
      isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(corr), _mm512_loadu_si512(w), _mm512_loadu_si512(q));
      isum = _mm512_dpbusd_epi32(isum, _mm512_loadu_si512(w + 64), _mm512_loadu_si512(q + 64));
      w += 128;
      corr += 16;
    }
    const __m128 s4 = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d_w + b))),
                                 _mm_loadu_ps(xq.scale.data() + b));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_broadcast_f32x4(s4), acc);
    q += 128;
  }
  if (b + 2 <= num_blocks) {
    __m256i isum;
    if (Q4) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i mask = _mm256_set1_epi8(0x0F);
      isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(packed, mask),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      isum = _mm256_dpbusd_epi32(isum, _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
      w += 32;
    } else {
      isum = _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      isum = _mm256_dpbusd_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
      w += 64;
      corr += 8;
    }
    float s2[2];
    int32_t d_pair;
    std::memcpy(&d_pair, d_w + b, 4);
    const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(d_pair));
    s2[0] = _mm_cvtss_f32(d2) * xq.scale[b];
    s2[1] = _mm_cvtss_f32(_mm_shuffle_ps(d2, d2, 1)) * xq.scale[b + 1];
    const __m256 scale = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(s2)));
    acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc2);
    q += 64;
    b += 2;
  }
  if (b < num_blocks) {
    __m128i isum;
    if (Q4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
      const __m128i mask = _mm_set1_epi8(0x0F);
      isum = _mm_dpbusd_epi32(_mm_setzero_si128(), _mm_and_si128(packed, mask),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      isum = _mm_dpbusd_epi32(isum, _mm_and_si128(_mm_srli_epi16(packed, 4), mask),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    } else {
      isum = _mm_dpbusd_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(corr)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      isum = _mm_dpbusd_epi32(isum, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    }
    const float d1 = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_w[b]))) * xq.scale[b];
    acc1 = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_set1_ps(d1), acc1);
  }
  float total = _mm512_reduce_add_ps(acc);
  {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc2), _mm256_extractf128_ps(acc2, 1));
    t = _mm_add_ps(t, acc1);
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    total += _mm_cvtss_f32(t);
  }
  if (Q4) total += q4_offsets(d_w + num_blocks, num_blocks, xq);  // + sum over blocks of m * sum(x)
  return total;
}
#endif

#if defined(TOKENMILL_VNNI)
// The same with 16-bit activations: the weights widened to int16 (Q8_0's 128 subtracted) and
// multiplied with `vpdpwssd` (32 pairs an instruction, half dpbusd's rate), so the activations'
// rounding is 258x finer than with 8 bits: about float32's error, so greedy tokens keep
// transformers' (8 bits flipped near-ties of the default model within 30 tokens).
// Lane i of a 32-element piece sums sequence elements 2i, 2i + 1: block (i / 2) % c.
template <bool Q4>
float dot_row16(const uint8_t* row, int64_t num_blocks, const QuantizedRow& xq) {
  const int64_t quant_bytes = num_blocks * (Q4 ? 16 : 32);
  const uint16_t* d_w = reinterpret_cast<const uint16_t*>(row + quant_bytes);
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i offset = _mm512_set1_epi16(Q4 ? 0 : 128);
  const __m512i by_pair4 = _mm512_set_epi32(3, 3, 2, 2, 1, 1, 0, 0, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i by_pair2 = _mm512_set_epi32(1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0);
  __m512 acc = _mm512_setzero_ps();
  const uint8_t* w = row;
  const int16_t* q = xq.q16.data();
  const float* scale = xq.scale.data();
  auto piece = [&](__m512i isum, __m256i bytes, const int16_t* xs) {
    __m512i w16 = _mm512_cvtepu8_epi16(bytes);
    if (!Q4) w16 = _mm512_sub_epi16(w16, offset);
    return _mm512_dpwssd_epi32(isum, w16, _mm512_loadu_si512(xs));
  };
  int64_t b = 0;
  for (; b + 4 <= num_blocks; b += 4) {
    __m512i isum = _mm512_setzero_si512();
    if (Q4) {
      const __m512i packed = _mm512_loadu_si512(w);
      const __m512i lo = _mm512_and_si512(packed, low_mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
      isum = piece(isum, _mm512_castsi512_si256(lo), q);
      isum = piece(isum, _mm512_extracti64x4_epi64(lo, 1), q + 32);
      isum = piece(isum, _mm512_castsi512_si256(hi), q + 64);
      isum = piece(isum, _mm512_extracti64x4_epi64(hi, 1), q + 96);
      w += 64;
    } else {
      for (int p = 0; p < 4; ++p) {
        isum = piece(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * p)), q + 32 * p);
      }
      w += 128;
    }
    const __m128 s4 = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d_w + b))),
                                 _mm_loadu_ps(scale + b));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(by_pair4, _mm512_castps128_ps512(s4)), acc);
    q += 128;
  }
  if (b + 2 <= num_blocks) {
    __m512i isum = _mm512_setzero_si512();
    if (Q4) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i mask = _mm256_set1_epi8(0x0F);
      isum = piece(isum, _mm256_and_si256(packed, mask), q);
      isum = piece(isum, _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask), q + 32);
      w += 32;
    } else {
      isum = piece(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), q);
      isum = piece(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)), q + 32);
      w += 64;
    }
    int32_t d_pair;
    std::memcpy(&d_pair, d_w + b, 4);
    const __m128 s2 = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d_pair)),
                                 _mm_setr_ps(scale[b], scale[b + 1], 0.f, 0.f));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_permutexvar_ps(by_pair2, _mm512_castps128_ps512(s2)), acc);
    q += 64;
    b += 2;
  }
  if (b < num_blocks) {
    __m256i bytes;
    if (Q4) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
      const __m128i mask = _mm_set1_epi8(0x0F);
      bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
    } else {
      bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    }
    const __m512i isum = piece(_mm512_setzero_si512(), bytes, q);
    const float d1 = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d_w[b]))) * scale[b];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d1), acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  if (Q4) total += q4_offsets(d_w + num_blocks, num_blocks, xq);
  return total;
}
#endif  // TOKENMILL_VNNI

#if defined(TOKENMILL_INT8_AVX2)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// d_w * d_x of the C (1, 2 or 4) blocks from `b`, in lanes 0..C-1 of a __m128.
template <int C>
inline __m128 chunk_scales(const uint16_t* d_w, const float* scale, int64_t b) {
  if (C == 4) {
    return _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d_w + b))),
                      _mm_loadu_ps(scale + b));
  }
  if (C == 2) {
    int32_t d_pair;
    std::memcpy(&d_pair, d_w + b, 4);
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d_pair)), _mm_setr_ps(scale[b], scale[b + 1], 0.f, 0.f));
  }
  return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d_w[b])), _mm_set1_ps(scale[b]));
}

// The scales of the 8 int32 lanes of a chunk of C blocks: lane i sums sequence group i (block
// i % C), or for 16-bit Q8_0 (kByPair) sequence elements 2i, 2i + 1 of a 16-element piece
// (block (i / 2) % C).
template <int C, bool kByPair>
inline __m256 lane_scales(__m128 s) {
  const __m256 wide = _mm256_castps128_ps256(s);
  if (C == 1) return _mm256_permutevar8x32_ps(wide, _mm256_setzero_si256());
  if (kByPair) {
    return _mm256_permutevar8x32_ps(wide, C == 4 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                                 : _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1));
  }
  return C == 4 ? _mm256_insertf128_ps(wide, s, 1) : _mm256_permutevar8x32_ps(wide, _mm256_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1));
}

// The C pieces of 32 sequence weights (unsigned 0..15) of a Q4_1 chunk of C blocks at `w`.
template <int C>
inline void q4_pieces(const uint8_t* w, __m256i* piece) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  if (C == 4) {
    const __m256i a = load256(w), b = load256(w + 32);
    piece[0] = _mm256_and_si256(a, mask);
    piece[1] = _mm256_and_si256(b, mask);
    piece[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), mask);
    piece[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  } else if (C == 2) {
    const __m256i a = load256(w);
    piece[0] = _mm256_and_si256(a, mask);
    piece[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), mask);
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i m = _mm_set1_epi8(0x0F);
    piece[0] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(a, 4), m), _mm_and_si128(a, m));
  }
}

// The activations of one quantized row, as the AVX2 kernel reads them (sequence order).
struct ActivationView {
  const int8_t* q;     // 8 bits
  const int16_t* q16;  // 16 bits, Q8_0
  const int8_t* hi;    // 16 bits, Q4_1: q16 = 256 hi + lo
  const uint8_t* lo;
};

// One chunk of C blocks: its weights at `w`, its activations from sequence index `at`. Returns
// the 8 int32 lanes (see lane_scales for which block each lane belongs to).
template <bool Q4, int Bits, int C>
inline __m256i chunk_dot(const uint8_t* w, const ActivationView& x, int64_t at) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (Q4) {
    __m256i piece[C];
    q4_pieces<C>(w, piece);
    if (Bits == 8) {
      __m256i sum16 = _mm256_maddubs_epi16(piece[0], load256(x.q + at));
      for (int p = 1; p < C; ++p) sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(piece[p], load256(x.q + at + 32 * p)));
      return _mm256_madd_epi16(sum16, ones);
    }
    __m256i high = _mm256_maddubs_epi16(piece[0], load256(x.hi + at));
    __m256i low = _mm256_maddubs_epi16(load256(x.lo + at), piece[0]);
    for (int p = 1; p < C; ++p) {
      high = _mm256_add_epi16(high, _mm256_maddubs_epi16(piece[p], load256(x.hi + at + 32 * p)));
      low = _mm256_add_epi16(low, _mm256_maddubs_epi16(load256(x.lo + at + 32 * p), piece[p]));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(high, _mm256_set1_epi16(256)), _mm256_madd_epi16(low, ones));
  }
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256i sum32 = _mm256_setzero_si256();
  for (int p = 0; p < C; ++p) {
    const __m256i qw = _mm256_xor_si256(load256(w + 32 * p), flip);  // q + 128 -> q (signed)
    if (Bits == 8) {
      const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(qw), _mm256_sign_epi8(load256(x.q + at + 32 * p), qw));
      sum32 = _mm256_add_epi32(sum32, _mm256_madd_epi16(prod, ones));
    } else {
      const __m256i w_lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(qw));
      const __m256i w_hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(qw, 1));
      sum32 = _mm256_add_epi32(sum32, _mm256_madd_epi16(w_lo, load256(x.q16 + at + 32 * p)));
      sum32 = _mm256_add_epi32(sum32, _mm256_madd_epi16(w_hi, load256(x.q16 + at + 32 * p + 16)));
    }
  }
  return sum32;
}

// quantize_row's numbers, vectorized (one block of 32 in 4 registers; the scalar loop's index
// arithmetic cost ~3.5 us at K = 576, more than a small matmul's blocks): per block d_x = max|x| /
// levels, q = round-to-nearest-even(clamp(x * levels / max|x|)) in natural order, then each 4-value
// group copied to its sequence position. For 16-bit Q4_1 also the high / low bytes
// (q16 = 256 hi + lo, lo unsigned), which is all that kernel reads.
void quantize_row_avx2(const float* x, int64_t num_blocks, int bits, bool q4, QuantizedRow& out) {
  const float levels = bits == 16 ? 32767.f : 127.f;
  const int64_t k = num_blocks * kBlock;
  const bool split = bits == 16 && q4;
  std::vector<int16_t> natural16(bits == 16 && !split ? k : 0);
  std::vector<int8_t> natural8(bits == 8 || split ? k : 0);  // the values, or (split) their high bytes
  std::vector<uint8_t> natural_lo(split ? k : 0);
  out.scale.resize(num_blocks);
  out.sum.resize(num_blocks);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 high = _mm256_set1_ps(levels), low = _mm256_set1_ps(-levels);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    const float block_max = _mm_cvtss_f32(m4), block_sum = _mm_cvtss_f32(s4);
    out.sum[b] = block_sum;
    float inverse;
    if (!std::isfinite(block_sum)) {  // as in quantize_row: a NaN scale carries it to the output
      out.scale[b] = std::numeric_limits<float>::quiet_NaN();
      inverse = 0.f;
    } else {
      out.scale[b] = block_max / levels;
      inverse = block_max > 0.f ? levels / block_max : 0.f;
    }
    const __m256 inv = _mm256_set1_ps(inverse);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      // max first: a NaN product (x inf or NaN, inverse 0) becomes -levels, as std::max makes it.
      const __m256 clamped = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], inv), low), high);
      q[i] = _mm256_cvtps_epi32(clamped);  // round to nearest even, as lrintf
    }
    // packs interleaves 128-bit lanes; the permutes put the values back in order.
    const __m256i q01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i q23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    if (split) {  // high bytes: v >> 8 (arithmetic: floor(v / 256)), packed signed; low: v & 255
      const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(q01, 8), _mm256_srai_epi16(q23, 8));
      const __m256i byte = _mm256_set1_epi16(0xFF);
      const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(q01, byte), _mm256_and_si256(q23, byte));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural8.data() + b * kBlock), _mm256_permute4x64_epi64(hi, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural_lo.data() + b * kBlock), _mm256_permute4x64_epi64(lo, 0xD8));
    } else if (bits == 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural16.data() + b * kBlock), q01);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural16.data() + b * kBlock + 16), q23);
    } else {
      const __m256i q8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(q01, q23), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural8.data() + b * kBlock), q8);
    }
  }
  // Sequence order: group g of a chunk of c blocks is block g % c, values 4 (g / c) .. + 3.
  if (bits == 8) out.q.resize(k);
  if (bits == 16 && !split) out.q16.resize(k);
  if (split) {
    out.hi.resize(k);
    out.lo.resize(k);
  }
  for (int64_t b0 = 0; b0 < num_blocks;) {
    const int c = chunk_blocks(num_blocks, b0);
    for (int g = 0; g < 8 * c; ++g) {
      const int64_t from = (b0 + g % c) * kBlock + (g / c) * 4, to = b0 * kBlock + 4 * g;
      if (bits == 8) {
        std::memcpy(out.q.data() + to, natural8.data() + from, 4);
      } else if (!split) {
        std::memcpy(out.q16.data() + to, natural16.data() + from, 8);
      } else {
        std::memcpy(out.hi.data() + to, natural8.data() + from, 4);
        std::memcpy(out.lo.data() + to, natural_lo.data() + from, 4);
      }
    }
    b0 += c;
  }
}

// acc[r] += the chunk of C blocks from block `b` of weight rows 0..R-1 (scaled, as float lanes).
template <bool Q4, int Bits, int C, int R>
inline void chunk_rows(const uint8_t* const* quants, const uint16_t* const* d_w, const ActivationView& x,
                       const float* scale, int64_t b, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    // (The chunks before block b hold 16 (Q4_1) or 32 (Q8_0) bytes a block.)
    const __m256i isum = chunk_dot<Q4, Bits, C>(quants[r] + b * (Q4 ? 16 : 32), x, b * kBlock);
    const __m256 s = lane_scales<C, !Q4 && Bits == 16>(chunk_scales<C>(d_w[r], scale, b));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[r]);
  }
}

// R (1 or 4) consecutive outputs: weight rows row0 .. row0 + R - 1 (vnni layout, `row_bytes`
// apart) . one quantized activation row -> y[0 .. R - 1]. Four rows a pass share the activation
// loads and one reduction: with K = 576 (18 blocks) a row is short, and one row at a time spent
// more on its fixed costs (the reduction, the Q4_1 offsets) than on its blocks.
template <bool Q4, int Bits, int R>
void dot_rows_avx2(const uint8_t* row0, int64_t row_bytes, int64_t num_blocks, const QuantizedRow& xq, float* y) {
  const int64_t quant_bytes = num_blocks * (Q4 ? 16 : 32);
  const uint8_t* quants[R];
  const uint16_t* d_w[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    quants[r] = row0 + r * row_bytes;
    d_w[r] = reinterpret_cast<const uint16_t*>(quants[r] + quant_bytes);
    acc[r] = _mm256_setzero_ps();
  }
  const ActivationView x{xq.q.data(), xq.q16.data(), xq.hi.data(), xq.lo.data()};
  const float* scale = xq.scale.data();
  int64_t b = 0;
  for (; b + 4 <= num_blocks; b += 4) chunk_rows<Q4, Bits, 4, R>(quants, d_w, x, scale, b, acc);
  if (b + 2 <= num_blocks) {
    chunk_rows<Q4, Bits, 2, R>(quants, d_w, x, scale, b, acc);
    b += 2;
  }
  if (b < num_blocks) chunk_rows<Q4, Bits, 1, R>(quants, d_w, x, scale, b, acc);
  float tail[R] = {};
  if (Q4) {  // + sum over blocks of m * sum(x): 8 blocks at a time into the same lanes, then the rest
    int64_t i = 0;
    for (; i + 8 <= num_blocks; i += 8) {
      const __m256 sums = _mm256_loadu_ps(xq.sum.data() + i);
      for (int r = 0; r < R; ++r) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_w[r] + num_blocks + i)));
        acc[r] = _mm256_fmadd_ps(m, sums, acc[r]);
      }
    }
    for (; i < num_blocks; ++i) {
      for (int r = 0; r < R; ++r) tail[r] += _cvtsh_ss(d_w[r][num_blocks + i]) * xq.sum[i];
    }
  }
  // One reduction order for both widths, ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) + tail,
  // so a row's bits do not depend on whether a row range split put it in a pass of 4 or of 1
  // (OpenMP's split and the helper's chunks differ).
  if (R == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(y, _mm_add_ps(t, _mm_loadu_ps(tail)));
  } else {
    for (int r = 0; r < R; ++r) {
      const __m256 pairs = _mm256_hadd_ps(acc[r], acc[r]);
      const __m256 h = _mm256_hadd_ps(pairs, pairs);
      const __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      y[r] = _mm_cvtss_f32(_mm_add_ss(t, _mm_set_ss(tail[r])));
    }
  }
}

// Outputs [begin, end) of every activation row: 4 weight rows a pass (then 1), each pass
// prefetching the weight rows kPrefetchRows ahead (as the VNNI loop does).
template <bool Q4, int Bits>
void dot_range_avx2(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, const std::vector<QuantizedRow>& rows,
                    int64_t begin, int64_t end, float* y, int64_t n) {
  for (int64_t row = begin; row < end;) {
    const int step = row + 4 <= end ? 4 : 1;
    if (row + step + kPrefetchRows <= end) {
      const uint8_t* ahead = w + (row + kPrefetchRows) * row_bytes;
      for (int64_t line = 0; line < step * row_bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
      }
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      if (step == 4) {
        dot_rows_avx2<Q4, Bits, 4>(w + row * row_bytes, row_bytes, num_blocks, rows[r], y + r * n + row);
      } else {
        dot_rows_avx2<Q4, Bits, 1>(w + row * row_bytes, row_bytes, num_blocks, rows[r], y + r * n + row);
      }
    }
    row += step;
  }
}
#endif  // TOKENMILL_INT8_AVX2

// fn(begin, end) over row ranges covering [0, n) (`work` multiply-adds in all): with the helper
// thread (a small machine, helper_pool.h), chunks of ~1/32 of the rows (at least 64, a multiple of the 4-row pass) shared by
// the caller and the helper; else at::parallel_for's.
template <typename F>
void for_row_ranges(int64_t n, int64_t work, const F& fn) {
  if (!tokenmill_cpu::use_helper_pool(work)) {
    at::parallel_for(0, n, 64, fn);
    return;
  }
  const int64_t rows = std::max<int64_t>(64, (n / 32 + 3) / 4 * 4);
  tokenmill_cpu::parallel_chunks((n + rows - 1) / rows, [&](int64_t c) { fn(c * rows, std::min(n, (c + 1) * rows)); });
}

// out [M, N] float32 = x [M, K] float32 (int8-quantized per block of 32) @ dequant(blocks)^T, with
// `blocks` [N, row_bytes] uint8 in the vnni layout above; quant_type 0 = Q4_1, 1 = Q8_0.
void quant_gemv_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type,
                     int64_t bits) {
#if defined(TOKENMILL_VNNI) || defined(TOKENMILL_INT8_AVX2)
  TORCH_CHECK(quant_type == 0 || quant_type == 1,
              "quant_gemv_int8: quant_type must be 0 (Q4_1) or 1 (Q8_0), got ", quant_type);
  TORCH_CHECK(bits == 8 || bits == 16, "quant_gemv_int8: bits (of the activations) must be 8 or 16, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_gemv_int8: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "quant_gemv_int8: out must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "quant_gemv_int8: blocks must be a contiguous uint8 [N, row_bytes] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t block_bytes = quant_type == 0 ? 20 : 34;
  TORCH_CHECK(k % kBlock == 0, "quant_gemv_int8: K (", k, ") must be a multiple of 32");
  const int64_t num_blocks = k / kBlock;
  TORCH_CHECK(blocks.size(1) == num_blocks * block_bytes, "quant_gemv_int8: blocks have ", blocks.size(1),
              " bytes a row; K = ", k, " needs ", num_blocks * block_bytes);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_gemv_int8: out must be [", m, ", ", n, "]");
  const bool q4 = quant_type == 0;
  std::vector<QuantizedRow> rows(m);
#if defined(TOKENMILL_VNNI)
  for (int64_t r = 0; r < m; ++r) quantize_row(x.data_ptr<float>() + r * k, num_blocks, !q4, static_cast<int>(bits), rows[r]);
#else
  // (No +128 correction for Q8_0: the AVX2 kernel flips the stored q + 128 back to q.)
  for (int64_t r = 0; r < m; ++r) quantize_row_avx2(x.data_ptr<float>() + r * k, num_blocks, static_cast<int>(bits), q4, rows[r]);
#endif
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
#if defined(TOKENMILL_INT8_AVX2)
  const int64_t row_bytes = num_blocks * block_bytes;
  for_row_ranges(n, m * n * k, [&](int64_t begin, int64_t end) {
    if (bits == 16) {
      q4 ? dot_range_avx2<true, 16>(w, row_bytes, num_blocks, rows, begin, end, y, n)
         : dot_range_avx2<false, 16>(w, row_bytes, num_blocks, rows, begin, end, y, n);
    } else {
      q4 ? dot_range_avx2<true, 8>(w, row_bytes, num_blocks, rows, begin, end, y, n)
         : dot_range_avx2<false, 8>(w, row_bytes, num_blocks, rows, begin, end, y, n);
    }
  });
#else
  for_row_ranges(n, m * n * k, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* wrow = w + row * num_blocks * block_bytes;
      if (kPrefetchRows > 0 && row + kPrefetchRows < end) {
        // One core streams the weights (tens of MB a step, never cached): asking for the rows a few
        // ahead keeps more loads in flight than the hardware prefetcher alone.
        const uint8_t* ahead = wrow + kPrefetchRows * num_blocks * block_bytes;
        for (int64_t line = 0; line < num_blocks * block_bytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        if (bits == 16) {
          y[r * n + row] = q4 ? dot_row16<true>(wrow, num_blocks, rows[r]) : dot_row16<false>(wrow, num_blocks, rows[r]);
        } else {
          y[r * n + row] = q4 ? dot_row<true>(wrow, num_blocks, rows[r]) : dot_row<false>(wrow, num_blocks, rows[r]);
        }
      }
    }
  });
#endif
#else
  TORCH_CHECK(false, "quant_gemv_int8: this build has neither AVX-512 VNNI nor AVX2 (check quant_gemv_int8_available() first)");
#endif
}

// quant_gemv_int8 into a new [M, N] float32 tensor. The decode step calls this ~120 times (one
// row): allocating the output here costs a fraction of a microsecond against a few for a
// torch.empty called from Python before each product.
at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "quant_linear_int8: x [M, K] and blocks [N, row_bytes] expected");
  at::Tensor out = at::empty({x.size(0), blocks.size(0)}, x.options().dtype(at::kFloat));
  quant_gemv_int8(out, x, blocks, quant_type, bits);
  return out;
}

// Whether this build (-march=native) has the kernel (VNNI or AVX2); without it the float kernel serves.
bool quant_gemv_int8_available() {
#if defined(TOKENMILL_VNNI) || defined(TOKENMILL_INT8_AVX2)
  return true;
#else
  return false;
#endif
}

// Which instructions this build's kernel uses: "avx512_vnni", "avx2" or "" (none).
std::string quant_gemv_int8_isa() {
#if defined(TOKENMILL_VNNI)
  return "avx512_vnni";
#elif defined(TOKENMILL_INT8_AVX2)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quant_gemv_int8(Tensor(a!) out, Tensor x, Tensor blocks, int quant_type, int bits) -> ()");
  m.def("quant_linear_int8(Tensor x, Tensor blocks, int quant_type, int bits) -> Tensor");
  m.def("quant_gemv_int8_available() -> bool", &quant_gemv_int8_available);
  m.def("quant_gemv_int8_isa() -> str", &quant_gemv_int8_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("quant_gemv_int8", &quant_gemv_int8);
  m.impl("quant_linear_int8", &quant_linear_int8);
}
