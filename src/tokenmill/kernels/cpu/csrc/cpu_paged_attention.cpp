// Paged attention for CPUs: keys and values are read in place from the block pool through each
// request's block table, so no step copies a request's context into a contiguous buffer (the
// torch reference backend's gather, which moved as many bytes per decode step as the weights).
//
// Layout (see attention/backend.py): kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim];
// the batch is flattened, request r owning query rows query_start_loc[r] .. query_start_loc[r+1],
// its query token j at position seq_lens[r] - query_len + j, attending causally to positions <= it.
// Requests whose query is longer than `max_query_len` are skipped (their output rows untouched).
//
// Work is split in tasks of (request, tile of query tokens, KV heads): a task reads each key and
// value row it needs once and uses it for every query head that shares it (GQA). Softmax is
// online (running max and sum) in float32 whatever the cache dtype, as in flash attention.
//
// Per-layer options (attention/backend.py's AttentionLayerSpec): a sliding window (a query at p
// sees keys p - window < k <= p; a task starts at the block holding the first key its earliest
// query row sees, and never reads the blocks before it, which may have been freed and reused),
// a logit soft cap (scores become cap * tanh(scores / cap)), and per-head sink logits that join
// each softmax's denominator and attend to nothing.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "avx2_exp.h"
#include "helper_pool.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Query tokens per task: enough rows to reuse each loaded key/value row, few enough that a
// prefill chunk still splits into many tasks for the threads.
constexpr int64_t kQueryTile = 16;
// Steps of at most this many requests share their tasks with the helper thread one by one
// (helper_pool.h); larger ones in runs of consecutive tasks.
constexpr int64_t kHelperMaxRows = 4;
// Key rows whose scores against one query row are computed together (independent FMA chains).
constexpr int64_t kKeyGroup = 4;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) for x <= 0 (scores minus their running max), vectorizable: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n built
// in the exponent bits. Below -87 the result is 0 (float's smallest normal is exp(-87.3)).
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = (clamped * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = clamped - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.f ? 0.f : p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)));
}
#endif

// out[j] = dot(q, keys[j]) for kKeyGroup key rows `stride` apart: independent accumulators keep
// the FMA units busy instead of waiting on one chain, and q is loaded once for all of them.
inline void dot_keys(const float* q, const float* keys, int64_t stride, int64_t nkeys, int64_t D, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    int64_t j = 0;
    for (; j + kKeyGroup <= nkeys; j += kKeyGroup) {
      const float* k0 = keys + j * stride;
      const float *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
      }
      // Four horizontal sums at once: [a0 a1 a2 a3] -> one __m128.
      const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
      const __m256 h = _mm256_hadd_ps(h01, h23);
      _mm_storeu_ps(out + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
    for (; j < nkeys; ++j) {
      const float* k = keys + j * stride;
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
      out[j] = hsum(a);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < nkeys; ++j) {
    const float* k = keys + j * stride;
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t d = 0; d < D; ++d) a += q[d] * k[d];
    out[j] = a;
  }
}

// acc[0:D] += sum_j p[j] * values[j] over `n` value rows `stride` apart; acc stays in registers
// across the rows, 64 columns at a time.
inline void accumulate_values(float* acc, const float* p, const float* values, int64_t stride, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 64 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m256 c[8];
      for (int i = 0; i < 8; ++i) c[i] = _mm256_loadu_ps(acc + d0 + 8 * i);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* v = values + j * stride + d0;
        for (int i = 0; i < 8; ++i) c[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), c[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, c[i]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* v = values + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pj * v[d];
  }
}

inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t q_stride_tok, q_stride_head;  // q may be a view into the fused qkv rows
  int64_t cache_stride_plane, cache_stride_block, cache_stride_tok;
  int64_t max_blocks;
  float scale;
  int64_t window;      // sliding window in tokens; 0 = none
  float soft_cap;      // 0 = none
  const float* sinks;  // [num_heads] or nullptr
};

// The first key position a query at `pos` sees.
inline int64_t first_visible(const Shape& sh, int64_t pos) {
  return sh.window > 0 ? std::max<int64_t>(0, pos - sh.window + 1) : 0;
}

