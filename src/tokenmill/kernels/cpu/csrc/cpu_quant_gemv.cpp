// Matrix-vector products straight from GGUF-quantized weights (Q4_1, Q8_0), for the CPU's
// one-row steps (one request decoding).
//
// A decode step on the CPU reads every matmul weight once; as float32 that is 540 MB a token for
// SmolLM2-135M, and one core streams it at a few GB/s. The same weights as the GGUF's Q4_1 blocks
// are 5.6x smaller. Each block of 32 weights is dequantized in registers and multiplied with the
// float32 activations (no quantization of the activations, so the result is the float32 product of
// the dequantized weights up to summation order).
//
// Blocks (ggml): Q4_1 = {half d, half m, uint8 qs[16]}: weight j = d * q_j + m, with
// q_j = qs[j] & 15 and q_{j+16} = qs[j] >> 4. Q8_0 = {half d, int8 qs[32]}: weight = d * q.
// `blocks` is [N, row_bytes] uint8, one row per output feature, each row split by kind so the
// loads are aligned and the scales convert 8 at a time (kernels/cpu/quant_gemv.split_rows):
// Q4_1 rows = [qs of every block][d of every block][m of every block] (20 bytes a block),
// Q8_0 rows = [qs of every block][d of every block] (34 bytes a block).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;
constexpr int64_t kMaxBlocks = 1024;  // K <= 32768: the per-row scale buffers live on the stack

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// count float16 values at p (unaligned) -> out.
inline void load_halves(const uint8_t* p, int64_t count, float* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
  }
#endif
  for (; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * i, 2);
    out[i] = half_to_float(bits);
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline __m256 bytes_to_ps(__m128i bytes8_unsigned) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8_unsigned));
}
#endif

#if !defined(__AVX512F__)
// (Without AVX-512: one activation row at a time.)
// One output: sum over blocks of d * (q . x) + m * sum(x), with the block sums of x precomputed.
float q4_1_row(const uint8_t* row, const float* x, const float* x_block_sums, int64_t num_blocks) {
  float d[kMaxBlocks], mins[kMaxBlocks];
  load_halves(row + num_blocks * 16, num_blocks, d);
  load_halves(row + num_blocks * 18, num_blocks, mins);
  float offset_sum = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) offset_sum += mins[b] * x_block_sums[b];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
    const __m128i lo = _mm_and_si128(qs, low_mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low_mask);
    __m256 qx = _mm256_mul_ps(bytes_to_ps(lo), _mm256_loadu_ps(xb));
    qx = _mm256_fmadd_ps(bytes_to_ps(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), qx);
    qx = _mm256_fmadd_ps(bytes_to_ps(hi), _mm256_loadu_ps(xb + 16), qx);
    qx = _mm256_fmadd_ps(bytes_to_ps(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), qx);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d[b]), qx, acc);
  }
  return hsum(acc) + offset_sum;
#else
  float total = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* qs = row + b * 16;
    const float* xb = x + b * kBlock;
    float qx = 0.f;
    for (int j = 0; j < 16; ++j) {
      qx += static_cast<float>(qs[j] & 0x0F) * xb[j];
      qx += static_cast<float>(qs[j] >> 4) * xb[j + 16];
    }
    total += d[b] * qx;
  }
  return total + offset_sum;
#endif
}

float q8_0_row(const uint8_t* row, const float* x, int64_t num_blocks) {
  float d[kMaxBlocks];
  load_halves(row + num_blocks * 32, num_blocks, d);
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 qx = _mm256_setzero_ps();
    for (int part = 0; part < 4; ++part) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * 32 + 8 * part));
      qx = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), _mm256_loadu_ps(xb + 8 * part), qx);
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(d[b]), qx, acc);
  }
  return hsum(acc);
#else
  float total = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(row + b * 32);
    const float* xb = x + b * kBlock;
    float qx = 0.f;
    for (int j = 0; j < kBlock; ++j) qx += static_cast<float>(qs[j]) * xb[j];
    total += d[b] * qx;
  }
  return total;
#endif
}
#endif  // !__AVX512F__

