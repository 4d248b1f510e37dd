// ktcore_amx_bf16._ext: orchestration of the MoE expert kernels and the Python binding.
// Compiled with baseline x86-64 flags: importing this module and calling probe functions is safe on any
// CPU; AMX/AVX-512 code lives in kernels_amx.cpp and is reached only after amx_ready() said yes.
// Tensors cross as raw addresses (ints from torch's data_ptr()) plus sizes; nothing here links libtorch.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "ktcore/amx.hpp"
#include "ktcore/tensor_view.hpp"
#include "ktcore/thread_pool.hpp"

namespace py = pybind11;
using ktcore::ThreadPool;
using ktamx::KernelTable;
using ktamx::kBlockElems;

namespace {

template <class T>
T* P(uintptr_t a) { return reinterpret_cast<T*>(a); }

inline int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

std::once_flag g_amx_once;
std::string g_amx_reason = "not checked";

// "" when AMX may be used in this process (CPUID says so and the kernel granted tile permission)
const std::string& amx_ready() {
  std::call_once(g_amx_once, [] { g_amx_reason = ktcore::amx::request_permission(); });
  return g_amx_reason;
}

const KernelTable* kernels_for(const std::string& which) {
  if (which == "portable") return ktamx::portable_kernels();
  if (which == "amx") {
    const std::string& why = amx_ready();
    if (!why.empty()) throw std::runtime_error("amx_bf16 kernels unavailable: " + why);
    return ktamx::amx_kernels();
  }
  throw std::invalid_argument("kernels must be 'amx' or 'portable', not '" + which + "'");
}

int default_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

// Shapes of one layer's packed experts.
struct Dims {
  int64_t E, H, I, Hp, Ip;
  Dims(int64_t e, int64_t h, int64_t i) : E(e), H(h), I(i), Hp(rup(h, 32)), Ip(rup(i, 32)) {}
  // gate/up: W [Ip, Hp] -> NB = Ip/16 streams of KB = Hp/32 blocks; down: W [Hp, Ip]
  int64_t gu_nb() const { return Ip / 16; }
  int64_t gu_kb() const { return Hp / 32; }
  int64_t dn_nb() const { return Hp / 16; }
  int64_t dn_kb() const { return Ip / 32; }
  const uint16_t* gu_block(const uint16_t* w, int64_t e, int64_t nb, int64_t kb) const {
    return w + ((e * gu_nb() + nb) * gu_kb() + kb) * kBlockElems;
  }
  const uint16_t* dn_block(const uint16_t* w, int64_t e, int64_t nb, int64_t kb) const {
    return w + ((e * dn_nb() + nb) * dn_kb() + kb) * kBlockElems;
  }
};

struct Task {
  int32_t e, unit, units;  // output units [unit, unit + units) of expert e (units > 1 only in backward)
  int64_t r0, r1;          // rows [r0, r1) of expert e's rows
  int64_t p0;              // row r0 in the tiled buffers (each expert's rows padded to a multiple of 16)
};

constexpr int64_t kRowChunk = 256;  // rows of one expert computed per inner step (C scratch 32 KB)
constexpr int64_t kCBlock = kRowChunk * 32;
// Rows of one expert per task: a thread runs consecutive output blocks on the same rows, so those rows stay
// in its L2 (256 rows x 2048 x 2 B = 1 MB). Backward tasks take more rows: each derives transposed tiles.
constexpr int64_t kFwdTaskRows = 256;
constexpr int64_t kBwdTaskRows = 1024;
// Backward needs W^T: a task reads, from every stream, the blocks of its output units (at a stride of a whole
// stream). One 1 KiB block per stream costs a TLB miss per KiB and never ramps up the hardware prefetchers
// (~54 against ~95 GB/s), so a backward task covers up to kBwdGroup adjacent units: G contiguous KiB of every
// stream (a page's worth at G = 4). Fewer when a pool would get under kTasksPerThread tasks per thread (decode).
constexpr int64_t kBwdGroup = 4;
constexpr int64_t kTasksPerThread = 4;
// Rows that fit one 32-row group (small batches, the memory-bound layer) run the fused schedule: on chunks of
// kFusedSteps steps, each output unit transposes step after step into two small slots right before their tile
// products (KernelTable::gemm_transposing, which prefetches the blocks a step ahead), C staying in tiles. More
// rows transpose a whole part into the task's scratch, prefetching the pieces of step i + kPrefetchSteps into L1
// while transposing step i, then multiply every row chunk by it.
constexpr int64_t kFusedSteps = 8;
constexpr int64_t kPrefetchSteps = 2;

inline void prefetch_blocks_l1(const uint16_t* b, int64_t n) {
  for (int64_t l = 0; l < n * kBlockElems * 2; l += 64) __builtin_prefetch(reinterpret_cast<const char*>(b) + l, 0, 3);
}

// A backward task's steps: step i's pieces are piece(i, 0) and piece(i, 1), n blocks each (one per output
// unit); steps [0, split) and [split, steps) are separate parts (gate and up in bwd_gate_up): a run of products
// never crosses `split`. multiply(i0, i1, acc, ...) covers steps [i0, i1), adding to the partial sums when acc.

// Fused (one row group): multiply(i0, i1, acc, next) runs gemm_transposing for each output unit on a chunk of
// kFusedSteps steps, so the units of a task take their KiB of the same pieces close together in time. Each call
// is told where the following one starts (next(j): unit j + 1's KiB of this chunk's pieces, after the last unit
// the next chunk's), so its last step prefetches that call's first blocks; only a task's first step is not
// prefetched. Against reading a chunk's pieces first, then multiplying (the schedule before): memory-bound
// backward 23.7 -> 21.6 ms, DSV2 T=16 9.7 -> 8.8 ms (prefetching two steps ahead; RESULTS.md).
template <class Piece, class Multiply>
inline void multiply_fused(int64_t steps, int64_t split, int64_t n, const Piece& piece, const Multiply& multiply) {
  for (int64_t i0 = 0; i0 < steps;) {
    const int64_t end = std::min(steps, i0 + kFusedSteps), i1 = i0 < split && end > split ? split : end;
    auto next = [&](int64_t j) -> const uint16_t* {
      return j + 1 < n ? piece(i0, 0) + (j + 1) * kBlockElems : i1 < steps ? piece(i1, 0) : nullptr;
    };
    multiply(i0, i1, i0 > 0, next);
    i0 = i1;
  }
}

// More rows: transpose(i) writes step i's W^T blocks into the task's scratch (on the rows' first pass only:
// later row chunks find the scratch complete), then multiply runs over the whole part. The prefetch is one
// step's pieces per step: a burst of 64 KiB into L2 per 8 steps (an earlier schedule) held the transposes up
// behind the misses it queued (memory-bound gate/up: 2.3-2.5x a streaming read of its weights against 1.7-2.0x).
template <class Piece, class Transpose, class Multiply>
inline void transpose_then_multiply(int64_t steps, int64_t split, int64_t n, bool transposing, const Piece& piece,
                                    const Transpose& transpose, const Multiply& multiply) {
  auto prefetch = [&](int64_t i) {
    if (i >= steps) return;
    prefetch_blocks_l1(piece(i, 0), n);
    prefetch_blocks_l1(piece(i, 1), n);
  };
  if (transposing)
    for (int64_t i = 0; i < kPrefetchSteps; ++i) prefetch(i);
  for (int64_t i0 = 0; i0 < steps;) {
    const int64_t i1 = i0 < split ? split : steps;
    if (transposing)
      for (int64_t i = i0; i < i1; ++i) {
        prefetch(i + kPrefetchSteps);
        transpose(i);
      }
    multiply(i0, i1, i0 > 0);
    i0 = i1;
  }
}

class Engine {
 public:
  Engine(int num_threads, int num_pools, const std::string& kernels) : K_(kernels_for(kernels)) {
    if (num_threads <= 0) num_threads = default_threads();
    if (num_pools <= 0) num_pools = 1;
    if (num_pools > num_threads) num_pools = num_threads;
    for (int p = 0; p < num_pools; ++p) {
      int n = num_threads / num_pools + (p < num_threads % num_pools ? 1 : 0);
      pools_.emplace_back(new ThreadPool(n, p == 0));
      scratch_.emplace_back(n);
    }
  }

