// Backward-schedule harness for amx_bf16's input gradient through gate/up (bwd_gate_up): times, on all threads,
// the memory-bound layer's transposing tasks (read 4 KiB pieces of every stream, transpose them into W^T tiles,
// multiply) under different prefetch schedules and two packed layouts, next to a plain streaming read of the same
// bytes and the forward's whole-K loop over them (figures in RESULTS.md). Standalone, needs an AMX CPU:
//   g++ -O3 -march=sapphirerapids -fopenmp -Ibackends/amx_bf16/src -Iktcore/include benchmarks/amx_bwd_variants.cpp -o bv
//   OMP_NUM_THREADS=16 OMP_PROC_BIND=close ./bv [experts=128] [reps=7]
// Exits 1 when a variant's gradient differs from the first variant's.
// Every expert gets 32 rows (the memory-bound layer: T=512, K=8, E=128).
// Layouts: "streams" is the backend's (expert, 16-output stream, k-block); "grouped" stores, per group of 4
// k-blocks, every stream's 4 KiB piece next to the previous stream's, so a backward task reads one contiguous run.
// "old transpose" is the 16 x 16 dword transpose + word permutes the backend used before its lane-gathering
// transpose_pair; "cached" variants re-read one task's pieces (L2-resident): their time is the arithmetic alone;
// "staged" reads each chunk's pieces (loads only) before transposing them, so misses and arithmetic do not mix.
// "fused" variants run gemm_transposing per output unit on chunks of steps: "backend kernel" is the backend's own
// (prefetching a step ahead, "carry": into the next call's first steps); "in-kernel" ones are a local copy with
// the prefetch distance and hint as named; "staged" fused ones use that copy without prefetch (shipped before).
// "direct" variants transpose nothing: they multiply the forward blocks as A tiles by a zero-padded expansion of
// the output gradient (half the tile products multiply zeros).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

// the backend's kernels (transpose_pair, the tile configuration) compiled into this file
#include "kernels_amx.cpp"
using ktamx::amxk::ensure_tile_config;
using ktamx::amxk::transpose_pair;

// the backend's transpose_pair until 2026-12-03: two 16 x 16 dword transposes, then word permutes
static void transpose_pair_old(const uint16_t* fa, const uint16_t* fb, uint16_t* out0, uint16_t* out1) {
  __m512i r[2][16];
  for (int i = 0; i < 16; ++i) {
    r[0][i] = _mm512_loadu_si512(fa + i * 32);
    r[1][i] = _mm512_loadu_si512(fb + i * 32);
  }
  for (auto& x : r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
      __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
      __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
      x[c] = _mm512_shuffle_i32x4(v, v2, 0x88); x[8 + c] = _mm512_shuffle_i32x4(v, v2, 0xDD);
      x[4 + c] = _mm512_shuffle_i32x4(w, w2, 0x88); x[12 + c] = _mm512_shuffle_i32x4(w, w2, 0xDD);
    }
  }
  alignas(64) uint16_t idx0[32], idx1[32];
  for (int kk = 0; kk < 16; ++kk)
    for (int j = 0; j < 2; ++j) {
      idx0[2 * kk + j] = static_cast<uint16_t>((j ? 32 : 0) + kk);
      idx1[2 * kk + j] = static_cast<uint16_t>((j ? 32 : 0) + 16 + kk);
    }
  const __m512i i0 = _mm512_load_si512(idx0), i1 = _mm512_load_si512(idx1);
  for (int np = 0; np < 16; ++np) {
    const __m512i lo = r[np / 8][2 * (np % 8)], hi = r[np / 8][2 * (np % 8) + 1];
    _mm512_storeu_si512(out0 + np * 32, _mm512_permutex2var_epi16(lo, i0, hi));
    _mm512_storeu_si512(out1 + np * 32, _mm512_permutex2var_epi16(lo, i1, hi));
  }
}

constexpr int64_t KBLK = 512;  // 16 x 32 bf16 = 1 KiB
constexpr int64_t H = 2048, I = 768, KB = H / 32, NB = I / 16, NQ = I / 32, G = 4, STEPS = 2 * NQ;
constexpr int64_t M = 32;
int64_t E = 128;