#if defined(__AVX512F__)
// R (<= 4) activation rows against one weight row: each block is dequantized and scaled once for
// all R rows, so a few rows cost little more than one (the dequantizing is most of the work).
// Two accumulators a row (low and high halves of each block) keep the multiply-add chains short.
template <int R>
void quant_rows_avx512(const uint8_t* row, int64_t quant_type, const float* x, int64_t k,
                       const float* x_block_sums, int64_t num_blocks, float* y, int64_t n) {
  float d[kMaxBlocks], mins[kMaxBlocks];
  const bool q4 = quant_type == 0;
  load_halves(row + num_blocks * (q4 ? 16 : 32), num_blocks, d);
  if (q4) load_halves(row + num_blocks * 18, num_blocks, mins);
  __m512 acc_lo[R], acc_hi[R];
  for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm512_setzero_ps();
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512 lo, hi;
    if (q4) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
      lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, low_mask)));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), low_mask)));
    } else {
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32))));
      hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 32 + 16))));
    }
    const __m512 scale = _mm512_set1_ps(d[b]);
    lo = _mm512_mul_ps(lo, scale);
    hi = _mm512_mul_ps(hi, scale);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * kBlock;
      acc_lo[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc_hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float offset_sum = 0.f;
    if (q4) {
      for (int64_t b = 0; b < num_blocks; ++b) offset_sum += mins[b] * x_block_sums[r * num_blocks + b];
    }
    y[r * n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[r], acc_hi[r])) + offset_sum;
  }
}
#endif

// out [M, N] float32 = x [M, K] float32 @ dequant(blocks [N, K/32 * block_bytes])^T.
// quant_type: 0 = Q4_1, 1 = Q8_0.
void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t quant_type) {
  TORCH_CHECK(quant_type == 0 || quant_type == 1, "quant_gemv: quant_type must be 0 (Q4_1) or 1 (Q8_0), got ",
              quant_type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "quant_gemv: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "quant_gemv: out must be a contiguous float32 [M, N] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "quant_gemv: blocks must be a contiguous uint8 [N, row_bytes] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t block_bytes = quant_type == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(k % kBlock == 0 && k / kBlock <= kMaxBlocks, "quant_gemv: K (", k,
              ") must be a multiple of 32 and at most ", kMaxBlocks * kBlock);
  const int64_t num_blocks = k / kBlock;
  TORCH_CHECK(blocks.size(1) == num_blocks * block_bytes, "quant_gemv: blocks have ", blocks.size(1),
              " bytes a row; K = ", k, " needs ", num_blocks * block_bytes);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "quant_gemv: out must be [", m, ", ", n, "]");
  const float* x_data = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  std::vector<float> block_sums(quant_type == 0 ? m * num_blocks : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(block_sums.size()); ++i) {
    const float* xb = x_data + (i / num_blocks) * k + (i % num_blocks) * kBlock;
    float s = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) s += xb[j];
    block_sums[i] = s;
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* wrow = w + row * num_blocks * block_bytes;
#if defined(__AVX512F__)
      for (int64_t r = 0; r < m; r += 4) {  // up to 4 activation rows per pass over the weight row
        const float* xr = x_data + r * k;
        const float* sums = block_sums.data() + (quant_type == 0 ? r * num_blocks : 0);
        float* yr = y + r * n + row;
        switch (std::min<int64_t>(4, m - r)) {
          case 1: quant_rows_avx512<1>(wrow, quant_type, xr, k, sums, num_blocks, yr, n); break;
          case 2: quant_rows_avx512<2>(wrow, quant_type, xr, k, sums, num_blocks, yr, n); break;
          case 3: quant_rows_avx512<3>(wrow, quant_type, xr, k, sums, num_blocks, yr, n); break;
          default: quant_rows_avx512<4>(wrow, quant_type, xr, k, sums, num_blocks, yr, n); break;
        }
      }
#else
      for (int64_t r = 0; r < m; ++r) {
        y[r * n + row] = quant_type == 0
                             ? q4_1_row(wrow, x_data + r * k, block_sums.data() + r * num_blocks, num_blocks)
                             : q8_0_row(wrow, x_data + r * k, num_blocks);
      }
#endif
    }
  });
}

// How many activation rows this build serves at the cost of about one: 4 with AVX-512 (a block is
// dequantized once for up to 4 rows), 1 with AVX2, 0 for the scalar fallback, which is slower than
// a float32 matmul, so the caller keeps float32 weights then.
int64_t quant_gemv_rows() {
#if defined(__AVX512F__)
  return 4;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("quant_gemv(Tensor(a!) out, Tensor x, Tensor blocks, int quant_type) -> ()");
  m.def("quant_gemv_rows() -> int", &quant_gemv_rows);
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("quant_gemv", &quant_gemv); }