  int num_threads() const {
    int n = 0;
    for (auto& p : pools_) n += p->num_threads();
    return n;
  }
  int num_pools() const { return static_cast<int>(pools_.size()); }
  std::string kernels() const { return K_->name; }

  // -- packing ---------------------------------------------------------------------------------------
  // src bf16 [E, N, K] contiguous -> dst [E, rup(N,32)/16, rup(K,32)/32, 512]
  void pack(uintptr_t src_, int64_t E, int64_t N, int64_t Kd, uintptr_t dst_) {
    const uint16_t* src = P<const uint16_t>(src_);
    uint16_t* dst = P<uint16_t>(dst_);
    int64_t NB = rup(N, 32) / 16, KB = rup(Kd, 32) / 32;
    pools_[0]->parallel_for(E * NB, [&](int64_t b, int64_t e_, int) {
      for (int64_t t = b; t < e_; ++t) {
        int64_t e = t / NB, nb = t % NB;
        uint16_t* out = dst + t * KB * kBlockElems;
        for (int64_t kb = 0; kb < KB; ++kb, out += kBlockElems)
          for (int kp = 0; kp < 16; ++kp)
            for (int n = 0; n < 16; ++n)
              for (int j = 0; j < 2; ++j) {
                int64_t row = nb * 16 + n, col = kb * 32 + 2 * kp + j;
                out[kp * 32 + n * 2 + j] = (row < N && col < Kd) ? src[(e * N + row) * Kd + col] : 0;
              }
      }
    });
  }