struct Task {
  int64_t req, first_token, num_tokens, first_pos;  // first_pos: position of first_token
  int64_t first_kv_head, num_kv_heads;
};

// The next decode task's cache rows, fetched a few at a time while the current task computes
// (tick() at each block it starts), not all at once before it: a burst of ~2,300 line prefetches
// (a 192-token row's 147 KB) fills the core's miss buffers and stalls it until most have arrived,
// which is most of what a row costs when its rows come from memory. Rows in the order the next
// task reads them (keys, then values, block by block); finish() issues whatever is left. At most
// 256 KB of a task's rows, so that a long context does not evict what the current task reads.
struct PacedPrefetch {
  const char* cache = nullptr;
  const int32_t* table = nullptr;
  int64_t first_block = 0, num_blocks = 0, block_size = 0, head_offset = 0, span = 0;
  int64_t block_bytes = 0, plane_bytes = 0, row_bytes = 0;
  int64_t next_row = 0, total_rows = 0, rows_per_tick = 0;

  template <typename T>
  void start(const Task& task, const Shape& sh, const T* cache_ptr, const int32_t* block_table, int64_t ticks) {
    constexpr int64_t kMaxBytes = 256 * 1024;
    const int64_t elem = static_cast<int64_t>(sizeof(T));
    cache = reinterpret_cast<const char*>(cache_ptr);
    table = block_table;
    block_size = sh.block_size;
    span = task.num_kv_heads * sh.head_dim * elem;
    head_offset = task.first_kv_head * sh.head_dim * elem;
    block_bytes = sh.cache_stride_block * elem;
    plane_bytes = sh.cache_stride_plane * elem;
    row_bytes = sh.cache_stride_tok * elem;
    first_block = first_visible(sh, task.first_pos) / sh.block_size;
    const int64_t last_block = (task.first_pos + task.num_tokens - 1) / sh.block_size;
    num_blocks = std::min(last_block - first_block + 1, std::max<int64_t>(1, kMaxBytes / (2 * span * block_size)));
    total_rows = 2 * num_blocks * block_size;
    next_row = 0;
    rows_per_tick = std::max<int64_t>(1, (total_rows + ticks - 1) / std::max<int64_t>(1, ticks));
  }
  void issue(int64_t rows) {
    const int64_t end = std::min(total_rows, next_row + rows);
    const int64_t plane_rows = num_blocks * block_size;
    for (; next_row < end; ++next_row) {
      const int64_t plane = next_row / plane_rows, in_plane = next_row - plane * plane_rows;
      const int64_t b = in_plane / block_size, t = in_plane - b * block_size;
      prefetch_lines(cache + static_cast<int64_t>(table[first_block + b]) * block_bytes + plane * plane_bytes +
                         t * row_bytes + head_offset,
                     span);
    }
  }
  void tick() {
    if (next_row < total_rows) issue(rows_per_tick);
  }
  void finish() { issue(total_rows); }
};

// Per-thread: the tasks' loop starts it, the decode loops tick it.
inline PacedPrefetch& paced_prefetch() {
  thread_local PacedPrefetch pacer;
  return pacer;
}

// Starts fetching (into L2) the keys and values a task will read, all at once, while the task before
// it computes: the cache far exceeds L2, and without this each block's lines missed one after
// another. For a task after a prefill chunk; after a decode row the rows are paced instead
// (PacedPrefetch), and both fetch the same capped set.
template <typename T>
void prefetch_task(const Task& task, const Shape& sh, const T* cache, const int32_t* block_table) {
  PacedPrefetch rows;
  rows.start(task, sh, cache, block_table, 1);
  rows.finish();
}

