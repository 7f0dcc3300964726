// Filling one panel of the batched 16-bit-activation kernels (cpu_quant_gemm_vnni.cpp on AVX-512
// VNNI, cpu_quant_gemm_int16_avx2.cpp on AVX2): their instruction sets differ only in how a weight
// row is unpacked, passed in as `unpack_row`.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tokenmill_cpu {

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
