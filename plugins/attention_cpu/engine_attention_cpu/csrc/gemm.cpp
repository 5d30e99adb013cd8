// Float32 GEMM for the linear layers on AVX2 CPUs: out = x @ weight.T (+ bias).
//
// The weight is packed once, at load, into panels of 16 output columns ([N/16][K][16], the last panel
// zero-padded). Each product packs x into panels of 6 rows ([K chunk][M/6][kc][6]) and runs a 6x16
// register-tile kernel: 12 accumulators, two weight loads and six broadcasts per step of k. The
// threads share the packed x; each owns a contiguous range of weight panels and, once done, takes
// panels from the back of the others' ranges (work stealing: robust to a core taken by another process). Every output element is one fused multiply-add chain over k
// in order (K in chunks of at most 576): a row's result does not depend on the other rows of the batch.
#pragma once  // compiled into other kernel sources too (fused_moe.cpp, quant_gemm.cpp, decode_graph.cpp)
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "float_variants.h"
#include "spin_pool.h"
#include "vec_avx2.h"

#ifdef ENGINE_EMULATE_AVX512
// The build for tests on CPUs without AVX-512 (setup.py's *_emulated modules): the AVX-512 variant's instructions
// come from SIMDe (exact, slow), the AVX2 ones stay native.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#endif

namespace engine_cpu {
namespace {

constexpr int64_t kRows = 6;       // rows of the register tile
constexpr int64_t kCols = 16;      // columns of the register tile (two AVX2 vectors); the panel width
constexpr int64_t kMaxChunk = 576; // most k per pass: a 6-row x panel stays in L1, a weight panel in L2
constexpr int64_t kRowBlock = 72;  // rows of x whose packed panels stay in L2 while the weight panels pass
constexpr int64_t kRowBlockFloats = 40960;  // at most 160 KiB of packed x per row block (over every k chunk)

int64_t chunk_size(int64_t k) {
  const int64_t chunks = (k + kMaxChunk - 1) / kMaxChunk;
  return (k + chunks - 1) / chunks;
}

#ifdef ENGINE_AVX2
// Column mask for the last panel's ragged width: lanes [0, cols) of 16.
struct ColumnMask {
  __m256i low, high;
  explicit ColumnMask(int64_t cols) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lanes);
    high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lanes);
  }
};

// c[r][0:16] = (first ? bias : c[r]) + sum_k a[k][r] * b[k][0:16] for r < ROWS; cols < 16 stores a masked tile.
#define TILE_FMA(r)                                                   \
  if constexpr (ROWS > r) {                                           \
    const __m256 av = _mm256_broadcast_ss(a + r);                     \
    acc##r##0 = _mm256_fmadd_ps(av, b0, acc##r##0);                   \
    acc##r##1 = _mm256_fmadd_ps(av, b1, acc##r##1);                   \
  }