  // -- routing: stable counting sort of the (token, slot) pairs by expert ------------------------------------
  // ids int64 [T*K], w fp32 [T*K]. Outputs: offsets [E+1] and padded offsets poff [E+1] (expert e's rows start
  // at poff[e] in the tiled buffers); for each row r (expert-major, then slot order): row_tok[r] (token),
  // order[r] (flat slot), w_row[r]; row_of[slot] = row or -1 (no expert). Returns R.
  int64_t route(uintptr_t ids_, int64_t T, int64_t Kk, int64_t E, uintptr_t w_, uintptr_t off_, uintptr_t poff_,
                uintptr_t row_tok_, uintptr_t row_of_, uintptr_t order_, uintptr_t w_row_) {
    const int64_t* ids = P<const int64_t>(ids_);
    const float* w = P<const float>(w_);
    int64_t* off = P<int64_t>(off_);
    int32_t *row_tok = P<int32_t>(row_tok_), *row_of = P<int32_t>(row_of_);
    int64_t* order = P<int64_t>(order_);
    float* w_row = P<float>(w_row_);
    const int64_t n = T * Kk;
    std::fill(off, off + E + 1, 0);
    for (int64_t i = 0; i < n; ++i)
      if (ids[i] >= 0 && ids[i] < E) ++off[ids[i] + 1];
    int64_t* poff = P<int64_t>(poff_);
    poff[0] = 0;
    for (int64_t e = 0; e < E; ++e) poff[e + 1] = poff[e] + rup(off[e + 1], 16);
    for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
    std::vector<int64_t> next(off, off + E);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = ids[i];
      if (e < 0 || e >= E) {
        row_of[i] = -1;
        continue;
      }
      const int64_t r = next[e]++;
      row_of[i] = static_cast<int32_t>(r);
      row_tok[r] = static_cast<int32_t>(i / Kk);
      order[r] = i;
      w_row[r] = w[i];
    }
    return off[E];
  }

  // -- row movement ------------------------------------------------------------------------------------
  // Row r of the tiled buffers for padded row pr, or -1 for a padding row.
  static int64_t source_row(int64_t pr, const int64_t* off, const int64_t* poff, int64_t E) {
    const int64_t e = std::upper_bound(poff, poff + E + 1, pr) - poff - 1;
    const int64_t i = pr - poff[e];
    return i < off[e + 1] - off[e] ? off[e] + i : -1;
  }

  // Fills a tiled buffer (cols columns, poff[E] rows) one 16-row group at a time: fill(r, row) writes source row r
  // (row-major, cols elements) into row; padding rows are zero. Whole 1 KiB tiles are written at once.
  template <class Fill>
  void fill_tiled(const int64_t* off, const int64_t* poff, int64_t E, int64_t cols, uint16_t* dst, Fill fill) {
    const int64_t kb = cols / 32;
    pools_[0]->parallel_for(poff[E] / 16, [&](int64_t b, int64_t e, int) {
      std::vector<uint16_t> rows(16 * cols);
      for (int64_t grp = b; grp < e; ++grp) {
        for (int i = 0; i < 16; ++i) {
          const int64_t r = source_row(16 * grp + i, off, poff, E);
          if (r >= 0)
            fill(r, rows.data() + i * cols);
          else
            std::fill(rows.data() + i * cols, rows.data() + (i + 1) * cols, 0);
        }
        uint16_t* out = dst + grp * kb * kBlockElems;
        for (int64_t k = 0; k < kb; ++k, out += kBlockElems)
          for (int i = 0; i < 16; ++i) std::memcpy(out + i * 32, rows.data() + i * cols + k * 32, 64);
      }
    });
  }

  // tiled dst (Hp columns, poff[E] rows): row r = bf16(src[tok[r], 0:H]), zero padded
  void gather(uintptr_t src, bool src_bf16, int64_t src_stride, int64_t H, int64_t Hp, uintptr_t off_,
              uintptr_t poff_, int64_t E, uintptr_t tok_, uintptr_t dst_) {
    const int32_t* tok = P<const int32_t>(tok_);
    const int64_t es = src_bf16 ? 2 : 4;
    fill_tiled(P<const int64_t>(off_), P<const int64_t>(poff_), E, Hp, P<uint16_t>(dst_), [&](int64_t r, uint16_t* row) {
      K_->row_to_bf16(reinterpret_cast<const char*>(src) + tok[r] * src_stride * es, src_bf16, H, Hp, row);
    });
  }

  // out[t] = sum_k wgt[t,k] * sum_p parts[p, row_of[t,k]]  (wgt null: weight 1); out fp32 or bf16
  void combine(uintptr_t parts_, int64_t nparts, int64_t R, int64_t H, uintptr_t row_of_, uintptr_t wgt_,
               int64_t T, int64_t Kk, uintptr_t out_, bool out_bf16) {
    const float* parts = P<const float>(parts_);
    const int32_t* row_of = P<const int32_t>(row_of_);
    const float* wgt = wgt_ ? P<const float>(wgt_) : nullptr;
    char* out = P<char>(out_);
    const int64_t es = out_bf16 ? 2 : 4;
    pools_[0]->parallel_for(T, [&](int64_t b, int64_t e, int tid) {
      std::vector<float> acc(H);
      for (int64_t t = b; t < e; ++t) {
        bool first = true;
        for (int64_t k = 0; k < Kk; ++k) {
          int32_t r = row_of[t * Kk + k];
          if (r < 0) continue;
          float w = wgt ? wgt[t * Kk + k] : 1.0f;
          for (int64_t p = 0; p < nparts; ++p) {
            K_->axpy(w, parts + (p * R + r) * H, acc.data(), H, first);
            first = false;
          }
        }
        if (first) std::fill(acc.begin(), acc.end(), 0.0f);
        K_->store_row(acc.data(), H, out + t * H * es, out_bf16);
      }
    }, 4);
  }