// Per-thread scratch, reused across tasks and calls.
struct Scratch {
  std::vector<float> q, acc, m, l, s, kv, scores;
  std::vector<int64_t> pos;
  void size_for(int64_t rows, int64_t head_dim, int64_t block_size, int64_t kv_rows) {
    q.resize(rows * head_dim);
    acc.resize(rows * head_dim);
    m.resize(rows);
    l.resize(rows);
    pos.resize(rows);
    s.resize(rows * block_size);
    kv.resize(block_size * kv_rows * head_dim);
  }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// One decode row (a task of one query token, float32 q, a float32 / float16 / bfloat16 cache,
// head_dim a multiple of 32, no soft cap): the general path below works block by block with an online softmax (per 16 keys: a
// scalar max, a rescale of every accumulator, scattered scores), which made a decode row cost
// ~3x its arithmetic. Here, per KV head and up to 3 of its query heads at once: every visible
// key's scores in one pass (each key row loaded once for the 3 heads, 4 keys a round, 12
// accumulators), one softmax over the whole context (max, vectorized exp, sum), then one pass
// over the values (32 columns x 3 heads in 12 accumulators). Same arithmetic as the general
// path (q pre-scaled, float32 scores and exp, division by the sum at the end) up to summation
// order and the softmax's single max.

// 8 cache elements as float32: float32 as is, float16 by F16C's convert, bfloat16 by a shift (its
// bits are float32's upper half). A 16-bit cache halves the bytes a decode row reads from memory.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The rows of keys [first, last) of one request for one KV head (`head_offset` elements into a token row).
template <typename C>
struct KeyRange {
  const C* plane;  // the K (or V) plane of the cache
  const int32_t* table;
  int64_t head_offset, first, last;
};

template <typename C>
inline const C* key_row(const KeyRange<C>& kr, const Shape& sh, int64_t t) {
  return kr.plane + static_cast<int64_t>(kr.table[t / sh.block_size]) * sh.cache_stride_block +
         (t % sh.block_size) * sh.cache_stride_tok + kr.head_offset;
}

// s[h][t - first] = dot(q[h], key t) for NH query heads (q [NH][D], pre-scaled).
template <int NH, typename C>
void decode_scores(const float* q, const KeyRange<C>& kr, const Shape& sh, float* s, int64_t s_stride) {
  const int64_t D = sh.head_dim;
  int64_t t = kr.first;
  while (t < kr.last) {
    const int64_t block_end = std::min(kr.last, (t / sh.block_size + 1) * sh.block_size);
    if (block_end < kr.last) {  // the next block is elsewhere in memory: start fetching it now
      const C* next = key_row(kr, sh, block_end);
      for (int64_t i = 0; i < sh.block_size; ++i) prefetch_lines(next + i * sh.cache_stride_tok, D * sizeof(C));
    }
    paced_prefetch().tick();
    for (; t + 4 <= block_end; t += 4) {
      const C* k0 = key_row(kr, sh, t);
      const int64_t st = sh.cache_stride_tok;
      __m256 acc[NH][4];
      for (int h = 0; h < NH; ++h)
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256 kv = load8(k0 + j * st + d);
#pragma GCC unroll 3
          for (int h = 0; h < NH; ++h) acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), kv, acc[h][j]);
        }
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 h01 = _mm256_hadd_ps(acc[h][0], acc[h][1]), h23 = _mm256_hadd_ps(acc[h][2], acc[h][3]);
        const __m256 hh = _mm256_hadd_ps(h01, h23);
        _mm_storeu_ps(s + h * s_stride + (t - kr.first),
                      _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
      }
    }
    for (; t < block_end; ++t) {
      const C* k = key_row(kr, sh, t);
      for (int h = 0; h < NH; ++h) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), load8(k + d), a);
        s[h * s_stride + (t - kr.first)] = hsum(a);
      }
    }
  }
}

// In place: s[0, n) -> exp(s - max); returns (max, sum).
inline std::pair<float, float> softmax_numerators(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = tokenmill_cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m8));
    _mm256_storeu_ps(s + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - m);
    sum += s[i];
  }
  return {m, sum};
}