#define TILE_STORE(r)                                                 \
  if constexpr (ROWS > r) {                                           \
    float* row = c + r * ldc;                                         \
    if (cols == kCols) {                                              \
      _mm256_storeu_ps(row, _mm256_add_ps(acc##r##0, first ? bias0 : _mm256_loadu_ps(row)));         \
      _mm256_storeu_ps(row + 8, _mm256_add_ps(acc##r##1, first ? bias1 : _mm256_loadu_ps(row + 8))); \
    } else {                                                          \
      const ColumnMask m(cols);                                       \
      _mm256_maskstore_ps(row, m.low, _mm256_add_ps(acc##r##0, first ? bias0 : _mm256_maskload_ps(row, m.low)));  \
      _mm256_maskstore_ps(row + 8, m.high,                            \
                          _mm256_add_ps(acc##r##1, first ? bias1 : _mm256_maskload_ps(row + 8, m.high)));          \
    }                                                                 \
  }

template <int ROWS>
__attribute__((noinline)) void tile(int64_t kc, const float* __restrict a, const float* __restrict b,
                                    float* __restrict c, int64_t ldc, int64_t cols, bool first,
                                    const float* bias) {
  __m256 acc00 = _mm256_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00, acc20 = acc00, acc21 = acc00,
         acc30 = acc00, acc31 = acc00, acc40 = acc00, acc41 = acc00, acc50 = acc00, acc51 = acc00;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k, a += kRows, b += kCols) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    TILE_FMA(0) TILE_FMA(1) TILE_FMA(2) TILE_FMA(3) TILE_FMA(4) TILE_FMA(5)
  }
  const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();  // bias is padded to the panel
  const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3) TILE_STORE(4) TILE_STORE(5)
}
#undef TILE_FMA
#undef TILE_STORE

void tile_rows(int64_t rows, int64_t kc, const float* a, const float* b, float* c, int64_t ldc, int64_t cols,
               bool first, const float* bias) {
  switch (rows) {
    case 6: return tile<6>(kc, a, b, c, ldc, cols, first, bias);
    case 5: return tile<5>(kc, a, b, c, ldc, cols, first, bias);
    case 4: return tile<4>(kc, a, b, c, ldc, cols, first, bias);
    case 3: return tile<3>(kc, a, b, c, ldc, cols, first, bias);
    case 2: return tile<2>(kc, a, b, c, ldc, cols, first, bias);
    default: return tile<1>(kc, a, b, c, ldc, cols, first, bias);
  }
}

// Row panel p of x (rows [R p, R p + R) for R = panel_rows, zero past m), k in [k0, k0+kc), as [kc][R].
void pack_row_panel(const float* x, int64_t ldx, int64_t m, int64_t p, int64_t k0, int64_t kc, float* dst,
                    int64_t panel_rows = kRows) {
  const int64_t r0 = p * panel_rows, rows = std::min(panel_rows, m - r0);
  for (int64_t r = 0; r < panel_rows; ++r) {
    if (r < rows) {
      const float* src = x + (r0 + r) * ldx + k0;
      for (int64_t k = 0; k < kc; ++k) dst[k * panel_rows + r] = src[k];
    } else {
      for (int64_t k = 0; k < kc; ++k) dst[k * panel_rows + r] = 0.f;
    }
  }
}

// A thread's share of the work items, [front, back), taken from the front by its owner and from the back
// by threads that have finished their own; both ends in one atomic word.
struct alignas(64) ItemRange {
  std::atomic<uint64_t> bounds{0};
  int64_t first_panel = 0, width = 1;  // the panels whose items these are
  void reset(int64_t front, int64_t back) { bounds.store((static_cast<uint64_t>(back) << 32) | front); }
  bool take_front(int64_t& item) {
    uint64_t cur = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
      if (front >= back) return false;
      if (bounds.compare_exchange_weak(cur, (back << 32) | (front + 1), std::memory_order_acq_rel)) {
        item = static_cast<int64_t>(front);
        return true;
      }
    }
  }
  bool take_back(int64_t& item) {
    uint64_t cur = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
      if (front >= back) return false;
      if (bounds.compare_exchange_weak(cur, ((back - 1) << 32) | front, std::memory_order_acq_rel)) {
        item = static_cast<int64_t>(back - 1);
        return true;
      }
    }
  }
};

std::vector<float>& packed_x_buffer() {  // the caller's, grown once: products must not map fresh pages each call
  thread_local std::vector<float> buffer;
  return buffer;
}
#endif

}  // namespace

bool available() {
#ifdef ENGINE_AVX2
  return true;
#else
  return false;
#endif
}

// The weight [N, K] as [ceil(N/16)][K][16] panels (zero-padded), float32.
torch::Tensor pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "weight must be a 2-D CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kCols - 1) / kCols;
  auto padded = torch::zeros({panels * kCols, k}, weight.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kCols, k}).transpose(1, 2).contiguous();
}