  // h[r] = bf16(silu(g[r]) * u[r]) (used when LoRA changed g/u after the GEMM)
  void silu_mul(uintptr_t g_, uintptr_t u_, int64_t R, int64_t I, int64_t Ip, uintptr_t h_, int64_t ldh) {
    const float* g = P<const float>(g_);
    const float* u = P<const float>(u_);
    uint16_t* h = P<uint16_t>(h_);
    pools_[0]->parallel_for(R, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        K_->silu_mul(g + r * I, u + r * I, I, h + r * ldh);
        std::fill(h + r * ldh + I, h + r * ldh + Ip, 0);
      }
    }, 16);
  }

  // -- forward GEMMs -------------------------------------------------------------------------------------
  // gate and up in one pass; fused: also h = silu(g) * u. g/u (fp32 [R, I]) saved when their address != 0.
  // xs: the gathered rows, tiled (Hp columns, padded rows)
  void gate_up(uintptr_t xs_, uintptr_t off_, uintptr_t poff_, uintptr_t gate_, uintptr_t up_, int64_t E, int64_t H,
               int64_t I, uintptr_t h_, uintptr_t g_, uintptr_t u_, bool fused, int64_t ldh) {
    Dims d(E, H, I);
    const uint16_t* xs = P<const uint16_t>(xs_);
    const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
    const ktamx::ALayout la = ktamx::ALayout::tiles(d.Hp);
    const uint16_t *gate = P<const uint16_t>(gate_), *up = P<const uint16_t>(up_);
    uint16_t* h = P<uint16_t>(h_);
    float *g = P<float>(g_), *u = P<float>(u_);
    // each pool owns a slice of I (in 32-column units, so that down's K split matches)
    run_split(off, poff, E, d.Ip / 32, /*split_units=*/true, [&](const Task& t, int pool, int tid, int64_t, int64_t) {
      const int64_t nb = t.unit;  // unit = one 16-column block of gate and of up
      const int64_t row0 = t.r0, m = t.r1 - t.r0;
      float* C = scratch_c(pool, tid);
      const int64_t ncol = std::min<int64_t>(16, I - nb * 16);
      for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
        int64_t mm = std::min(kRowChunk, m - m0);
        K_->gemm_block(xs + la.at(t.p0 + m0, 0), la, mm, d.gu_block(gate, t.e, nb, 0), d.gu_block(up, t.e, nb, 0),
                       d.gu_kb(), C, 32, 0);
        for (int64_t r = 0; r < mm; ++r) {
          const int64_t row = row0 + m0 + r;
          const float* c = C + r * 32;
          if (fused) K_->silu_mul(c, c + 16, 16, h + row * ldh + nb * 16);
          if (g && ncol > 0) {
            std::memcpy(g + row * I + nb * 16, c, ncol * 4);
            std::memcpy(u + row * I + nb * 16, c + 16, ncol * 4);
          }
        }
      }
    }, /*units_per_split_unit=*/2, 0, kFwdTaskRows);
  }

  // parts[p, r, 0:H] = h[r] @ down_e^T restricted to pool p's slice of I
  void down(uintptr_t h_, uintptr_t off_, uintptr_t down_, int64_t E, int64_t H, int64_t I, uintptr_t parts_,
            int64_t ldh) {
    Dims d(E, H, I);
    const uint16_t* h = P<const uint16_t>(h_);
    const int64_t* off = P<const int64_t>(off_);
    const uint16_t* dn = P<const uint16_t>(down_);
    float* parts = P<float>(parts_);
    const int64_t R = off[E];
    run_split(off, nullptr, E, d.Hp / 32, /*split_units=*/false, [&](const Task& t, int pool, int tid, int64_t kb0, int64_t kb1) {
      const int64_t np = t.unit;  // 32 output columns
      const int64_t row0 = t.r0, m = t.r1 - t.r0;
      float* C = scratch_c(pool, tid);
      float* out = parts + static_cast<int64_t>(pool) * R * H;
      const int64_t ncol = std::min<int64_t>(32, H - np * 32);
      if (kb1 <= kb0) {
        for (int64_t r = 0; r < m; ++r) std::memset(out + (row0 + r) * H + np * 32, 0, ncol * 4);
        return;
      }
      for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
        int64_t mm = std::min(kRowChunk, m - m0);
        K_->gemm_block(h + (row0 + m0) * ldh + kb0 * 32, ktamx::ALayout::rows(ldh), mm, d.dn_block(dn, t.e, 2 * np, kb0),
                       d.dn_block(dn, t.e, 2 * np + 1, kb0), kb1 - kb0, C, 32, 0);
        for (int64_t r = 0; r < mm; ++r) std::memcpy(out + (row0 + m0 + r) * H + np * 32, C + r * 32, ncol * 4);
      }
    }, 1, d.Ip / 32, kFwdTaskRows);
  }

  // -- backward ------------------------------------------------------------------------------------------
  // gh[r, 0:I] = gys[r] @ down_e   (down^T tiles derived per task from the packed down: no resident copy)
  // gys: the gathered output gradients, tiled like xs. Task: units = 32-column pieces of I = forward k-blocks
  // of down, so a group of units is a contiguous piece of every down stream.
  void bwd_down(uintptr_t gys_, uintptr_t off_, uintptr_t poff_, uintptr_t down_, int64_t E, int64_t H, int64_t I,
                uintptr_t gh_) {
    Dims d(E, H, I);
    const uint16_t* gys = P<const uint16_t>(gys_);
    const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
    const ktamx::ALayout la = ktamx::ALayout::tiles(d.Hp);
    const uint16_t* dn = P<const uint16_t>(down_);
    float* gh = P<float>(gh_);
    const int64_t nq = d.Hp / 32;
    run_split(off, poff, E, d.Ip / 32, /*split_units=*/true, [&](const Task& t, int pool, int tid, int64_t, int64_t) {
      const int64_t n = t.units, row0 = t.r0, m = t.r1 - t.r0;
      const bool fused = m <= 32;
      // fused: two slots per step of a chunk; else unit j's W^T streams: s + 2j * nq blocks (its first 16
      // columns), then nq blocks (the next 16)
      uint16_t* s = scratch_blocks(pool, tid, fused ? 2 * kFusedSteps : 2 * n * nq);
      float* C = scratch_c(pool, tid, n);  // unit j's sums at C + j * kCBlock
      const int64_t stream = d.dn_kb() * kBlockElems;
      auto piece = [&](int64_t q, int odd) { return d.dn_block(dn, t.e, 2 * q + odd, t.unit); };
      auto transpose = [&](int64_t q) {
        const uint16_t *fa = piece(q, 0), *fb = piece(q, 1);
        for (int64_t j = 0; j < n; ++j)
          K_->transpose_pair(fa + j * kBlockElems, fb + j * kBlockElems, s + (2 * j * nq + q) * kBlockElems,
                             s + ((2 * j + 1) * nq + q) * kBlockElems);
      };
      for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
        const int64_t mm = std::min(kRowChunk, m - m0);
        if (fused)
          multiply_fused(nq, nq, n, piece, [&](int64_t q0, int64_t q1, int acc, const auto& next) {
            for (int64_t j = 0; j < n; ++j)
              K_->gemm_transposing(gys + la.at(t.p0 + m0, q0 * 32), la, mm, piece(q0, 0) + j * kBlockElems, 2 * stream,
                                   stream, q1 - q0, C + j * kCBlock, 32, acc, s, next(j));
          });
        else
          transpose_then_multiply(nq, nq, n, m0 == 0, piece, transpose, [&](int64_t q0, int64_t q1, int acc) {
            for (int64_t j = 0; j < n; ++j) {
              const uint16_t* s0 = s + (2 * j * nq + q0) * kBlockElems;
              K_->gemm_block(gys + la.at(t.p0 + m0, q0 * 32), la, mm, s0, s0 + nq * kBlockElems, q1 - q0,
                             C + j * kCBlock, 32, acc);
            }
          });
        for (int64_t j = 0; j < n; ++j) {
          const int64_t p = t.unit + j, ncol = std::min<int64_t>(32, I - p * 32);
          for (int64_t r = 0; r < mm; ++r)
            std::memcpy(gh + (row0 + m0 + r) * I + p * 32, C + j * kCBlock + r * 32, ncol * 4);
        }
      }
    }, 1, 0, kBwdTaskRows, kBwdGroup);
  }

  // per row: grad_w[r] = dot(gh[r], h[r]); ggu[r] = [dL/dg | dL/du] (bf16, Ip each, tiled with padded rows like
  // xs; padding rows zero); ggu32 fp32 [R, 2I] if set
  void bwd_act(uintptr_t gh_, uintptr_t h_, uintptr_t g_, uintptr_t u_, uintptr_t wrow_, uintptr_t off_,
               uintptr_t poff_, int64_t E, int64_t I, uintptr_t ggu_, uintptr_t ggu32_, uintptr_t gradw_, int64_t ldh,
               uintptr_t order_) {
    const int64_t* order = P<const int64_t>(order_);
    const int64_t Ip = rup(I, 32);
    const float *gh = P<const float>(gh_), *g = P<const float>(g_), *u = P<const float>(u_);
    const float* wrow = P<const float>(wrow_);
    const uint16_t* h = P<const uint16_t>(h_);
    uint16_t* ggu = P<uint16_t>(ggu_);
    float* ggu32 = P<float>(ggu32_);
    float* gradw = P<float>(gradw_);
    fill_tiled(P<const int64_t>(off_), P<const int64_t>(poff_), E, 2 * Ip, ggu, [&](int64_t r, uint16_t* o) {
      std::fill(o, o + 2 * Ip, 0);
      gradw[order[r]] = K_->silu_mul_bwd(gh + r * I, h + r * ldh, g + r * I, u + r * I, I, wrow[r], o, o + Ip,
                                         ggu32 ? ggu32 + r * 2 * I : nullptr, ggu32 ? ggu32 + r * 2 * I + I : nullptr);
    });
  }

  // parts[p, r, 0:H] = ggu[r, gate part] @ gate_e + ggu[r, up part] @ up_e, over pool p's slice [q0, q1) of I
  // Task: units = 32 output columns of H = forward k-blocks of gate/up (a group: contiguous in every stream).
  void bwd_gate_up(uintptr_t ggu_, uintptr_t off_, uintptr_t poff_, uintptr_t gate_, uintptr_t up_, int64_t E,
                   int64_t H, int64_t I, uintptr_t parts_) {
    Dims d(E, H, I);
    const uint16_t* ggu = P<const uint16_t>(ggu_);
    const int64_t *off = P<const int64_t>(off_), *poff = P<const int64_t>(poff_);
    const ktamx::ALayout la = ktamx::ALayout::tiles(2 * d.Ip);
    const uint16_t *gate = P<const uint16_t>(gate_), *up = P<const uint16_t>(up_);
    float* parts = P<float>(parts_);
    const int64_t R = off[E];
    run_split(off, poff, E, d.Hp / 32, /*split_units=*/false, [&](const Task& t, int pool, int tid, int64_t q0, int64_t q1) {
      const int64_t n = t.units, row0 = t.r0, m = t.r1 - t.r0;
      float* out = parts + static_cast<int64_t>(pool) * R * H;
      const int64_t c0 = t.unit * 32, ncol = std::min<int64_t>(32 * n, H - c0);  // this task's columns of H
      if (q1 <= q0) {  // more pools than 32-column pieces of I: this pool's part is zero
        for (int64_t r = 0; r < m; ++r) std::memset(out + (row0 + r) * H + c0, 0, ncol * 4);
        return;
      }
      const int64_t nq = q1 - q0;
      const bool fused = m <= 32;
      // fused: two slots per step of a chunk; else unit j's W^T streams: s + 4j * nq blocks: gate then up (its
      // first 16 columns), then gate, up (the next 16)
      uint16_t* s = scratch_blocks(pool, tid, fused ? 2 * kFusedSteps : 4 * n * nq);
      float* C = scratch_c(pool, tid, n);  // unit j's sums at C + j * kCBlock
      const int64_t stream = d.gu_kb() * kBlockElems;
      // step i < nq: gate's streams 2q and 2q+1 (q = q0 + i); step nq + i: up's
      auto piece = [&](int64_t i, int odd) {
        return d.gu_block(i < nq ? gate : up, t.e, 2 * (q0 + i % nq) + odd, t.unit);
      };
      auto transpose = [&](int64_t i) {
        const uint16_t *fa = piece(i, 0), *fb = piece(i, 1);
        for (int64_t j = 0; j < n; ++j) {
          uint16_t* o = s + (4 * j * nq + i) * kBlockElems;
          K_->transpose_pair(fa + j * kBlockElems, fb + j * kBlockElems, o, o + 2 * nq * kBlockElems);
        }
      };
      auto col = [&](int64_t i) { return (i < nq ? 0 : d.Ip) + (q0 + i % nq) * 32; };  // ggu's gate or up column
      for (int64_t m0 = 0; m0 < m; m0 += kRowChunk) {
        const int64_t mm = std::min(kRowChunk, m - m0);
        if (fused)
          multiply_fused(2 * nq, nq, n, piece, [&](int64_t i0, int64_t i1, int acc, const auto& next) {
            for (int64_t j = 0; j < n; ++j)
              K_->gemm_transposing(ggu + la.at(t.p0 + m0, col(i0)), la, mm, piece(i0, 0) + j * kBlockElems, 2 * stream,
                                   stream, i1 - i0, C + j * kCBlock, 32, acc, s, next(j));
          });
        else
          transpose_then_multiply(2 * nq, nq, n, m0 == 0, piece, transpose, [&](int64_t i0, int64_t i1, int acc) {
            for (int64_t j = 0; j < n; ++j) {
              const uint16_t* s0 = s + (4 * j * nq + i0) * kBlockElems;
              K_->gemm_block(ggu + la.at(t.p0 + m0, col(i0)), la, mm, s0, s0 + 2 * nq * kBlockElems, i1 - i0,
                             C + j * kCBlock, 32, acc);
            }
          });
        for (int64_t j = 0; j < n; ++j) {
          const int64_t np = t.unit + j, nc = std::min<int64_t>(32, H - np * 32);
          for (int64_t r = 0; r < mm; ++r)
            std::memcpy(out + (row0 + m0 + r) * H + np * 32, C + j * kCBlock + r * 32, nc * 4);
        }
      }
    }, 1, d.Ip / 32, kBwdTaskRows, kBwdGroup);
  }

  // memset without waking torch's CPU threads
  void memzero(uintptr_t p, int64_t nbytes) {
    if (nbytes > 0) std::memset(P<char>(p), 0, nbytes);
  }

  // kernel micro-benchmark: every thread runs gemm_block on its own cache-resident A (m rows) and B (kb blocks)
  double bench_gemm(int64_t m, int64_t kb, int64_t iters) {
    ThreadPool& pool = *pools_[0];
    const int n = pool.num_threads();
    std::vector<double> secs(n, 0.0);
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const ktamx::ALayout la = ktamx::ALayout::tiles(kb * 32);
        std::vector<uint16_t> Av(rup(m, 32) * kb * 32 + 32, 0x3f80), Bv(2 * kb * kBlockElems + 32, 0x3c00);
        std::vector<float> Cv((m + 32) * 32 + 16);
        auto al = [](auto* p, uintptr_t esz) { return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / esz; };
        const uint16_t* A = al(Av.data(), 2);
        const uint16_t* B = al(Bv.data(), 2);
        float* C = al(Cv.data(), 4);
        K_->gemm_block(A, la, m, B, B + kb * kBlockElems, kb, C, 32, 0);
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t it = 0; it < iters; ++it) K_->gemm_block(A, la, m, B, B + kb * kBlockElems, kb, C, 32, 0);
        secs[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    });
    double worst = *std::max_element(secs.begin(), secs.end());
    return 2.0 * m * 32 * kb * 32 * iters * n / worst / 1e9;
  }

  // -- measurement ---------------------------------------------------------------------------------------
  double read_bandwidth(int64_t nbytes, int repeats) {
    nbytes = std::max<int64_t>(nbytes / 4096 * 4096, 1 << 20);
    void* buf = std::aligned_alloc(4096, nbytes);
    if (!buf) throw std::bad_alloc();
    std::unique_ptr<void, decltype(&std::free)> keep(buf, &std::free);
    char* c = static_cast<char*>(buf);
    const int n = pools_[0]->num_threads();
    pools_[0]->parallel_for(n, [&](int64_t b, int64_t e, int) {  // every page touched: the timed reads fault none
      for (int64_t i = b; i < e; ++i) std::memset(c + nbytes * i / n, 1, nbytes * (i + 1) / n - nbytes * i / n);
    });
    double best = 0.0;
    for (int rep = 0; rep < repeats; ++rep)
      best = std::max(best, nbytes / read_seconds(reinterpret_cast<uintptr_t>(buf), nbytes) / 1e9);
    return best;
  }

  // Seconds for every thread of pool 0 to stream-read its share of [addr, addr + nbytes) once (addr 64-byte
  // aligned, nbytes a multiple of 256). The benchmarks read a layer's own weights with it right before and after
  // the layer's call: on a shared VM whose bandwidth moves from minute to minute, a reading next to the call is
  // the closest yardstick it has.
  double read_seconds(uintptr_t addr, int64_t nbytes) {
    if (addr % 64 || nbytes % 256)
      throw std::invalid_argument("read_seconds: addr must be 64-byte aligned and nbytes a multiple of 256");
    ThreadPool& pool = *pools_[0];
    const int n = pool.num_threads();
    const int64_t blocks = nbytes / 256;
    volatile double sink = 0.0;
    auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t b0 = blocks * i / n, b1 = blocks * (i + 1) / n;
        sink = sink + K_->read_sum(P<const char>(addr) + b0 * 256, (b1 - b0) * 256);
      }
    });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  double amx_peak(double seconds) {
    if (std::string(K_->name) != "amx") throw std::runtime_error("measure_amx_peak_gflops needs the amx kernels");
    ThreadPool& pool = *pools_[0];
    const int n = pool.num_threads();
    std::vector<double> flops(n, 0.0);
    auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        double f = 0.0;
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds)
          f += K_->tile_loop(20000);
        flops[i] = f;
      }
    });
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0.0;
    for (double f : flops) total += f;
    return total / s / 1e9;
  }

 private:
  using TaskFn = std::function<void(const Task&, int pool, int tid, int64_t k0, int64_t k1)>;

  // Runs tasks (expert, rows, units) over all pools at once. With split_units the units are divided among the
  // pools (each pool its own slice of I, in groups of units_per_split_unit); otherwise every pool runs every
  // unit over its own slice [k0, k1) of ksplit blocks (partial sums, one output part per pool).
  // A task takes up to `group` consecutive units of its pool's units (the last one of a slice may take fewer);
  // fewer where the pool would get under kTasksPerThread tasks per thread.
  // poff (may be null): padded offsets of the tiled buffers, for Task::p0.
  void run_split(const int64_t* off, const int64_t* poff, int64_t E, int64_t nsplit, bool split_units, const TaskFn& fn,
                 int64_t units_per_split_unit = 1, int64_t ksplit = 0, int64_t task_rows = 0, int64_t group = 1) {
    const int npools = num_pools();
    std::vector<Task> rows;  // (expert, row range) pairs, the same in every pool
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = off[e + 1] - off[e];
      const int64_t step = task_rows > 0 ? task_rows : m;
      for (int64_t r = 0; r < m; r += step)
        rows.push_back({static_cast<int32_t>(e), 0, 0, off[e] + r, off[e] + std::min(m, r + step),
                        (poff ? poff[e] : 0) + r});
    }
    std::vector<std::vector<Task>> tasks(npools);
    std::vector<std::pair<int64_t, int64_t>> kr(npools);
    for (int p = 0; p < npools; ++p) {
      int64_t u0 = 0, u1 = nsplit * (split_units ? units_per_split_unit : 1);
      if (split_units) {
        u0 = nsplit * p / npools * units_per_split_unit;
        u1 = nsplit * (p + 1) / npools * units_per_split_unit;
      } else {
        kr[p] = {ksplit * p / npools, ksplit * (p + 1) / npools};
      }
      int64_t g = std::max<int64_t>(1, group);
      const int64_t want = kTasksPerThread * pools_[p]->num_threads();
      while (g > 1 && static_cast<int64_t>(rows.size()) * ((u1 - u0 + g - 1) / g) < want) --g;
      for (const Task& rt : rows)
        for (int64_t u = u0; u < u1; u += g) {
          Task t = rt;
          t.unit = static_cast<int32_t>(u);
          t.units = static_cast<int32_t>(std::min(g, u1 - u));
          tasks[p].push_back(t);
        }
    }
    std::vector<ThreadPool::Fn> fns(npools);
    for (int p = 0; p < npools; ++p) {
      fns[p] = [&, p](int64_t b, int64_t e, int tid) {
        for (int64_t i = b; i < e; ++i) fn(tasks[p][i], p, tid, kr[p].first, kr[p].second);
      };
    }
    for (int p = npools - 1; p >= 0; --p) pools_[p]->start(static_cast<int64_t>(tasks[p].size()), fns[p]);
    std::exception_ptr err;
    for (int p = 0; p < npools; ++p) {
      try {
        pools_[p]->join();
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
  }

  struct Scratch {
    std::vector<float> c;
    std::vector<uint16_t> s;
  };

  // room for `count` C blocks of kCBlock floats (kRowChunk rows x 32)
  float* scratch_c(int pool, int tid, int64_t count = 1) {
    auto& c = scratch_[pool][tid].c;
    if (c.size() < static_cast<size_t>(count * kCBlock + 64)) c.resize(count * kCBlock + 64);
    float* base = c.data();
    return base + (16 - (reinterpret_cast<uintptr_t>(base) / 4) % 16) % 16;  // 64-byte aligned tile rows
  }
  // room for `blocks` 1 KiB blocks, 64-byte aligned; per thread, grows to the largest request and is kept
  uint16_t* scratch_blocks(int pool, int tid, int64_t blocks) {
    auto& s = scratch_[pool][tid].s;
    size_t need = static_cast<size_t>(blocks * kBlockElems + 32);
    if (s.size() < need) s.resize(need);
    uint16_t* base = s.data();
    return base + (32 - (reinterpret_cast<uintptr_t>(base) / 2) % 32) % 32;  // 64-byte align
  }

  const KernelTable* K_;
  std::vector<std::unique_ptr<ThreadPool>> pools_;
  std::vector<std::vector<Scratch>> scratch_;
};