// block kb of stream nb of expert e
static inline const uint16_t* block(const uint16_t* w, bool grouped, int64_t e, int64_t nb, int64_t kb) {
  if (!grouped) return w + ((e * NB + nb) * KB + kb) * KBLK;
  return w + (((e * (KB / G) + kb / G) * NB + nb) * G + kb % G) * KBLK;
}

// C[32, 32] (+)= A (two 16-row tile groups, a k-block per KiB, group stride ga) x n B k-blocks (B0, B1 streams)
static inline void gemm32(const uint16_t* a0, int64_t ga, const uint16_t* B0, const uint16_t* B1, int64_t n,
                          float* C, bool acc) {
  if (acc) {
    _tile_loadd(0, C, 128); _tile_loadd(1, C + 16, 128); _tile_loadd(2, C + 512, 128); _tile_loadd(3, C + 528, 128);
  } else {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  }
  for (int64_t k = 0; k < n; ++k) {
    _tile_loadd(4, a0 + k * KBLK, 64);
    _tile_loadd(6, B0 + k * KBLK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, B1 + k * KBLK, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a0 + ga + k * KBLK, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, 128); _tile_stored(1, C + 16, 128); _tile_stored(2, C + 512, 128); _tile_stored(3, C + 528, 128);
}

// the backend's gemm_transposing (32 rows) with the forward's prefetch: step k + dist's two forward blocks
// (16 lines each) are prefetched while step k is transposed and multiplied
static void gemm_transposing_pf(const uint16_t* A, int64_t group, const uint16_t* f, int64_t stride, int64_t odd,
                                int64_t steps, float* C, int acc, uint16_t* slots, int dist, int hint,
                                const uint16_t* next = nullptr, int lines = 16) {
  const uint16_t *a0 = A, *a1 = A + group;
  if (!acc) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  } else {
    _tile_loadd(0, C, 128); _tile_loadd(1, C + 16, 128); _tile_loadd(2, C + 512, 128); _tile_loadd(3, C + 528, 128);
  }
  for (int64_t k = 0; k < steps; ++k) {
    // the call after this one starts at `next` (same stride): its first steps are prefetched by this one's last
    const uint16_t* pf = k + dist < steps ? f + (k + dist) * stride
                         : next          ? next + (k + dist - steps) * stride
                                         : nullptr;
    if (pf) {
      const char* p0 = reinterpret_cast<const char*>(pf);
      const char* p1 = reinterpret_cast<const char*>(pf + odd);
      for (int l = 0; l < 1024; l += 1024 / lines) {
        if (hint == 0) { _mm_prefetch(p0 + l, _MM_HINT_T0); _mm_prefetch(p1 + l, _MM_HINT_T0); }
        else { _mm_prefetch(p0 + l, _MM_HINT_T1); _mm_prefetch(p1 + l, _MM_HINT_T1); }
      }
    }
    uint16_t* o = slots + (k & 1) * 2 * KBLK;
    transpose_pair(f + k * stride, f + k * stride + odd, o, o + KBLK);
    _tile_loadd(4, a0 + k * KBLK, 64);
    _tile_loadd(6, o, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, o + KBLK, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * KBLK, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, 128); _tile_stored(1, C + 16, 128); _tile_stored(2, C + 512, 128); _tile_stored(3, C + 528, 128);
}

enum class Pf { burst_l2, spread_l2, spread_l1, staged, none, in_kernel };
// what a task does with its pieces: read every line only, transpose them only, multiply a stale scratch only
// (the pieces still pass through L1), transpose and multiply into a scratch as the backend does above 32 rows,
// or "fused" as it does up to 32: per output unit, each step is transposed into one of two 2 KiB slots right
// before its tile products (the backend's gemm_transposing; streams layout only)
enum class Work { read, transpose, multiply, both, fused };
struct Variant {
  const char* name;
  bool grouped;
  Pf pf;
  int dist;        // steps ahead (spread)
  Work work;
  int chunk = 8;   // steps transposed before they are multiplied
  bool old_transpose = false;
  bool cached = false;  // every task reads expert 0's first pieces
  int hint = 0;         // in_kernel: 0 = T0, 1 = T1
  bool carry = false;   // in_kernel: a call prefetches the next call's first steps
  int lines = 16;       // in_kernel: lines prefetched per block
};

// the variants whose outputs are the layer's gradient (to be compared with the first one's)
static bool computes(const Variant& v) { return (v.work == Work::both || v.work == Work::fused) && !v.cached; }

struct Bufs {
  uint16_t *gate, *up, *ggu;  // ggu: per expert 2 groups x STEPS k-blocks (tile order)
  float* out;                 // [E * M, H]
};

static void prefetch_piece(const uint16_t* p, int hint) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t l = 0; l < G * KBLK * 2; l += 64) {
    if (hint == 1) _mm_prefetch(c + l, _MM_HINT_T1); else _mm_prefetch(c + l, _MM_HINT_T0);
  }
}