#ifdef ENGINE_AVX2
// The schedule every GEMM variant shares: x packed into the calling thread's buffer in panels of panel_rows rows
// ([K chunk][M/R][kc][R]), then work items (row block, column group) of `groups` groups, each computed by
// compute(ax, chunk_stride, i0, i1, group) over every k chunk by one thread in the same order whoever takes it (a
// result does not depend on the split). Each thread owns the items of a contiguous range of groups, row block by
// row block (the static split: a row block of packed x stays in L2 while the thread's panels pass over it), and
// takes them from the front; a thread that runs out takes items from the back of the others' ranges. So a thread
// that loses its core to another process for a while leaves the rest of its share to the others instead of
// holding every thread up at the end. whole_rows: an item is a group against every row.
template <class Compute>
void run_work_items(const float* xs, int64_t ldx, int64_t m, int64_t n, int64_t k, int64_t groups,
                    int64_t panel_rows, bool whole_rows, const Compute& compute) {
  const int64_t kc_max = chunk_size(k), row_panels = (m + panel_rows - 1) / panel_rows;
  const int64_t chunk_stride = row_panels * panel_rows;  // floats per k of one chunk: [M/R][kc][R] = kc * stride
  std::vector<float>& buffer = packed_x_buffer();
  if (buffer.size() < static_cast<size_t>(chunk_stride * k)) buffer.resize(chunk_stride * k);
  float* ax = buffer.data();
  // two threads only pay off when each has a few tiles of work
  const int threads = (m * n * k >= (int64_t)1 << 18) ? at::get_num_threads() : 1;
  const int64_t block_rows =
      whole_rows ? m
                 : std::max<int64_t>(panel_rows,
                                     std::min<int64_t>(kRowBlock, kRowBlockFloats / k / panel_rows * panel_rows));
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  std::vector<ItemRange> ranges(threads);
  for (int t = 0; t < threads; ++t) {
    ranges[t].first_panel = groups * t / threads;
    ranges[t].width = groups * (t + 1) / threads - ranges[t].first_panel;
    ranges[t].reset(0, ranges[t].width * row_blocks);
  }

  // on the spin pool (a worker that has no core is not waited for): the participants pack x's panels, each
  // waiting until every panel is packed (only participants take panels, so each taken one is being packed), then
  // take work items, each from its own range first
  const int64_t chunks = (k + kc_max - 1) / kc_max, pack_items = chunks * row_panels;
  std::atomic<int64_t> next_pack{0}, packed{0};
  std::atomic<int> seats{0};
  engine_pool::run_shared(threads, [&] {
    for (int64_t i = next_pack++; i < pack_items; i = next_pack++) {
      const int64_t k0 = (i / row_panels) * kc_max, p = i % row_panels, kc = std::min(kc_max, k - k0);
      pack_row_panel(xs, ldx, m, p, k0, kc, ax + k0 * chunk_stride + p * panel_rows * kc, panel_rows);
      packed.fetch_add(1, std::memory_order_release);
    }
    while (packed.load(std::memory_order_acquire) < pack_items) _mm_pause();
    auto run = [&](const ItemRange& range, int64_t item) {
      const int64_t i0 = (item / range.width) * block_rows, i1 = std::min(m, i0 + block_rows);
      compute(static_cast<const float*>(ax), chunk_stride, i0, i1, range.first_panel + item % range.width);
    };
    const int t = seats++;
    int64_t item;
    while (ranges[t].take_front(item)) run(ranges[t], item);
    for (int other = 1; other < threads; ++other) {
      ItemRange& range = ranges[(t + other) % threads];
      while (range.take_back(item)) run(range, item);
    }
  });
}

// c[M, N] = x[M, K] @ W.T + bias over the weight's panels, each given by panel_of(q): a [K][16] float32 panel that
// stays valid while the calling thread computes panel q (a packed weight's own panel, or a quantized weight's
// de-quantized into that thread's buffer: quant_gemm.cpp). bias_ptr (or null) is padded to the panels.
// whole_rows: a work item is a panel against every row (a panel made per item is made once per product).
template <class PanelOf>
void linear_panels(float* c, int64_t n, const float* xs, int64_t ldx, int64_t m, int64_t k, int64_t panels,
                   const float* bias_ptr, const PanelOf& panel_of, bool whole_rows = false) {
  const int64_t kc_max = chunk_size(k);
  run_work_items(xs, ldx, m, n, k, panels, kRows, whole_rows,
                 [&](const float* ax, int64_t chunk_stride, int64_t i0, int64_t i1, int64_t q) {
                   const int64_t cols = std::min(kCols, n - q * kCols);
                   const float* panel_bias = bias_ptr ? bias_ptr + q * kCols : nullptr;
                   const float* weight_panel = panel_of(q);
                   for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                     const int64_t kc = std::min(kc_max, k - k0);
                     const float* chunk = ax + k0 * chunk_stride;
                     const float* panel = weight_panel + k0 * kCols;
                     for (int64_t i = i0; i < i1; i += kRows)
                       tile_rows(std::min(kRows, m - i), kc, chunk + (i / kRows) * kRows * kc, panel,
                                 c + i * n + q * kCols, n, cols, k0 == 0, panel_bias);
                   }
                 });
}
#endif