// out[h][0, D) = sum_t p[h][t - first] * value t, for NH heads, 32 columns at a time.
template <int NH, typename C>
void decode_values(const float* p, int64_t p_stride, const KeyRange<C>& vr, const Shape& sh, float* out) {
  const int64_t D = sh.head_dim;
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = _mm256_setzero_ps();
    int64_t t = vr.first;
    while (t < vr.last) {
      const int64_t block_end = std::min(vr.last, (t / sh.block_size + 1) * sh.block_size);
      if (d0 == 0 && block_end < vr.last) {
        const C* next = key_row(vr, sh, block_end);
        for (int64_t i = 0; i < sh.block_size; ++i) prefetch_lines(next + i * sh.cache_stride_tok, D * sizeof(C));
      }
      if (d0 == 0) paced_prefetch().tick();
      const C* v = key_row(vr, sh, t) + d0;
      for (; t < block_end; ++t, v += sh.cache_stride_tok) {
#pragma GCC unroll 3
        for (int h = 0; h < NH; ++h) {
          const __m256 ph = _mm256_broadcast_ss(p + h * p_stride + (t - vr.first));
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) acc[h][c] = _mm256_fmadd_ps(ph, load8(v + 8 * c), acc[h][c]);
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + h * D + d0 + 8 * c, acc[h][c]);
  }
}

template <int NH, typename C>
void decode_heads(const float* q, const KeyRange<C>& kr, const KeyRange<C>& vr, const Shape& sh, float* s,
                  int64_t s_stride, float* m, float* l, float* acc) {
  decode_scores<NH>(q, kr, sh, s, s_stride);
  for (int h = 0; h < NH; ++h) std::tie(m[h], l[h]) = softmax_numerators(s + h * s_stride, kr.last - kr.first);
  decode_values<NH>(s, s_stride, vr, sh, acc);
}

// T: q and out; C: the cache (float32, or a 16-bit cache under a float32 model).
template <typename T, typename C>
bool attend_decode(const Task& task, const Shape& sh, const T* q, const C* cache, const int32_t* block_table,
                   T* out, Scratch& w) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    const int64_t D = sh.head_dim, G = sh.group;
    if (task.num_tokens != 1 || sh.soft_cap > 0.f || D % 32 != 0) return false;
    const int64_t pos = task.first_pos;
    const int64_t first = first_visible(sh, pos), n = pos + 1 - first;
    w.q.resize(3 * D);
    w.acc.resize(3 * D);
    w.m.resize(3);
    w.l.resize(3);
    w.scores.resize(3 * n);
    float* qf = w.q.data();
    for (int64_t kvh = task.first_kv_head; kvh < task.first_kv_head + task.num_kv_heads; ++kvh) {
      const KeyRange<C> kr{cache, block_table, kvh * D, first, pos + 1};
      const KeyRange<C> vr{cache + sh.cache_stride_plane, block_table, kvh * D, first, pos + 1};
      for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t nh = std::min<int64_t>(3, G - g0);
        for (int64_t h = 0; h < nh; ++h) {
          const float* src = q + task.first_token * sh.q_stride_tok + (kvh * G + g0 + h) * sh.q_stride_head;
          for (int64_t d = 0; d < D; ++d) qf[h * D + d] = src[d] * sh.scale;
        }
        float* s = w.scores.data();
        if (nh == 3) decode_heads<3>(qf, kr, vr, sh, s, n, w.m.data(), w.l.data(), w.acc.data());
        else if (nh == 2) decode_heads<2>(qf, kr, vr, sh, s, n, w.m.data(), w.l.data(), w.acc.data());
        else decode_heads<1>(qf, kr, vr, sh, s, n, w.m.data(), w.l.data(), w.acc.data());
        for (int64_t h = 0; h < nh; ++h) {
          const int64_t head = kvh * G + g0 + h;
          const float mh = w.m[h], lh = w.l[h];
          float inv = 1.f / lh;
          if (sh.sinks != nullptr) {  // one more softmax column with no value (as in attend below)
            const float sink = sh.sinks[head];
            const float new_max = std::max(mh, sink);
            const float alpha = std::exp(mh - new_max);
            inv = alpha / (lh * alpha + std::exp(sink - new_max));
          }
          float* dst = out + (task.first_token * sh.num_heads + head) * D;
          const float* a = w.acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = a[d] * inv;
        }
      }
    }
    return true;
  }
}
#else
template <typename T, typename C>
bool attend_decode(const Task&, const Shape&, const T*, const C*, const int32_t*, T*, Scratch&) {
  return false;
}
#endif