// one backward task: expert e, output units [g*G, g*G+G) (128 columns of H)
static __m512i bwd_task(const Bufs& b, const Variant& v, int64_t e, int64_t g, uint16_t* s, float* C) {
  auto piece = [&](int64_t i, int odd) {
    return v.cached ? block(i < NQ ? b.gate : b.up, v.grouped, 0, 2 * (i % NQ) + odd, 0)
                    : block(i < NQ ? b.gate : b.up, v.grouped, e, 2 * (i % NQ) + odd, g * G);
  };
  auto read_step = [&](int64_t i, __m512i& sink) {
    const uint16_t *fa = piece(i, 0), *fb = piece(i, 1);
    for (int64_t l = 0; l < G * KBLK; l += 32)
      sink = _mm512_add_epi64(sink, _mm512_add_epi64(_mm512_loadu_si512(fa + l), _mm512_loadu_si512(fb + l)));
  };
  const auto tp = v.old_transpose ? transpose_pair_old : transpose_pair;
  __m512i sink = _mm512_setzero_si512();
  auto pf_step = [&](int64_t i, int hint) {
    if (i < STEPS) { prefetch_piece(piece(i, 0), hint); prefetch_piece(piece(i, 1), hint); }
  };
  const int hint = v.pf == Pf::spread_l1 ? 0 : 1;
  if (v.pf == Pf::spread_l2 || v.pf == Pf::spread_l1)
    for (int64_t i = 0; i < v.dist; ++i) pf_step(i, hint);
  const uint16_t* a = b.ggu + e * 2 * STEPS * KBLK;
  const int64_t chunk = v.chunk;
  if (v.pf == Pf::burst_l2) for (int64_t i = 0; i < chunk; ++i) pf_step(i, 1);
  for (int64_t i0 = 0; i0 < STEPS; i0 += chunk) {
    const int64_t i1 = std::min(STEPS, i0 + chunk);
    if (v.pf == Pf::burst_l2) for (int64_t i = i1; i < i1 + chunk; ++i) pf_step(i, 1);
    if (v.pf == Pf::staged && v.work != Work::read)
      for (int64_t i = i0; i < i1; ++i) read_step(i, sink);
    if (v.work == Work::fused) {  // the backend's kernel (transpose_pair inside: no old-transpose variant)
      const ktamx::ALayout la = ktamx::ALayout::tiles(STEPS * 32);
      for (int64_t j = 0; j < G; ++j) {
        for (int64_t k0 = i0; k0 < i1;) {  // a run of steps in one matrix (the stride changes at NQ)
          const int64_t k1 = k0 < NQ ? std::min(i1, NQ) : i1;
          // the next call: the next unit's same run, else the next run's first unit
          const uint16_t* next = !v.carry ? nullptr
                                 : k1 < i1 ? piece(k1, 0) + j * KBLK
                                 : j + 1 < G ? piece(i0, 0) + (j + 1) * KBLK
                                 : i1 < STEPS ? piece(i1, 0) : nullptr;
          if (v.pf == Pf::in_kernel || v.pf == Pf::staged)  // staged: the kernel as shipped before, no prefetch
            gemm_transposing_pf(a + k0 * KBLK, STEPS * KBLK, piece(k0, 0) + j * KBLK, 2 * KB * KBLK, KB * KBLK,
                                k1 - k0, C + j * 1024, k0 > 0, s, v.pf == Pf::staged ? 1 << 20 : v.dist, v.hint,
                                next, v.lines);
          else
            ktamx::amxk::gemm_transposing(a + k0 * KBLK, la, M, piece(k0, 0) + j * KBLK, 2 * KB * KBLK, KB * KBLK,
                                          k1 - k0, C + j * 1024, 32, k0 > 0, s, next);
          k0 = k1;
        }
      }
      continue;
    }
    for (int64_t i = i0; i < i1; ++i) {
      if (v.pf == Pf::spread_l2 || v.pf == Pf::spread_l1) pf_step(i + v.dist, hint);
      if (v.work == Work::read || v.work == Work::multiply) {
        read_step(i, sink);
        continue;
      }
      const uint16_t *fa = piece(i, 0), *fb = piece(i, 1);
      for (int64_t j = 0; j < G; ++j) {
        uint16_t* o = s + (4 * j * NQ + i) * KBLK;
        tp(fa + j * KBLK, fb + j * KBLK, o, o + 2 * NQ * KBLK);
      }
    }
    if (v.work == Work::read || v.work == Work::transpose) continue;
    for (int64_t j = 0; j < G; ++j) {
      const uint16_t* s0 = s + (4 * j * NQ + i0) * KBLK;
      gemm32(a + i0 * KBLK, STEPS * KBLK, s0, s0 + 2 * NQ * KBLK, i1 - i0, C + j * 1024, i0 > 0);
    }
  }
  if (v.work == Work::both || v.work == Work::multiply || v.work == Work::fused)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t r = 0; r < M; ++r)
        std::memcpy(b.out + (e * M + r) * H + (g * G + j) * 32, C + j * 1024 + r * 32, 128);
  return sink;
}

