// Quantizing the activations and filling one panel of the batched 16-bit-activation kernels (cpu_quant_gemm_vnni.cpp on AVX-512
// VNNI, cpu_quant_gemm_int16_avx2.cpp on AVX2): their instruction sets differ only in how an
// activation row is quantized and a weight row unpacked, passed in.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace tokenmill_cpu {

// Storage on 64-byte boundaries: the tiles read 32-byte vectors of these arrays, and from a
// 16-byte-aligned heap block every other one straddled two cache lines (the AVX2 kernel, 64 rows:
// 2.3 ms a gate_up call from an aligned block vs 3.0-3.2 from misaligned ones, by process).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t count) {
    return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// Activations of one call: pairs [group][block][pair][row] int32 (an int16 pair each), and per
// [group][block][row] the scale d_x and the float sum of the block.
struct QuantizedActivations {
  AlignedVector<int32_t> pairs;
  AlignedVector<float> scale;
  AlignedVector<float> sum;
};

// Rows of x [m, 32 num_blocks] -> groups of Group rows (rows past m: zeros); quantize_row(row, r)
// writes row r into its group's lane. By groups across the threads: rows of one group write the
// same cache lines (a 512-row prefill chunk's quantization took ~0.15 ms on one thread, serial
// before the panels' parallel loop).
template <int64_t Group, typename QuantizeRow>
void quantize_activations(const float* x, int64_t m, int64_t num_blocks, QuantizedActivations& out,
                          const QuantizeRow& quantize_row) {
  const int64_t groups = (m + Group - 1) / Group, k = num_blocks * 32;
  out.pairs.assign(groups * num_blocks * 16 * Group, 0);
  out.scale.assign(groups * num_blocks * Group, 0.f);
  out.sum.assign(groups * num_blocks * Group, 0.f);
  at::parallel_for(0, groups, 1, [&](int64_t group_begin, int64_t group_end) {
    for (int64_t r = group_begin * Group; r < std::min(m, group_end * Group); ++r) quantize_row(x + r * k, r);
  });
}

// Weight rows [first, first + rows) (vnni layout, `row_bytes` apart) into a panel of PanelRows rows:
// unpack_row(row, panel_row, d_row, m_row) writes row r's int16 weights at panel + r * 32 (the panel
// is [block][panel row][32]) and its scales at d_panel / m_panel + r * num_blocks. Rows past `rows`
// get zero weights (their outputs are dropped). The first `next_rows` rows of the next panel are
// prefetched into L2 (prefetcht2) meanwhile: a step's weights come from memory (they exceed the L3),
// and the unpack's first loads stalled on them (VNNI, gate_up, 64 rows, one thread: 1.42 -> 1.32 ms;
// all 24 rows at the panel's start: no gain; prefetcht0 one row a row: 1.36 ms).
template <int64_t PanelRows, typename UnpackRow>
void fill_panel(const uint8_t* w, int64_t row_bytes, int64_t num_blocks, int64_t first, int64_t rows,
                int64_t next_rows, int16_t* panel, float* d_panel, float* m_panel, const UnpackRow& unpack_row) {
  constexpr int64_t kBlock = 32;
  for (int64_t r = 0; r < rows; ++r) {
    if (r < next_rows) {
      const uint8_t* ahead = w + (first + PanelRows + r) * row_bytes;
      for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 1);  // prefetcht2
    }
    unpack_row(w + (first + r) * row_bytes, panel + r * kBlock, d_panel + r * num_blocks, m_panel + r * num_blocks);
  }
  for (int64_t r = rows; r < PanelRows; ++r) {
    for (int64_t b = 0; b < num_blocks; ++b) std::fill_n(panel + (b * PanelRows + r) * kBlock, kBlock, int16_t{0});
    std::fill_n(d_panel + r * num_blocks, num_blocks, 0.f);
    std::fill_n(m_panel + r * num_blocks, num_blocks, 0.f);
  }
}

}  // namespace tokenmill_cpu