#ifdef ENGINE_AVX2
// The AVX-512 variant: the same packed panels, the same k chunks and the same fused multiply-add chain per output
// element in the same order, so its results are the AVX2 variant's bits; 512-bit lanes and the 32 registers give
// a 12x32 tile (two panels, 24 accumulators: 14 loads for 24 FMAs of 16 lanes, against 8 for 12 of 8 on AVX2).
#ifndef ENGINE_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
namespace avx512 {

constexpr int64_t kRows = 12;  // rows of the register tile; x is packed in panels of this many rows

// c[r][0:cols] = (first ? bias : c[r]) + sum_k a[k][r] * b[k][:] over one panel (b0) or two (b0, then b1).
template <int ROWS, bool PAIR>
__attribute__((noinline)) void tile(int64_t kc, const float* __restrict a, const float* __restrict b0,
                                    const float* __restrict b1, float* __restrict c, int64_t ldc, int64_t cols,
                                    bool first, const float* bias) {
  __m512 acc0[ROWS], acc1[ROWS];
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k, a += kRows, b0 += kCols, b1 += kCols) {
    const __m512 w0 = _mm512_loadu_ps(b0);
    const __m512 w1 = PAIR ? _mm512_loadu_ps(b1) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const __m512 av = _mm512_set1_ps(a[r]);
      acc0[r] = _mm512_fmadd_ps(av, w0, acc0[r]);
      if constexpr (PAIR) acc1[r] = _mm512_fmadd_ps(av, w1, acc1[r]);
    }
  }
  constexpr int64_t width = PAIR ? 2 * kCols : kCols;
  if (cols == width) {
    const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      float* row = c + r * ldc;
      _mm512_storeu_ps(row, _mm512_add_ps(acc0[r], first ? (bias ? _mm512_loadu_ps(bias) : zero) : _mm512_loadu_ps(row)));
      if constexpr (PAIR)
        _mm512_storeu_ps(row + kCols, _mm512_add_ps(acc1[r], first ? (bias ? _mm512_loadu_ps(bias + kCols) : zero)
                                                                    : _mm512_loadu_ps(row + kCols)));
    }
    return;
  }
  // the ragged last panel: each sum added as a scalar (one rounding, the same as a vector lane's)
  alignas(64) float sums[width];
  for (int r = 0; r < ROWS; ++r) {
    _mm512_store_ps(sums, acc0[r]);
    if constexpr (PAIR) _mm512_store_ps(sums + kCols, acc1[r]);
    float* row = c + r * ldc;
    for (int64_t j = 0; j < cols; ++j) row[j] = sums[j] + (first ? (bias ? bias[j] : 0.f) : row[j]);
  }
}

template <bool PAIR>
void tile_rows(int64_t rows, int64_t kc, const float* a, const float* b0, const float* b1, float* c, int64_t ldc,
               int64_t cols, bool first, const float* bias) {
#define ENGINE_TILE_CASE(R) \
  case R: return tile<R, PAIR>(kc, a, b0, b1, c, ldc, cols, first, bias);
  switch (rows) {
    ENGINE_TILE_CASE(12) ENGINE_TILE_CASE(11) ENGINE_TILE_CASE(10) ENGINE_TILE_CASE(9) ENGINE_TILE_CASE(8)
    ENGINE_TILE_CASE(7) ENGINE_TILE_CASE(6) ENGINE_TILE_CASE(5) ENGINE_TILE_CASE(4) ENGINE_TILE_CASE(3)
    ENGINE_TILE_CASE(2) default: return tile<1, PAIR>(kc, a, b0, b1, c, ldc, cols, first, bias);
  }
#undef ENGINE_TILE_CASE
}