// forward-like task: output stream pair p of gate (p < NB/2) or up over the whole K, prefetch 8 blocks ahead
static void fwd_task(const Bufs& b, bool grouped, int64_t e, int64_t p, float* C) {
  const uint16_t* w = p < NB / 2 ? b.gate : b.up;
  const int64_t nb = 2 * (p % (NB / 2));
  const uint16_t* a = b.ggu + e * 2 * STEPS * KBLK;  // stands in for x (same tile order)
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < KB; ++k) {
    if (k + 8 < KB) {
      const char* p0 = reinterpret_cast<const char*>(block(w, grouped, e, nb, k + 8));
      const char* p1 = reinterpret_cast<const char*>(block(w, grouped, e, nb + 1, k + 8));
      for (int l = 0; l < 1024; l += 64) { _mm_prefetch(p0 + l, _MM_HINT_T0); _mm_prefetch(p1 + l, _MM_HINT_T0); }
    }
    _tile_loadd(4, a + (k % STEPS) * KBLK, 64);
    _tile_loadd(6, block(w, grouped, e, nb, k), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, block(w, grouped, e, nb + 1, k), 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + STEPS * KBLK + (k % STEPS) * KBLK, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, 128); _tile_stored(1, C + 16, 128); _tile_stored(2, C + 512, 128); _tile_stored(3, C + 528, 128);
}

// ---- direct: no transpose. A forward block (stream s, k-block kb) is used as the A tile: row kp, pair (i, par)
// = W[i][32 kb + 2 kp + par]. With B[(i, par)][(t, par')] = ggu[t][i] when par == par' (else 0), the product
// C[kp][(t, par')] = dx[t][32 kb + 2 kp + par'] for 8 tokens t: half the products multiply zeros, nothing is
// transposed. bx: the expert's ggu expanded that way, tile (s, tg) at (s * M/8 + tg) KiB, s = gate streams, up's.
static void expand_ggu(const uint16_t* a, uint16_t* bx) {
  for (int64_t s = 0; s < 2 * NB; ++s) {
    const int64_t col = (s < NB ? 0 : I) + 16 * (s % NB);
    for (int64_t tg = 0; tg < M / 8; ++tg) {
      uint16_t* o = bx + (s * (M / 8) + tg) * KBLK;
      for (int r = 0; r < 16; ++r)
        for (int t = 0; t < 8; ++t) {
          const int64_t tok = tg * 8 + t, c = col + r;
          const uint16_t v = a[(tok / 16) * STEPS * KBLK + (c / 32) * KBLK + (tok % 16) * 32 + c % 32];
          uint16_t* w = o + r * 32 + t * 4;
          w[0] = v; w[1] = 0; w[2] = 0; w[3] = v;
        }
    }
  }
}