std::unique_ptr<Engine> g_measure_engine;
std::mutex g_measure_mu;

Engine& measure_engine(const std::string& kernels) {
  std::lock_guard<std::mutex> lk(g_measure_mu);
  if (!g_measure_engine || g_measure_engine->kernels() != kernels)
    g_measure_engine.reset(new Engine(default_threads(), 1, kernels));
  return *g_measure_engine;
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "amx_bf16 expert kernels (AMX BF16 tiles + AVX-512); no libtorch";
  m.def("amx_unavailable_reason", [] { return amx_ready(); },
        "'' when this process may use AMX (CPUID + arch_prctl permission), else the reason");
  m.def("cpu_supports_amx", [] {
    auto f = ktcore::amx::cpu_features();
    return f.amx_tile && f.amx_bf16 && f.avx512f && f.avx512_bf16 && f.os_avx512;
  });
  m.def("measure_amx_peak_gflops", [](double seconds) {
    py::gil_scoped_release nogil;
    return measure_engine("amx").amx_peak(seconds);
  }, py::arg("seconds") = 1.0, "AMX BF16 tile-only peak over all cores, GFLOP/s (raises without AMX)");
  m.def("measure_read_bandwidth", [](int64_t nbytes) {
    py::gil_scoped_release nogil;
    std::string k = amx_ready().empty() ? "amx" : "portable";
    return measure_engine(k).read_bandwidth(nbytes, 5);
  }, py::arg("nbytes") = int64_t(1) << 31, "DRAM streaming read bandwidth over all cores, GB/s (best of 5)");
  m.def("default_threads", &default_threads);

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<Engine>(m, "Engine")
      .def(py::init<int, int, const std::string&>(), py::arg("num_threads") = 0, py::arg("num_pools") = 1,
           py::arg("kernels") = "amx")
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("num_pools", &Engine::num_pools)
      .def_property_readonly("kernels", &Engine::kernels)
      .def("pack", &Engine::pack, G())
      .def("route", &Engine::route, G())
      .def("gather", &Engine::gather, G())
      .def("combine", &Engine::combine, G())
      .def("silu_mul", &Engine::silu_mul, G())
      .def("gate_up", &Engine::gate_up, G())
      .def("down", &Engine::down, G())
      .def("bwd_down", &Engine::bwd_down, G())
      .def("bwd_act", &Engine::bwd_act, G())
      .def("bwd_gate_up", &Engine::bwd_gate_up, G())
      .def("memzero", &Engine::memzero, G())
      .def("bench_gemm", &Engine::bench_gemm, G())
      .def("read_bandwidth", &Engine::read_bandwidth, G())
      .def("read_seconds", &Engine::read_seconds, G())
      .def("amx_peak", &Engine::amx_peak, G());
}