// linear_panels' work, a work item being a row block (every row: whole_rows) against a pair of panels, each pair
// given by pair_of(q, pair): panel q, then panel q + 1 when `pair`, as [K][16] float32 panels one after the other,
// valid while the calling thread computes them (a packed weight's own, or 16-bit panels widened into that thread's
// buffer).
template <class PairOf>
void linear_pairs(float* c, int64_t n, const float* xs, int64_t ldx, int64_t m, int64_t k, int64_t panels,
                  const float* bias_ptr, const PairOf& pair_of, bool whole_rows) {
  const int64_t kc_max = chunk_size(k);
  run_work_items(xs, ldx, m, n, k, (panels + 1) / 2, kRows, whole_rows,
                 [&](const float* ax, int64_t chunk_stride, int64_t i0, int64_t i1, int64_t pair_index) {
                   const int64_t q = 2 * pair_index;
                   const bool pair = q + 1 < panels;
                   const int64_t cols = std::min((pair ? 2 : 1) * kCols, n - q * kCols);
                   const float* panel_bias = bias_ptr ? bias_ptr + q * kCols : nullptr;
                   const float* w = pair_of(q, pair);
                   for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
                     const int64_t kc = std::min(kc_max, k - k0);
                     const float* chunk = ax + k0 * chunk_stride;
                     const float* b0 = w + k0 * kCols;
                     const float* b1 = pair ? b0 + k * kCols : b0;
                     for (int64_t i = i0; i < i1; i += kRows) {
                       const float* a = chunk + (i / kRows) * kRows * kc;
                       float* out = c + i * n + q * kCols;
                       if (pair) tile_rows<true>(std::min(kRows, m - i), kc, a, b0, b1, out, n, cols, k0 == 0, panel_bias);
                       else tile_rows<false>(std::min(kRows, m - i), kc, a, b0, b1, out, n, cols, k0 == 0, panel_bias);
                     }
                   }
                 });
}

// linear_pairs on a float32 packed weight w.
void linear(float* c, int64_t n, const float* xs, int64_t ldx, int64_t m, int64_t k, int64_t panels,
            const float* bias_ptr, const float* w) {
  linear_pairs(c, n, xs, ldx, m, k, panels, bias_ptr, [w, k](int64_t q, bool) { return w + q * k * kCols; }, false);
}

// Sixteen consecutive panel elements as float32 lanes (16-bit ones widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R <= 4 rows against G panels from q: each output one FMA chain over k per k chunk, the chunks added in order,
// as the AVX2 gemv_panels adds them; G panels at once keep G independent chains per row in flight. W: the panels'
// element type (16-bit panels are widened as they are read: the same products as their float32 panels).
template <int R, int G, typename W = float>
void gemv_group(const float* x, int64_t ldx, const W* w, int64_t k, int64_t n, const float* bias, float* c,
                int64_t ldc, int64_t q) {
  const int64_t kc_max = chunk_size(k);
  __m512 out[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) out[r][j] = bias ? _mm512_loadu_ps(bias + (q + j) * kCols) : _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, k - k0);
    const W* panel = w + (q * k + k0) * kCols;
    __m512 acc[R][G];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kc; ++i) {
      __m512 wv[G];
#pragma GCC unroll 4
      for (int j = 0; j < G; ++j) wv[j] = load16(panel + j * k * kCols + i * kCols);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k0 + i]);
#pragma GCC unroll 4
        for (int j = 0; j < G; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < G; ++j) out[r][j] = _mm512_add_ps(acc[r][j], out[r][j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) {
      float* row = c + r * ldc + (q + j) * kCols;
      const int64_t cols = std::min(kCols, n - (q + j) * kCols);
      if (cols == kCols) {
        _mm512_storeu_ps(row, out[r][j]);
      } else {
        alignas(64) float tmp[kCols];
        _mm512_store_ps(tmp, out[r][j]);
        std::copy(tmp, tmp + cols, row);
      }
    }
}