// One task: query tokens [first_token, +num_tokens) of one request, KV heads
// [first_kv_head, +num_kv_heads) and their query heads. Rows are ordered by KV head, then
// token, then query head in the group, so each KV head's rows are contiguous.
// T: q and out; C: the cache (T itself, or a 16-bit cache under float32 q / out).
template <typename T, typename C>
void attend(const Task& task, const Shape& sh, const T* q, const C* cache, const int32_t* block_table,
            T* out, Scratch& w) {
  if (attend_decode(task, sh, q, cache, block_table, out, w)) return;
  const int64_t D = sh.head_dim, G = sh.group, BS = sh.block_size;
  const int64_t rows_per_head = task.num_tokens * G;
  const int64_t rows = rows_per_head * task.num_kv_heads;
  w.size_for(rows, D, BS, task.num_kv_heads);
  float* qf = w.q.data();
  float* acc = w.acc.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* s = w.s.data();
  int64_t* pos = w.pos.data();

  for (int64_t h = 0; h < task.num_kv_heads; ++h) {
    for (int64_t i = 0; i < task.num_tokens; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * rows_per_head + i * G + g;
        const int64_t head = (task.first_kv_head + h) * G + g;
        load_row(q + (task.first_token + i) * sh.q_stride_tok + head * sh.q_stride_head, qf + r * D, D);
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= sh.scale;
        pos[r] = task.first_pos + i;
      }
    }
  }
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);

  const int64_t kv_end = task.first_pos + task.num_tokens;  // keys up to the last query position
  const int64_t num_blocks = (kv_end + BS - 1) / BS;
  // Blocks wholly before the earliest row's window are neither needed nor safe to read.
  const int64_t first_block = first_visible(sh, task.first_pos) / BS;
  const int64_t head_offset = task.first_kv_head * D;
  const int64_t span = task.num_kv_heads * D;  // contiguous elements of one token's row we read
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const C* k_block = cache + static_cast<int64_t>(block_table[b]) * sh.cache_stride_block + head_offset;
    const C* v_block = k_block + sh.cache_stride_plane;
    if (b + 1 < num_blocks) {  // the next block is elsewhere in memory: start fetching it now
      const C* next = cache + static_cast<int64_t>(block_table[b + 1]) * sh.cache_stride_block + head_offset;
      for (int64_t t = 0; t < BS; ++t) {
        prefetch_lines(next + t * sh.cache_stride_tok, span * sizeof(C));
        prefetch_lines(next + sh.cache_stride_plane + t * sh.cache_stride_tok, span * sizeof(C));
      }
    }
    const int64_t first_key = b * BS;
    const int64_t n = std::min(BS, kv_end - first_key);

    // Keys as float, [t][h][d] (a copy only for 16-bit caches).
    const float* kf;
    int64_t kf_stride;
    if constexpr (std::is_same_v<C, float>) {
      kf = k_block, kf_stride = sh.cache_stride_tok;
    } else {
      for (int64_t t = 0; t < n; ++t) load_row(k_block + t * sh.cache_stride_tok, w.kv.data() + t * span, span);
      kf = w.kv.data(), kf_stride = span;
    }
    // Scores [row][t]; a key is visible to a row when its position is <= the row's.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = r / rows_per_head;
      dot_keys(qf + r * D, kf + h * D, kf_stride, n, D, s + r * BS);
    }
    if (sh.soft_cap > 0.f) {
      const float cap = sh.soft_cap, inv_cap = 1.f / sh.soft_cap;
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * BS;
        for (int64_t t = 0; t < n; ++t) sr[t] = cap * std::tanh(sr[t] * inv_cap);
      }
    }
    // Online softmax over the keys of the block each row sees (keys [begin, visible)).
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * BS;
      const int64_t visible = std::min(n, pos[r] - first_key + 1);
      const int64_t begin = std::max<int64_t>(0, first_visible(sh, pos[r]) - first_key);
      if (visible <= begin) {
        std::fill(sr, sr + n, 0.f);
        continue;
      }
      float block_max = sr[begin];
      for (int64_t t = begin + 1; t < visible; ++t) block_max = std::max(block_max, sr[t]);
      const float new_max = std::max(m[r], block_max);
      const float alpha = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : exp_nonpositive(m[r] - new_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = begin; t < visible; ++t) {
        sr[t] = exp_nonpositive(sr[t] - new_max);
        sum += sr[t];
      }
      std::fill(sr, sr + begin, 0.f);
      std::fill(sr + visible, sr + n, 0.f);
      if (alpha != 1.f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      }
      l[r] = l[r] * alpha + sum;
      m[r] = new_max;
    }
    // acc[row] += sum_t p[row][t] * v[t], the row's accumulator kept in registers across keys.
    const float* vf;
    int64_t vf_stride;
    if constexpr (std::is_same_v<C, float>) {
      vf = v_block, vf_stride = sh.cache_stride_tok;
    } else {
      for (int64_t t = 0; t < n; ++t) load_row(v_block + t * sh.cache_stride_tok, w.kv.data() + t * span, span);
      vf = w.kv.data(), vf_stride = span;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = r / rows_per_head;
      const int64_t visible = std::min(n, pos[r] - first_key + 1);
      const int64_t begin = std::max<int64_t>(0, first_visible(sh, pos[r]) - first_key);
      if (visible > begin) {
        accumulate_values(acc + r * D, s + r * BS + begin, vf + h * D + begin * vf_stride, vf_stride,
                          visible - begin, D);
      }
    }
  }

  for (int64_t h = 0; h < task.num_kv_heads; ++h) {
    for (int64_t i = 0; i < task.num_tokens; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * rows_per_head + i * G + g;
        const int64_t head = (task.first_kv_head + h) * G + g;
        float inv = 1.f / l[r];
        if (sh.sinks != nullptr) {
          // The sink is one more softmax column with no value: it only adds to the denominator.
          const float sink = sh.sinks[head];
          const float new_max = std::max(m[r], sink);
          const float alpha = std::exp(m[r] - new_max);
          inv = alpha / (l[r] * alpha + std::exp(sink - new_max));
        }
        T* dst = out + ((task.first_token + i) * sh.num_heads + head) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
      }
    }
  }
}

