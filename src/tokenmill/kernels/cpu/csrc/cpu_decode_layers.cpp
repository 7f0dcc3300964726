// A decode step's decoder layers in one call: for each layer the same ops, in the same order, as
// the Python layer loop runs them on the CPU (model/llama.py DecoderLayer.forward with the C++
// layer ops, GGUF-block products and the C++ attention backend), called through the dispatcher
// from here instead of from Python.
//
// Why: at one decode row the default model's (SmolLM2-135M, 30 layers) step spent ~2.5-3 ms of
// ~12-14 ms in Python between the kernels (module calls, views, the backend's per-call checks:
// ~45 us a layer). Here that is a few microseconds a layer. The arithmetic is the ops' own, so the
// outputs are bit-identical to the layer loop's (tests/engine/test_cpu_decode_layers.py).
//
// Per layer (tensors in the lists by layer: norms [input, post], weights [qkv, o, gate_up, down]):
//   normed = add_rms_norm(x += pending, input_norm)
//   qkv = product(normed, qkv) (+= its bias, Qwen2's);  qk = rotate(qkv's q and k columns);  store_kv(k, v)
//   attn = paged_attention(q)
//   normed = add_rms_norm(x += product(attn, o), post_norm)
//   pending = product(silu_mul(product(normed, gate_up)), down)
// and the last layer's `pending` is returned (the caller adds it inside the final norm).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops this calls, resolved once (the library registers them before any call can reach here).
struct LayerOps {
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                      double)>
      add_rms_norm = op<at::Tensor(at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                   double)>("tokenmill_cpu::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rotate =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>("tokenmill_cpu::rotate");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      op<at::Tensor(const at::Tensor&)>("tokenmill_cpu::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)> linear_int8 =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>("tokenmill_cpu::quant_linear_int8");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)> linear_vnni16 =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("tokenmill_cpu::quant_linear_vnni16");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)> store_kv =
      op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("tokenmill_cpu::store_kv");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, double,
                                const std::optional<at::Tensor>&)>
      paged_attention =
          op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const at::Tensor&, double, int64_t, int64_t, double, const std::optional<at::Tensor>&)>(
              "tokenmill_cpu::paged_attention");
};

const LayerOps& layer_ops() {
  static const LayerOps ops;
  return ops;
}

at::Tensor decode_layers(at::Tensor& x, const std::optional<at::Tensor>& pending_in, at::TensorList norms,
                         at::TensorList weights, at::IntArrayRef quant_types, at::IntArrayRef activation_bits,
                         at::TensorList qkv_biases, at::TensorList kv_caches, const at::Tensor& cos, const at::Tensor& signed_sin,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         const at::Tensor& block_tables, const at::Tensor& slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double scale, double eps, int64_t kernel_query_len,
                         at::IntArrayRef sliding_windows, int64_t few_rows_limit) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers > 0, "decode_layers: no layers");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * num_layers, "decode_layers: expected 2 norms a layer (",
              2 * num_layers, "), got ", norms.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * num_layers &&
                  static_cast<int64_t>(quant_types.size()) == 4 * num_layers &&
                  static_cast<int64_t>(activation_bits.size()) == 4 * num_layers,
              "decode_layers: expected 4 weights, quant types and activation bits a layer (", 4 * num_layers, ")");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decode_layers: expected no qkv biases or one a layer (", num_layers, "), got ", qkv_biases.size());
  TORCH_CHECK(static_cast<int64_t>(sliding_windows.size()) == num_layers,
              "decode_layers: expected one sliding window (0 = none) a layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_layers: x must be a contiguous float32 [T, hidden] tensor");
  const int64_t rows = x.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const LayerOps& ops = layer_ops();
  // The product the Python path picks for this many rows (kernels/cpu/quant_gemv.quantized_linear):
  // the few-row kernel up to its limit, else the batched 16-bit one.
  const bool few_rows = rows <= few_rows_limit;
  auto product = [&](const at::Tensor& a, int64_t w) {
    return few_rows ? ops.linear_int8.call(a, weights[w], quant_types[w], activation_bits[w])
                    : ops.linear_vnni16.call(a, weights[w], quant_types[w]);
  };
  const std::optional<at::Tensor> no_sinks;
  std::optional<at::Tensor> pending = pending_in;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& kv_cache = kv_caches[l];
    at::Tensor normed = ops.add_rms_norm.call(x, pending, norms[2 * l], eps);
    at::Tensor qkv = product(normed, 4 * l);
    if (!qkv_biases.empty()) qkv.add_(qkv_biases[l]);  // as quant_gemv.quantized_linear's `out += bias`
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: layer ", l, "'s qkv product has ", qkv.size(1),
                " columns, expected ", q_size + 2 * kv_size);
    at::Tensor qk = ops.rotate.call(qkv.narrow(1, 0, q_size + kv_size).view({rows, num_heads + num_kv_heads, head_dim}),
                                    cos, signed_sin);
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
    ops.store_kv.call(kv_cache, qk.narrow(1, num_heads, num_kv_heads), v, slot_mapping);
    // float32 q and output over a 16-bit cache (the kernel converts the cache's rows as it reads).
    at::Tensor attn = at::empty({rows, num_heads, head_dim}, x.options());
    ops.paged_attention.call(attn, qk.narrow(1, 0, num_heads), kv_cache, query_start_loc, seq_lens, block_tables,
                             scale, kernel_query_len, sliding_windows[l], 0.0, no_sinks);
    at::Tensor attn_out = product(attn.view({rows, q_size}), 4 * l + 1);
    normed = ops.add_rms_norm.call(x, attn_out, norms[2 * l + 1], eps);
    pending = product(ops.silu_mul.call(product(normed, 4 * l + 2)), 4 * l + 3);
  }
  return *pending;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) x, Tensor? pending, Tensor[] norms, Tensor[] weights, int[] quant_types, "
      "int[] activation_bits, Tensor[] qkv_biases, Tensor[] kv_caches, Tensor cos, Tensor signed_sin, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, "
      "float scale, float eps, int kernel_query_len, int[] sliding_windows, int few_rows_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