template <int R, typename W = float>
void gemv_panels(const float* x, int64_t ldx, const W* w, int64_t k, int64_t n, const float* bias, float* c,
                 int64_t ldc, int64_t p0, int64_t p1) {
  constexpr int G = R <= 2 ? 4 : 2;
  int64_t q = p0;
  for (; q + G <= p1; q += G) gemv_group<R, G, W>(x, ldx, w, k, n, bias, c, ldc, q);
  for (; q < p1; ++q) gemv_group<R, 1, W>(x, ldx, w, k, n, bias, c, ldc, q);
}

}  // namespace avx512
#ifndef ENGINE_EMULATE_AVX512
#pragma GCC pop_options
#endif
#endif  // ENGINE_AVX2

// out[M, N] = x[M, K] @ weight.T + bias, with the weight packed by pack_weight and bias padded to the panels.
// variant: kVariantAvx2, kVariantAvx512 or -1 (default_variant()): the same bits whichever runs.
void linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
            int64_t variant = -1) {
#ifdef ENGINE_AVX2
  if (variant < 0) variant = default_variant();
  TORCH_CHECK(cpu_has_variant(variant), "this CPU lacks the instructions of GEMM variant ", variant);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be float32 CPU rows with unit column stride");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kCols &&
                  packed.is_contiguous() && packed.size(1) == x.size(1),
              "packed weight must be [N/16, K, 16] float32 with K = x.size(1)");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), n = out.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == m &&
                  n > (panels - 1) * kCols && n <= panels * kCols,
              "out must be contiguous float32 [M, N] with N within the packed panels");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == panels * kCols,
                "bias must be float32, padded to the panels");
    bias_ptr = bias->data_ptr<float>();
  }
  if (m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    if (bias.has_value()) out.add_(bias->narrow(0, 0, n));
    return;
  }
  const float* w = packed.data_ptr<float>();
  if (variant == kVariantAvx512) {
    avx512::linear(out.data_ptr<float>(), n, x.data_ptr<float>(), x.stride(0), m, k, panels, bias_ptr, w);
    return;
  }
  linear_panels(out.data_ptr<float>(), n, x.data_ptr<float>(), x.stride(0), m, k, panels, bias_ptr,
                [w, k](int64_t q) { return w + q * k * kCols; });
#else
  TORCH_CHECK(false, "the engine_attention_cpu GEMM needs AVX2 + FMA (built without them)");
#endif
}