void check_layout(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "cpu paged attention: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [num_tokens, num_heads, head_dim] with unit stride in head_dim");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] tensor");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  // One dtype for all three, or float32 q / out over a 16-bit cache (read as float32).
  const bool mixed = q.scalar_type() == at::kFloat &&
                     (kv_cache.scalar_type() == at::kHalf || kv_cache.scalar_type() == at::kBFloat16);
  TORCH_CHECK((q.scalar_type() == kv_cache.scalar_type() || mixed) && out.scalar_type() == q.scalar_type(),
              "q and out must share the kv_cache's dtype (or be float32 over a float16 / bfloat16 cache), got ",
              q.scalar_type(), ", ", out.scalar_type(), " and ", kv_cache.scalar_type());
  TORCH_CHECK(q.size(2) == kv_cache.size(4), "q head_dim ", q.size(2), " != cache head_dim ", kv_cache.size(4));
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
}

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, int64_t max_query_len,
                     int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks) {
  check_layout(q, kv_cache, out);
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0 = none), got ", sliding_window);
  TORCH_CHECK(soft_cap >= 0, "soft_cap must be >= 0 (0 = none), got ", soft_cap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "sinks must be a contiguous float32 CPU tensor of num_heads (", q.size(1), ") entries, got ",
                sinks->sizes(), " ", sinks->scalar_type());
  }
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt,
              "query_start_loc, seq_lens and block_tables must be int32");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() && block_tables.is_contiguous(),
              "query_start_loc, seq_lens and block_tables must be contiguous");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) >= num_reqs + 1, "query_start_loc needs num_reqs + 1 entries");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_reqs, "block_tables must be [num_reqs, max_blocks]");

  Shape sh;
  sh.num_heads = q.size(1);
  sh.num_kv_heads = kv_cache.size(3);
  sh.head_dim = q.size(2);
  sh.block_size = kv_cache.size(2);
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.q_stride_tok = q.stride(0);
  sh.q_stride_head = q.stride(1);
  sh.cache_stride_tok = sh.num_kv_heads * sh.head_dim;
  sh.cache_stride_block = sh.block_size * sh.cache_stride_tok;
  sh.cache_stride_plane = kv_cache.size(1) * sh.cache_stride_block;
  sh.max_blocks = block_tables.size(1);
  sh.scale = static_cast<float>(scale);
  sh.window = sliding_window;
  sh.soft_cap = static_cast<float>(soft_cap);
  sh.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;

  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // A task reads whole token rows (all KV heads: contiguous memory) unless that leaves the
  // threads too few tasks (small batches), then one KV head each.
  int64_t num_row_tasks = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    if (q_len <= max_query_len) num_row_tasks += (q_len + kQueryTile - 1) / kQueryTile;
  }
  const int64_t heads_per_task = num_row_tasks >= 4 * at::get_num_threads() ? sh.num_kv_heads : 1;
  const int64_t num_cache_blocks = kv_cache.size(1);
  std::vector<Task> tasks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    const int64_t context = lens[r] - q_len;
    TORCH_CHECK(q_len >= 0 && context >= 0, "request ", r, ": query_len ", q_len, " exceeds seq_len ", lens[r]);
    TORCH_CHECK(starts[r + 1] <= q.size(0), "query_start_loc points past q's ", q.size(0), " rows");
    TORCH_CHECK((lens[r] + sh.block_size - 1) / sh.block_size <= sh.max_blocks,
                "request ", r, ": seq_len ", lens[r], " needs more blocks than block_tables has columns");
    if (q_len > max_query_len) continue;  // left to the caller
    TORCH_CHECK(starts[r] >= 0, "query_start_loc[", r, "] is negative");
    const int32_t* row = block_tables.data_ptr<int32_t>() + r * sh.max_blocks;
    // Entries before the window of the request's earliest query row are never read.
    for (int64_t b = first_visible(sh, context) / sh.block_size; b < (lens[r] + sh.block_size - 1) / sh.block_size;
         ++b) {
      // Reading through a bad block id would touch memory outside the cache: refuse instead.
      TORCH_CHECK(row[b] >= 0 && row[b] < num_cache_blocks, "request ", r, ": block_tables[", r, "][", b,
                  "] = ", row[b], " is not a block of this cache (", num_cache_blocks, " blocks)");
    }
    for (int64_t t = 0; t < q_len; t += kQueryTile) {
      for (int64_t h = 0; h < sh.num_kv_heads; h += heads_per_task) {
        tasks.push_back({r, starts[r] + t, std::min(kQueryTile, q_len - t), context + t, h, heads_per_task});
      }
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  // With the helper thread (a small machine, helper_pool.h): the tasks are shared between the caller
  // and the helper, one task a chunk for a few-row step, else ~16 chunks of consecutive tasks (each
  // prefetching the next one's rows).
  int64_t work = 0;  // multiply-adds: scores and values, every query head over its visible keys
  for (const Task& task : tasks) {
    work += 2 * task.num_tokens * (task.first_pos + 1 - first_visible(sh, task.first_pos)) * task.num_kv_heads *
            sh.group * sh.head_dim;
  }
  const bool on_helper = num_tasks > 1 && tokenmill_cpu::use_helper_pool(work);
  const int64_t tasks_per_chunk = num_reqs <= kHelperMaxRows ? 1 : (num_tasks + 15) / 16;
  auto run = [&](auto* out_ptr, const auto* cache_ptr) {
    const auto* q_ptr = static_cast<decltype(out_ptr)>(q.data_ptr());
    const auto tasks_in = [&](int64_t begin, int64_t end) {
      thread_local Scratch scratch;
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        if (i + 1 < end) {
          const Task& next = tasks[i + 1];
          if (task.num_tokens == 1) {
            // A decode row ticks twice a block it reads, per KV head (keys, then values).
            const int64_t blocks = task.first_pos / sh.block_size - first_visible(sh, task.first_pos) / sh.block_size + 1;
            paced_prefetch().start(next, sh, cache_ptr, tables + next.req * sh.max_blocks, 2 * blocks * task.num_kv_heads);
          } else {
            prefetch_task(next, sh, cache_ptr, tables + next.req * sh.max_blocks);
          }
        }
        attend(task, sh, q_ptr, cache_ptr, tables + task.req * sh.max_blocks, out_ptr, scratch);
        paced_prefetch().finish();
      }
    };
    if (on_helper) {
      tokenmill_cpu::parallel_chunks((num_tasks + tasks_per_chunk - 1) / tasks_per_chunk, [&](int64_t c) {
        tasks_in(c * tasks_per_chunk, std::min(num_tasks, (c + 1) * tasks_per_chunk));
      });
    } else {
      at::parallel_for(0, num_tasks, 1, tasks_in);
    }
  };
  if (q.scalar_type() != kv_cache.scalar_type()) {  // float32 q / out over a 16-bit cache
    if (kv_cache.scalar_type() == at::kHalf) run(out.data_ptr<float>(), kv_cache.data_ptr<c10::Half>());
    else run(out.data_ptr<float>(), kv_cache.data_ptr<c10::BFloat16>());
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "tokenmill_cpu_paged_attention", [&] {
    run(out.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>());
  });
}