// k-blocks [k0, k1) of expert e; pf 0: none, 1: the stream's next k-block into L2, 2: stream s+4's block into L1
static void direct_task(const Bufs& b, int pf, int64_t e, int64_t k0, int64_t k1, uint16_t* bx, float* Cs) {
  expand_ggu(b.ggu + e * 2 * STEPS * KBLK, bx);
  for (int64_t kb = k0; kb < k1; ++kb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = 0; s < 2 * NB; ++s) {
      const uint16_t* w = s < NB ? b.gate : b.up;
      const uint16_t* A = block(w, false, e, s % NB, kb);
      if (pf == 1 && kb + 1 < k1) prefetch_piece(A + KBLK, 1);  // prefetches G KiB: the rest of the piece
      if (pf == 2 && s + 4 < 2 * NB) {
        const char* c = reinterpret_cast<const char*>(block(s + 4 < NB ? b.gate : b.up, false, e, (s + 4) % NB, kb));
        for (int l = 0; l < 1024; l += 64) _mm_prefetch(c + l, _MM_HINT_T0);
      }
      const uint16_t* B = bx + s * (M / 8) * KBLK;
      _tile_loadd(4, A, 64);
      _tile_loadd(5, B, 64);
      _tile_loadd(6, B + KBLK, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(7, B + 2 * KBLK, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, B + 3 * KBLK, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, Cs, 64); _tile_stored(1, Cs + 256, 64); _tile_stored(2, Cs + 512, 64); _tile_stored(3, Cs + 768, 64);
    for (int64_t tg = 0; tg < 4; ++tg)
      for (int64_t t = 0; t < 8; ++t) {
        float* o = b.out + (e * M + tg * 8 + t) * H + 32 * kb;
        for (int kp = 0; kp < 16; ++kp) std::memcpy(o + 2 * kp, Cs + tg * 256 + kp * 16 + 2 * t, 8);
      }
  }
}

static double time_parallel(int64_t ntasks, const std::function<void(int64_t, uint16_t*, float*)>& task) {
  double t0 = 0, t1 = 0;
#pragma omp parallel
  {
    ensure_tile_config();
    std::vector<uint16_t> s(4 * G * NQ * KBLK + 64);
    std::vector<float> C(G * 1024 + 16);
    uint16_t* sp = s.data() + (32 - (reinterpret_cast<uintptr_t>(s.data()) / 2) % 32) % 32;
    float* cp = C.data() + (16 - (reinterpret_cast<uintptr_t>(C.data()) / 4) % 16) % 16;
    std::memset(sp, 0, 4 * G * NQ * KBLK * 2);
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) task(t, sp, cp);
#pragma omp master
    t1 = omp_get_wtime();
  }
  return t1 - t0;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { std::puts("no AMX permission"); return 1; }
  if (argc > 1) E = std::atoll(argv[1]);
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const int64_t wbytes = E * NB * KB * KBLK * 2;  // one matrix
  std::printf("E=%ld H=%ld I=%ld rows/expert=%ld threads=%d, gate+up %.0f MiB per layout\n", E, H, I, M,
              omp_get_max_threads(), 2.0 * wbytes / (1 << 20));
  Bufs plain{}, grouped{};
  auto alloc = [&](int64_t bytes) {
    const int64_t rounded = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    void* p = std::aligned_alloc(2 << 20, rounded);
    madvise(p, rounded, MADV_HUGEPAGE);  // as the backend's packed weights (ktcore.hugepages)
    std::memset(p, 0, bytes);
    return static_cast<uint16_t*>(p);
  };
  plain.gate = alloc(wbytes); plain.up = alloc(wbytes);
  grouped.gate = alloc(wbytes); grouped.up = alloc(wbytes);
  uint16_t* ggu = alloc(E * 2 * STEPS * KBLK * 2);
  float* out = reinterpret_cast<float*>(alloc(E * M * H * 4));
  uint32_t seed = 1;
  auto rnd = [&]() { seed = seed * 1664525u + 1013904223u; return static_cast<uint16_t>(0x3c00 + (seed >> 25)); };
  for (int64_t i = 0; i < E * 2 * STEPS * KBLK; ++i) ggu[i] = rnd();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint16_t* pg = const_cast<uint16_t*>(block(plain.gate, false, e, nb, kb));
        uint16_t* gg = const_cast<uint16_t*>(block(grouped.gate, true, e, nb, kb));
        uint16_t* pu = const_cast<uint16_t*>(block(plain.up, false, e, nb, kb));
        uint16_t* gu = const_cast<uint16_t*>(block(grouped.up, true, e, nb, kb));
        for (int64_t x = 0; x < KBLK; ++x) {
          pg[x] = gg[x] = rnd();
          pu[x] = gu[x] = rnd();
        }
      }
  plain.ggu = grouped.ggu = ggu;
  plain.out = grouped.out = out;

  // streaming read of both matrices (one layout), 16 KiB per task
  auto read_all = [&]() {
    const int64_t n = 2 * wbytes / 16384;
    return time_parallel(n, [&](int64_t t, uint16_t*, float*) {
      const uint16_t* p = (t < n / 2 ? plain.gate : plain.up) + (t % (n / 2)) * 8192;
      __m512i s0 = _mm512_setzero_si512(), s1 = s0;
      for (int64_t l = 0; l < 8192; l += 64) {
        s0 = _mm512_add_epi64(s0, _mm512_load_si512(p + l));
        s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + l + 32));
      }
      if (_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1)) == 42) std::puts("");
    });
  };
  const Variant variants[] = {
      {"streams, spread L1 d=2 (shipped before)", false, Pf::spread_l1, 2, Work::both},
      {"  same, old transpose", false, Pf::spread_l1, 2, Work::both, 8, true},
      {"streams, burst L2, old transpose", false, Pf::burst_l2, 0, Work::both, 8, true},
      {"streams, no prefetch", false, Pf::none, 0, Work::both},
      {"streams, spread L1 d=1", false, Pf::spread_l1, 1, Work::both},
      {"streams, spread L2 d=4", false, Pf::spread_l2, 4, Work::both},
      {"streams, staged, chunk 8", false, Pf::staged, 0, Work::both},
      {"streams, staged, chunk 2", false, Pf::staged, 0, Work::both, 2},
      {"grouped, no prefetch", true, Pf::none, 0, Work::both},
      {"grouped, staged, chunk 8", true, Pf::staged, 0, Work::both},
      {"fused, staged, chunk 8 (shipped before)", false, Pf::staged, 0, Work::fused},
      {"fused, backend kernel, chunk 8, carry (now shipped)", false, Pf::none, 0, Work::fused, 8, false, false, 0,
       true},
      {"fused, backend kernel, chunk 8, no carry", false, Pf::none, 0, Work::fused, 8},
      {"fused, staged, chunk 2", false, Pf::staged, 0, Work::fused, 2},
      {"fused, whole task, in-kernel T0 d=2", false, Pf::in_kernel, 2, Work::fused, STEPS, false, false, 0},
      {"fused, chunk 8, in-kernel T0 d=2", false, Pf::in_kernel, 2, Work::fused, 8, false, false, 0},
      {"fused, chunk 8, in-kernel T0 d=1", false, Pf::in_kernel, 1, Work::fused, 8, false, false, 0},
      {"fused, chunk 8, in-kernel T0 d=3", false, Pf::in_kernel, 3, Work::fused, 8, false, false, 0},
      {"fused, chunk 4, in-kernel T0 d=2", false, Pf::in_kernel, 2, Work::fused, 4, false, false, 0},
      {"fused, chunk 16, in-kernel T0 d=2", false, Pf::in_kernel, 2, Work::fused, 16, false, false, 0},
      {"fused, chunk 8, in-kernel T1 d=2", false, Pf::in_kernel, 2, Work::fused, 8, false, false, 1},
      {"fused, chunk 8, in-kernel T0 d=2, 8 lines", false, Pf::in_kernel, 2, Work::fused, 8, false, false, 0, false, 8},
      {"fused, chunk 8, in-kernel T0 d=2, carry", false, Pf::in_kernel, 2, Work::fused, 8, false, false, 0, true},
      {"fused, chunk 8, in-kernel T0 d=1, carry", false, Pf::in_kernel, 1, Work::fused, 8, false, false, 0, true},
      {"fused, chunk 4, in-kernel T0 d=2, carry", false, Pf::in_kernel, 2, Work::fused, 4, false, false, 0, true},
      {"fused, whole task, backend kernel", false, Pf::none, 0, Work::fused, STEPS},
      {"cached: fused", false, Pf::none, 0, Work::fused, 8, false, true},
      {"cached: transpose + multiply", false, Pf::none, 0, Work::both, 8, false, true},
      {"cached: same, old transpose", false, Pf::none, 0, Work::both, 8, true, true},
      {"cached: transpose only", false, Pf::none, 0, Work::transpose, 8, false, true},
      {"cached: old transpose only", false, Pf::none, 0, Work::transpose, 8, true, true},
      {"cached: multiply only", false, Pf::none, 0, Work::multiply, 8, false, true},
      {"streams, transpose only, no prefetch", false, Pf::none, 0, Work::transpose},
      {"streams, old transpose only, no prefetch", false, Pf::none, 0, Work::transpose, 8, true},
      {"streams, multiply only, no prefetch", false, Pf::none, 0, Work::multiply},
      {"streams, read only, no prefetch", false, Pf::none, 0, Work::read},
      {"grouped, read only, no prefetch", true, Pf::none, 0, Work::read},
  };

  auto checksum = [&]() {  // a sample of the last variant's outputs, to compare variants
    double sum = 0;
    for (int64_t x = 0; x < E * M * H; x += 997) sum += out[x];
    return sum;
  };
  const int nv = sizeof(variants) / sizeof(variants[0]);
  std::vector<std::vector<double>> tv(nv + 3);
  std::vector<double> sums(nv, 0);
  for (int r = 0; r < reps; ++r) {
    tv[0].push_back(read_all());
    for (int g = 0; g < 2; ++g) {
      const Bufs& b = g ? grouped : plain;
      tv[1 + g].push_back(time_parallel(E * NB, [&](int64_t t, uint16_t*, float* C) { fwd_task(b, g, t / NB, t % NB, C); }));
    }
    for (int i = 0; i < nv; ++i) {
      const Variant& v = variants[i];
      const Bufs& b = v.grouped ? grouped : plain;
      tv[3 + i].push_back(time_parallel(E * KB / G, [&](int64_t t, uint16_t* s, float* C) {
        const __m512i x = bwd_task(b, v, t / (KB / G), t % (KB / G), s, C);
        if (_mm512_reduce_add_epi64(x) == 42) std::puts("");  // keeps the read-only loads
      }));
      if (computes(v) && r == 0) sums[i] = checksum();
    }
  }
  struct Direct { const char* name; int pf; int64_t kbt; };
  const Direct directs[] = {{"direct, whole expert, no prefetch", 0, KB},
                            {"direct, whole expert, next kb to L2", 1, KB},
                            {"direct, whole expert, s+4 to L1", 2, KB},
                            {"direct, 16 k-blocks, no prefetch", 0, 16}};
  const int nd = sizeof(directs) / sizeof(directs[0]);
  std::vector<std::vector<double>> td(nd);
  std::vector<double> dsum(nd);
  for (int r = 0; r < reps; ++r)
    for (int i = 0; i < nd; ++i) {
      const Direct& d = directs[i];
      const int64_t per = KB / d.kbt;
      td[i].push_back(time_parallel(E * per, [&](int64_t t, uint16_t* s, float* C) {
        const int64_t k0 = (t % per) * d.kbt;
        direct_task(plain, d.pf, t / per, k0, k0 + d.kbt, s, C);
      }));
      if (r == 0) dsum[i] = checksum();
    }
  const double bytes = 2.0 * wbytes, tr = median(tv[0]);
  std::printf("%-42s %9s %9s %8s\n", "case", "ms", "GB/s", "x read");
  auto row = [&](const char* name, double t) {
    std::printf("%-42s %9.2f %9.1f %8.2f\n", name, t * 1e3, bytes / t / 1e9, t / tr);
  };
  row("streaming read", tr);
  row("forward whole-K loop, streams", median(tv[1]));
  row("forward whole-K loop, grouped", median(tv[2]));
  for (int i = 0; i < nv; ++i) row(variants[i].name, median(tv[3 + i]));
  for (int i = 0; i < nd; ++i) row(directs[i].name, median(td[i]));
  // every schedule must compute the same gradient: bitwise for the transposing ones (same order of sums),
  // to fp32 rounding for the direct ones
  int bad = 0;
  for (int i = 0; i < nd; ++i)
    if (std::abs(dsum[i] - sums[0]) > 1e-3 * std::abs(sums[0]))
      bad += std::printf("MISMATCH: %s checksum %g vs %g\n", directs[i].name, dsum[i], sums[0]) > 0;
  for (int i = 1; i < nv; ++i)
    if (computes(variants[i]) && sums[i] != sums[0])
      bad += std::printf("MISMATCH: %s checksum %g vs %g\n", variants[i].name, sums[i], sums[0]) > 0;
  return bad ? 1 : 0;
}