#ifdef ENGINE_AVX2
// R <= 4 rows against panels [p0, p1): each output one FMA chain over k in order per k chunk, the chunks added
// as the register tile adds them, so a row's result is the same bits as in a batched product. W: the panels'
// element type (float32, or 16-bit panels widened as they are read: the same products as their float32 panels).
template <int R, typename W = float>
void gemv_panels(const float* x, int64_t ldx, const W* w, int64_t k, int64_t n, const float* bias, float* c,
                 int64_t ldc, int64_t p0, int64_t p1) {
  const int64_t kc_max = chunk_size(k);
  for (int64_t q = p0; q < p1; ++q) {
    const int64_t cols = std::min(kCols, n - q * kCols);
    __m256 out0[R], out1[R];
    for (int r = 0; r < R; ++r) {
      out0[r] = bias ? _mm256_loadu_ps(bias + q * kCols) : _mm256_setzero_ps();
      out1[r] = bias ? _mm256_loadu_ps(bias + q * kCols + 8) : _mm256_setzero_ps();
    }
    for (int64_t k0 = 0; k0 < k; k0 += kc_max) {
      const int64_t kc = std::min(kc_max, k - k0);
      const W* panel = w + (q * k + k0) * kCols;
      __m256 a0[R], a1[R];
      for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < kc; ++i) {
        const __m256 b0 = load8(panel + i * kCols), b1 = load8(panel + i * kCols + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k0 + i);
          a0[r] = _mm256_fmadd_ps(xv, b0, a0[r]);
          a1[r] = _mm256_fmadd_ps(xv, b1, a1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        out0[r] = _mm256_add_ps(a0[r], out0[r]);
        out1[r] = _mm256_add_ps(a1[r], out1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float* row = c + r * ldc + q * kCols;
      if (cols == kCols) {
        _mm256_storeu_ps(row, out0[r]);
        _mm256_storeu_ps(row + 8, out1[r]);
      } else {
        alignas(32) float tmp[kCols];
        _mm256_store_ps(tmp, out0[r]);
        _mm256_store_ps(tmp + 8, out1[r]);
        std::copy(tmp, tmp + cols, row);
      }
    }
  }
}
#endif

// out [M, N] (contiguous float32) = rows [M, K] (float32, unit column stride) @ W.T (+ bias): up to 4 rows (decode)
// by the panels split between the spin pool's threads (no OpenMP wake-up per product), more through `linear`.
void forward_into(torch::Tensor out, const torch::Tensor& rows, const torch::Tensor& packed,
                  const c10::optional<torch::Tensor>& bias, int64_t n, int64_t variant) {
  if (variant < 0) variant = default_variant();
  const int64_t m = rows.size(0), k = rows.size(1);
#ifdef ENGINE_AVX2
  if (m >= 1 && m <= 4 && k > 0 && packed.dim() == 3 && packed.size(1) == k && packed.size(0) == (n + kCols - 1) / kCols &&
      packed.is_contiguous() && (!bias.has_value() || bias->numel() == packed.size(0) * kCols)) {
    const float* xs = rows.data_ptr<float>();
    const float* w = packed.data_ptr<float>();
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    float* c = out.data_ptr<float>();
    const int64_t ldx = rows.stride(0);
    engine_pool::parallel_range(packed.size(0), 8, [&](int64_t p0, int64_t p1) {
      if (variant == kVariantAvx512) {
        switch (m) {
          case 1: avx512::gemv_panels<1>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
          case 2: avx512::gemv_panels<2>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
          case 3: avx512::gemv_panels<3>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
          default: avx512::gemv_panels<4>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
        }
        return;
      }
      switch (m) {
        case 1: gemv_panels<1>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
        case 2: gemv_panels<2>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
        case 3: gemv_panels<3>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
        default: gemv_panels<4>(xs, ldx, w, k, n, b, c, n, p0, p1); break;
      }
    });
  } else
#endif
  {
    linear(out, rows, packed, bias, variant);
  }
}

// x [..., K] of any float dtype -> x @ W.T (+ bias) [..., N] in x's dtype, in one call (forward_into).
torch::Tensor forward(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n,
                      int64_t variant = -1) {
  if (variant < 0) variant = default_variant();
  TORCH_CHECK(cpu_has_variant(variant), "this CPU lacks the instructions of GEMM variant ", variant);
  const int64_t k = x.size(-1);
  torch::Tensor rows = x.reshape({-1, k});
  if (rows.scalar_type() != at::kFloat) rows = rows.to(at::kFloat);
  if (rows.stride(-1) != 1) rows = rows.contiguous();
  torch::Tensor out = at::empty({rows.size(0), n}, rows.options());
  forward_into(out, rows, packed, bias, n, variant);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  out = out.view(shape);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace engine_cpu

#ifndef ENGINE_KERNELS_NO_MODULE  // the decode graph (decode_graph.cpp) compiles this file in, bindings left out
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &engine_cpu::available, "True when built with the AVX2 + FMA kernels");
  m.def("pack_weight", &engine_cpu::pack_weight, "weight [N, K] as [ceil(N/16), K, 16] float32 panels");
  // without the GIL: an engine's other Python threads (API server, other engines) run during the product
  m.def("variants", &engine_cpu::variants, "[(variant, whether this CPU runs it)] in variant-id order");
  m.def("default_variant", &engine_cpu::default_variant, "the variant id a product runs when given -1");
  m.def("linear", &engine_cpu::linear, "out = x @ weight.T (+ bias) with a packed weight (float32, CPU)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("variant") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("forward", &engine_cpu::forward, "x [..., K] -> x @ W.T (+ bias) [..., N] in x's dtype (packed W)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("variant") = -1,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
#endif