// Writes k/v rows into their slots; slot -1 writes nowhere (padding).
// One token's k or v row into the cache: a copy, or (float32 rows into a 16-bit float cache) a
// conversion with c10's round-to-nearest-even, the rounding `Tensor.to` applies.
template <typename CacheT>
inline void convert_row(CacheT* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<CacheT>(src[j]);
}

void store_kv(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] tensor");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "k and v must be [num_tokens, num_kv_heads, head_dim] with contiguous rows");
  const auto cache_type = kv_cache.scalar_type();
  // float32 k/v go into a float16 / bfloat16 cache converted here: a float32 model over a 16-bit
  // cache (the CPU default under GGUF weights) then needs no conversion launches per layer.
  const bool convert = k.scalar_type() == at::kFloat && (cache_type == at::kHalf || cache_type == at::kBFloat16);
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (convert || k.scalar_type() == cache_type),
              "k and v must share the cache's dtype (or be float32 over a float16 / bfloat16 cache)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  const int64_t num_tokens = std::min<int64_t>(slot_mapping.size(0), k.size(0));
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  TORCH_CHECK(k.size(1) * k.size(2) == row && v.size(1) * v.size(2) == row, "k/v rows do not match the cache's");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(slots[i] < num_slots, "slot ", slots[i], " is outside the cache's ", num_slots, " slots");
  }
  const int64_t elem = kv_cache.element_size();
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + num_slots * row * elem;
  const char* k_ptr = static_cast<const char*>(k.data_ptr());
  const char* v_ptr = static_cast<const char*>(v.data_ptr());
  const int64_t in_elem = k.element_size();
  const int64_t k_stride = k.stride(0) * in_elem, v_stride = v.stride(0) * in_elem;
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      char* k_dst = k_cache + slots[i] * row * elem;
      char* v_dst = v_cache + slots[i] * row * elem;
      const char* k_src = k_ptr + i * k_stride;
      const char* v_src = v_ptr + i * v_stride;
      if (!convert) {
        std::memcpy(k_dst, k_src, row * elem);
        std::memcpy(v_dst, v_src, row * elem);
      } else if (cache_type == at::kHalf) {
        convert_row(reinterpret_cast<c10::Half*>(k_dst), reinterpret_cast<const float*>(k_src), row);
        convert_row(reinterpret_cast<c10::Half*>(v_dst), reinterpret_cast<const float*>(v_src), row);
      } else {
        convert_row(reinterpret_cast<c10::BFloat16*>(k_dst), reinterpret_cast<const float*>(k_src), row);
        convert_row(reinterpret_cast<c10::BFloat16*>(v_dst), reinterpret_cast<const float*>(v_src), row);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, float scale, int max_query_len, int sliding_window, float soft_cap, "
      "Tensor? sinks) -> ()");
  m.def("store_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("store_kv", &store_kv);
}
