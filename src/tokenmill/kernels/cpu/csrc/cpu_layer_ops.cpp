// The decoder's small per-layer ops on the CPU, for float32 decode rows: the residual add and
// RMSNorm in one call, RoPE in one call, silu(gate) * up in one call. At one row PyTorch's F.rms_norm costs ~20 us (pow, mean, rsqrt, two
// multiplies, each an op dispatch and a temporary), 61 calls a step for SmolLM2-135M; this is ~1 us.
//
// Numerics: x += pending (float32), then x * (1 / sqrt(mean(x^2) + eps)) * weight, as F.rms_norm
// computes in float32; only the summation order of mean(x^2) differs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "avx2_exp.h"

#include <cmath>
#include <cstdint>
#include <optional>

namespace {


at::Tensor add_rms_norm(at::Tensor& x, const std::optional<at::Tensor>& pending,
                        const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "add_rms_norm: x must be a contiguous float32 [T, hidden] tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (pending.has_value()) {
    TORCH_CHECK(pending->sizes() == x.sizes() && pending->scalar_type() == at::kFloat && pending->is_contiguous(),
                "add_rms_norm: pending must be a contiguous float32 tensor shaped like x ", x.sizes());
  }
  if (weight.has_value()) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == hidden && weight->scalar_type() == at::kFloat &&
                    weight->is_contiguous(),
                "add_rms_norm: weight must be a contiguous float32 [", hidden, "] tensor");
  }
  at::Tensor out = at::empty({rows, hidden}, x.options());
  float* xs = x.data_ptr<float>();
  const float* ps = pending.has_value() ? pending->data_ptr<float>() : nullptr;
  const float* ws = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = xs + r * hidden;
    float* yr = ys + r * hidden;
    float squares = 0.f;
    if (ps != nullptr) {
      const float* pr = ps + r * hidden;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) {
        xr[i] += pr[i];
        squares += xr[i] * xr[i];
      }
    } else {
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += xr[i] * xr[i];
    }
    const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
    if (ws != nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv_rms * ws[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) yr[i] = xr[i] * inv_rms;
    }
  }
  return out;
}

// RoPE (rotate-half form) of x [T, heads, head_dim] (any strides but a contiguous last dim: q and k
// are views of the qkv projection) into a new contiguous tensor: out = x * cos + roll(x, half) *
// signed_sin, with cos / signed_sin [T, 1, head_dim] float32 (layers/rotary.apply_rotary's
// arithmetic, one call instead of mul, roll (slices and a cat) and addcmul).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "rotate: x must be a float32 [T, heads, head_dim] tensor with a contiguous last dim");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "rotate: head_dim must be even, got ", dim);
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == 1 && t->size(2) == dim &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                "rotate: cos and signed_sin must be contiguous float32 [", tokens, ", 1, ", dim, "] tensors");
  }
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const float* xs = x.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos.data_ptr<float>() + t * dim;
    const float* s = signed_sin.data_ptr<float>() + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = xs + t * x.stride(0) + h * x.stride(1);
      float* yr = ys + (t * heads + h) * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) yr[i] = xr[i] * c[i] + xr[i + half] * s[i];
#pragma omp simd
      for (int64_t i = half; i < dim; ++i) yr[i] = xr[i] * c[i] + xr[i - half] * s[i];
    }
  }
  return out;
}

// silu(gate) * up for gate_up [T, 2 * intermediate] float32 (gate columns first) into a new
// [T, intermediate] tensor: one call instead of silu_ and mul (TorchLayerOps.silu_mul).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous float32 [T, 2 * intermediate] tensor");
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({tokens, inter}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Rows across the threads (a 64-row decode step's 64 x 1536 took ~140 us on one); 8 rows at
  // least a chunk, so a few-row step stays on the calling thread. Same arithmetic per element.
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gt = g + t * 2 * inter;
      float* yt = y + t * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 g8 = _mm256_loadu_ps(gt + i);
        const __m256 e = tokenmill_cpu::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g8));
        _mm256_storeu_ps(yt + i,
                         _mm256_mul_ps(_mm256_div_ps(g8, _mm256_add_ps(one, e)), _mm256_loadu_ps(gt + inter + i)));
      }
#endif
      for (; i < inter; ++i) yt[i] = gt[i] / (1.f + std::exp(-gt[i])) * gt[inter + i];
    }
  });
  return out;
}

// Greedy sampling's argmax over each row of float32 logits, as torch.argmax(dim=-1): the first
// index of the largest value, or of the first NaN where a row has one (torch orders NaN above
// every number). torch's CPU argmax over 64 x 49152 logits took ~1.3-2.9 ms a decode step (its
// reduction is not vectorized for an index); this reads the row at memory speed, rows across the
// threads.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_index = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best_v = _mm512_loadu_ps(x);
    __m512i index_v = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i at = index_v;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best_v, best_v, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      at = _mm512_add_epi32(at, sixteen);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ);  // strictly: lanes keep their first
      best_v = _mm512_mask_mov_ps(best_v, greater, v);
      index_v = _mm512_mask_mov_epi32(index_v, greater, at);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) {
      for (int64_t j = 0; j < n; ++j) {
        if (std::isnan(x[j])) return j;
      }
    }
    best = _mm512_reduce_max_ps(best_v);
    // The smallest index among the lanes holding the maximum: the first occurrence.
    const __mmask16 top = _mm512_cmp_ps_mask(best_v, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_index = _mm512_mask_reduce_min_epi32(top, index_v);
  } else {
    i = 1;
  }
#else
  i = 1;
#endif
  for (; i < n; ++i) {  // the tail (larger indices than any above: only a strictly larger value wins)
    if (std::isnan(x[i])) {
      if (!std::isnan(best)) best_index = i;
      return best_index;
    }
    if (std::isnan(best)) return best_index;
    if (x[i] > best) {
      best = x[i];
      best_index = i;
    }
  }
  return best_index;
}

// logits [R, V] float32 -> [R] int64.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: logits must be a contiguous float32 [R, V] tensor with V > 0, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* y = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) y[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? pending, Tensor? weight, float eps) -> Tensor");
  m.def("rotate(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotate", &rotate);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
}
