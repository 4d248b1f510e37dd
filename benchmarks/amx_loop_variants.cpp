// Loop-schedule harness for the amx_bf16 kernels: times AMX BF16 GEMM loop variants for C[M, N] = A[M, K] B[N, K]^T
// on one thread and on all threads, with B resident in L2 or streamed from DRAM (figures in RESULTS.md).
// Standalone, needs an AMX CPU:
//   g++ -O3 -march=sapphirerapids -fopenmp benchmarks/amx_loop_variants.cpp -o v
//   OMP_NUM_THREADS=16 OMP_PROC_BIND=close ./v [M=256] [K blocks=64] [32-column units=4]
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct alignas(64) Cfg {
  uint8_t palette = 1, start = 0, res[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static Cfg make_cfg() {
  Cfg c;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  return c;
}
static const Cfg kCfg = make_cfg();
static inline void cfg() { _tile_loadconfig(&kCfg); }

constexpr int KBLK = 512;  // 16 x 32 bf16

// The 32 x 32 C block in tiles 0-3 (rows 0-15: tiles 0, 1; rows 16-31: tiles 2, 3), fp32 with ldc floats per row.
static inline void zero_c() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
static inline void load_c(const float* c, int64_t ldc) {
  const int64_t sc = ldc * 4;
  _tile_loadd(0, c, sc); _tile_loadd(1, c + 16, sc); _tile_loadd(2, c + 16 * ldc, sc); _tile_loadd(3, c + 16 * ldc + 16, sc);
}
static inline void store_c(float* c, int64_t ldc) {
  const int64_t sc = ldc * 4;
  _tile_stored(0, c, sc); _tile_stored(1, c + 16, sc); _tile_stored(2, c + 16 * ldc, sc); _tile_stored(3, c + 16 * ldc + 16, sc);
}

// The two 16-row A groups of rows m0.. (a0, a1), their tile stride and k-block step, row-major or blocked.
struct ARows {
  const uint16_t *a0, *a1;
  int64_t sa, astep;
};
template <bool BLOCKED>
static inline ARows a_rows(const uint16_t* A, int64_t lda, int64_t kb, int64_t m0) {
  if (BLOCKED) return {A + (m0 / 16) * kb * KBLK, A + (m0 / 16 + 1) * kb * KBLK, 64, KBLK};
  return {A + m0 * lda, A + (m0 + 16) * lda, lda * 2, 32};
}

// One k-step of v1/v2: each operand load placed just before the first product that reads it.
static inline void step_interleaved(const ARows& a, const uint16_t* B0, const uint16_t* B1, int64_t k) {
  _tile_loadd(4, a.a0 + k * a.astep, a.sa);
  _tile_loadd(6, B0 + k * KBLK, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, B1 + k * KBLK, 64);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, a.a1 + k * a.astep, a.sa);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// B packed per 16-column stream: stream s, k-block k at (s*KB + k)*512.
// A row-major with lda (elements), or A blocked: row group g (16 rows), k-block k at (g*KB + k)*512.

// ---- V0: the shipped loop (K chunks of 8, 32-row groups inner, B chunk stays in L1)
static void v0(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B0, const uint16_t* B1, int64_t kb, float* C,
               int64_t ldc, bool percall_cfg) {
  if (percall_cfg) cfg();
  const int64_t sa = lda * 2;
  constexpr int64_t kKC = 8;
  for (int64_t k0 = 0; k0 < kb; k0 += kKC) {
    const int64_t k1 = k0 + kKC < kb ? k0 + kKC : kb;
    const bool fresh = k0 == 0;
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
      const uint16_t* a0 = A + m0 * lda;
      const uint16_t* a1 = a0 + 16 * lda;
      float* c = C + m0 * ldc;
      if (fresh) { zero_c(); }
      else { load_c(c, ldc); }
      for (int64_t k = k0; k < k1; ++k) {
        _tile_loadd(4, a0 + k * 32, sa);
        _tile_loadd(6, B0 + k * KBLK, 64);
        _tile_loadd(7, B1 + k * KBLK, 64);
        _tile_loadd(5, a1 + k * 32, sa);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      store_c(c, ldc);
    }
  }
}

// ---- V1: full K per 32x32 block (C stays in tiles), A row-major or blocked, optional prefetch distance
template <bool BLOCKED, int PF>
static void v1(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B0, const uint16_t* B1, int64_t kb, float* C,
               int64_t ldc) {
  for (int64_t m0 = 0; m0 < m; m0 += 32) {
    const ARows a = a_rows<BLOCKED>(A, lda, kb, m0);
    zero_c();
    for (int64_t k = 0; k < kb; ++k) {
      if (PF) {
        const int64_t kp = k + PF < kb ? k + PF : kb - 1;
        if (BLOCKED) {
          for (int l = 0; l < 1024; l += 256) {  // 4 of the 16 lines of each: hw prefetcher does the rest
            _mm_prefetch((const char*)(a.a0 + kp * KBLK) + l, _MM_HINT_T0);
            _mm_prefetch((const char*)(a.a1 + kp * KBLK) + l, _MM_HINT_T0);
          }
        } else {
          for (int r = 0; r < 16; ++r) {
            _mm_prefetch((const char*)(a.a0 + r * lda + kp * 32), _MM_HINT_T0);
            _mm_prefetch((const char*)(a.a1 + r * lda + kp * 32), _MM_HINT_T0);
          }
        }
      }
      step_interleaved(a, B0, B1, k);
    }
    store_c(C + m0 * ldc, ldc);
  }
}

// ---- V2: K chunked (KC blocks) with NU 32-column units per row group so the A chunk is reused from L1 NU times
// and every unit's B chunk is reused across the row groups; C (fp32) goes through memory between chunks.
template <bool BLOCKED, int KC, int NU>
static void v2(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* const* Bs, int64_t kb, float* const* Cs,
               int64_t ldc) {
  for (int64_t k0 = 0; k0 < kb; k0 += KC) {
    const int64_t k1 = k0 + KC < kb ? k0 + KC : kb;
    for (int64_t m0 = 0; m0 < m; m0 += 32) {
      const ARows a = a_rows<BLOCKED>(A, lda, kb, m0);
      for (int u = 0; u < NU; ++u) {
        float* c = Cs[u] + m0 * ldc;
        if (k0 == 0) zero_c();
        else load_c(c, ldc);
        for (int64_t k = k0; k < k1; ++k) step_interleaved(a, Bs[2 * u], Bs[2 * u + 1], k);
        store_c(c, ldc);
      }
    }
  }
}


// ---- V3: 2x2 with the next step's loads issued as soon as their tile register is free (software pipelined)
static void v3(const uint16_t* A, int64_t m, const uint16_t* B0, const uint16_t* B1, int64_t kb, float* C, int64_t ldc) {
  for (int64_t m0 = 0; m0 < m; m0 += 32) {
    const uint16_t* a0 = A + (m0 / 16) * kb * KBLK;
    const uint16_t* a1 = a0 + kb * KBLK;
    float* c = C + m0 * ldc;
    zero_c();
    _tile_loadd(4, a0, 64); _tile_loadd(6, B0, 64); _tile_loadd(7, B1, 64); _tile_loadd(5, a1, 64);
    int64_t k = 0;
    for (; k + 1 < kb; ++k) {
      const int64_t n = k + 1;
      _mm_prefetch((const char*)(a0 + (k + 2) * KBLK), _MM_HINT_T0);
      _mm_prefetch((const char*)(a1 + (k + 2) * KBLK), _MM_HINT_T0);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(4, a0 + n * KBLK, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(6, B0 + n * KBLK, 64);
      _tile_dpbf16ps(3, 5, 7);
      _tile_loadd(7, B1 + n * KBLK, 64);
      _tile_loadd(5, a1 + n * KBLK, 64);
    }
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    store_c(c, ldc);
  }
}

// ---- V4: 2 C tiles (16 rows x 32 cols), operands double-buffered: A in 2/3, B pairs in 4,5 / 6,7
static void v4(const uint16_t* A, int64_t m, const uint16_t* B0, const uint16_t* B1, int64_t kb, float* C, int64_t ldc) {
  for (int64_t m0 = 0; m0 < m; m0 += 16) {
    const uint16_t* a0 = A + (m0 / 16) * kb * KBLK;
    float* c = C + m0 * ldc;
    _tile_zero(0); _tile_zero(1);
    int64_t k = 0;
    for (; k + 1 < kb; k += 2) {
      _tile_loadd(2, a0 + k * KBLK, 64); _tile_loadd(4, B0 + k * KBLK, 64); _tile_loadd(5, B1 + k * KBLK, 64);
      _tile_loadd(3, a0 + (k + 1) * KBLK, 64); _tile_loadd(6, B0 + (k + 1) * KBLK, 64); _tile_loadd(7, B1 + (k + 1) * KBLK, 64);
      _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 2, 5);
      _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 3, 7);
    }
    for (; k < kb; ++k) {
      _tile_loadd(2, a0 + k * KBLK, 64); _tile_loadd(4, B0 + k * KBLK, 64); _tile_loadd(5, B1 + k * KBLK, 64);
      _tile_dpbf16ps(0, 2, 4); _tile_dpbf16ps(1, 2, 5);
    }
    _tile_stored(0, c, ldc * 4); _tile_stored(1, c + 16, ldc * 4);
  }
}

// ---- V5: as v1 (blocked A, whole K), with all four loads of a step issued before its four products
static void v5(const uint16_t* A, int64_t m, const uint16_t* B0, const uint16_t* B1, int64_t kb, float* C, int64_t ldc) {
  for (int64_t m0 = 0; m0 < m; m0 += 32) {
    const uint16_t* a0 = A + (m0 / 16) * kb * KBLK;
    const uint16_t* a1 = a0 + kb * KBLK;
    float* c = C + m0 * ldc;
    zero_c();
    for (int64_t k = 0; k < kb; ++k) {
      _tile_loadd(4, a0 + k * KBLK, 64);
      _tile_loadd(5, a1 + k * KBLK, 64);
      _tile_loadd(6, B0 + k * KBLK, 64);
      _tile_loadd(7, B1 + k * KBLK, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
    }
    store_c(c, ldc);
  }
}

static double tile_peak_iter(int64_t iters) {
  alignas(64) static uint16_t z[512] = {};
  _tile_loadd(4, z, 64); _tile_loadd(5, z, 64); _tile_loadd(6, z, 64); _tile_loadd(7, z, 64);
  zero_c();
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float s[256];
  _tile_stored(0, s, 64);
  return iters * 4.0 * 2 * 16 * 16 * 32;
}

// one "task" = C[M rows, NU*32 cols] over K = kb*32, per thread, private data
struct Data {
  int64_t M, kb, lda, NU, nB;
  std::vector<uint16_t> A, Ablk;
  std::vector<uint16_t> B;  // nB copies of NU units (2 streams each)
  std::vector<float> C;
  Data(int64_t M_, int64_t kb_, int64_t pad, int64_t NU_, int64_t nB_) : M(M_), kb(kb_), lda(kb_ * 32 + pad), NU(NU_), nB(nB_) {
    A.assign(M * lda + 64, 0x3f80);
    Ablk.assign(M / 16 * kb * KBLK + 64, 0x3f80);
    B.assign(nB * NU * 2 * kb * KBLK + 64, 0x3c00);
    C.assign(NU * M * 32 + 64, 0.f);
  }
  const uint16_t* a() const { return al(A.data()); }
  const uint16_t* ablk() const { return al(Ablk.data()); }
  const uint16_t* b(int64_t copy, int64_t u, int s) const { return al(B.data()) + ((copy * NU + u) * 2 + s) * kb * KBLK; }
  float* c(int64_t u) { return alf(C.data()) + u * M * 32; }
  static const uint16_t* al(const uint16_t* p) { return p + (64 - (uintptr_t)p % 64) % 64 / 2; }
  static float* alf(float* p) { return p + (64 - (uintptr_t)p % 64) % 64 / 4; }
};

enum Var { V0_CFG, V0, V1_ROW, V1_ROW_PF, V1_BLK, V1_BLK_PF2, V1_BLK_PF4, V2_ROW_8_4, V2_BLK_8_4, V2_BLK_4_4, V2_BLK_16_2, V2_BLK_8_8, V3_PIPE, V4_DBUF, V5_GROUPED, NV };
static const char* kNames[NV] = {"v0 shipped (+cfg/call)", "v0 shipped", "v1 row fullK", "v1 row fullK pf2", "v1 blk fullK",
                                 "v1 blk fullK pf2", "v1 blk fullK pf4", "v2 row KC8 NU4", "v2 blk KC8 NU4", "v2 blk KC4 NU4",
                                 "v2 blk KC16 NU2", "v2 blk KC8 NU8", "v3 blk pipelined", "v4 blk 1x2 dbuf", "v5 blk loads first"};

// C blocks per v2 call (the task's units are taken that many at a time); 1 for the other variants
static int64_t units_per_call(Var v) {
  switch (v) {
    case V2_ROW_8_4: case V2_BLK_8_4: case V2_BLK_4_4: return 4;
    case V2_BLK_16_2: return 2;
    case V2_BLK_8_8: return 8;
    default: return 1;
  }
}

static void run_task(Var v, Data& d, int64_t copy) {
  const int64_t M = d.M, kb = d.kb;
  const uint16_t* bs[16];
  float* cs[8];
  for (int64_t u = 0; u < d.NU; ++u) { bs[2 * u] = d.b(copy, u, 0); bs[2 * u + 1] = d.b(copy, u, 1); cs[u] = d.c(u); }
  switch (v) {
    case V0_CFG: for (int64_t u = 0; u < d.NU; ++u) v0(d.a(), d.lda, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32, true); break;
    case V0: for (int64_t u = 0; u < d.NU; ++u) v0(d.a(), d.lda, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32, false); break;
    case V1_ROW: for (int64_t u = 0; u < d.NU; ++u) v1<false, 0>(d.a(), d.lda, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V1_ROW_PF: for (int64_t u = 0; u < d.NU; ++u) v1<false, 2>(d.a(), d.lda, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V1_BLK: for (int64_t u = 0; u < d.NU; ++u) v1<true, 0>(d.ablk(), 0, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V1_BLK_PF2: for (int64_t u = 0; u < d.NU; ++u) v1<true, 2>(d.ablk(), 0, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V1_BLK_PF4: for (int64_t u = 0; u < d.NU; ++u) v1<true, 4>(d.ablk(), 0, M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V2_ROW_8_4: for (int64_t u = 0; u < d.NU; u += 4) v2<false, 8, 4>(d.a(), d.lda, M, bs + 2 * u, kb, cs + u, 32); break;
    case V2_BLK_8_4: for (int64_t u = 0; u < d.NU; u += 4) v2<true, 8, 4>(d.ablk(), 0, M, bs + 2 * u, kb, cs + u, 32); break;
    case V2_BLK_4_4: for (int64_t u = 0; u < d.NU; u += 4) v2<true, 4, 4>(d.ablk(), 0, M, bs + 2 * u, kb, cs + u, 32); break;
    case V2_BLK_16_2: for (int64_t u = 0; u < d.NU; u += 2) v2<true, 16, 2>(d.ablk(), 0, M, bs + 2 * u, kb, cs + u, 32); break;
    case V2_BLK_8_8: for (int64_t u = 0; u < d.NU; u += 8) v2<true, 8, 8>(d.ablk(), 0, M, bs + 2 * u, kb, cs + u, 32); break;
    case V3_PIPE: for (int64_t u = 0; u < d.NU; ++u) v3(d.ablk(), M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V4_DBUF: for (int64_t u = 0; u < d.NU; ++u) v4(d.ablk(), M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    case V5_GROUPED: for (int64_t u = 0; u < d.NU; ++u) v5(d.ablk(), M, bs[2 * u], bs[2 * u + 1], kb, cs[u], 32); break;
    default: break;
  }
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // every finished line reaches a pipe, even if a variant crashes
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { std::puts("no AMX permission"); return 1; }
  const int nthreads = omp_get_max_threads();
  const int64_t M = argc > 1 ? atoll(argv[1]) : 256, kb = argc > 2 ? atoll(argv[2]) : 64;
  const int64_t NU = argc > 3 ? atoll(argv[3]) : 4;
  const double flop_task = 2.0 * M * NU * 32 * kb * 32;
  // peak
  for (int nt : {1, nthreads}) {
    double t0 = omp_get_wtime(), fl = 0;
#pragma omp parallel num_threads(nt) reduction(+ : fl)
    { cfg(); for (int r = 0; r < 20; ++r) fl += tile_peak_iter(20000); }
    std::printf("tile-only peak, %2d threads: %8.0f GFLOP/s\n", nt, fl / (omp_get_wtime() - t0) / 1e9);
  }
  std::printf("task: C[%ld, %ld] over K=%ld (A %ld KB, B %ld KB per copy)\n", (long)M, (long)(NU * 32), (long)(kb * 32),
              (long)(M * kb * 64 / 1024), (long)(NU * 2 * kb * 1024 / 1024));
  for (int64_t pad : {32}) {  // row-major A padded as the backend pads it (no 4 KiB row stride)
    for (int64_t nB : {1, 64}) {  // 1: B resident in L2; 64 copies: B streamed from L3/DRAM
      for (int nt : {1, nthreads}) {
        std::printf("--- lda pad %ld, B copies %ld (%s), threads %d\n", (long)pad, (long)nB, nB == 1 ? "L2" : "DRAM", nt);
        for (int v = 0; v < NV; ++v) {
          if (NU % units_per_call((Var)v)) {  // it would read C and B pointers past the task's units
            std::printf("  %-24s skipped: needs a multiple of %ld units\n", kNames[v], (long)units_per_call((Var)v));
            continue;
          }
          double worst = 0;
          int reps = nB == 1 ? 40 : 64;
#pragma omp parallel num_threads(nt) reduction(max : worst)
          {
            Data d(M, kb, pad, NU, nB);
            cfg();
            run_task((Var)v, d, 0);
#pragma omp barrier
            double t0 = omp_get_wtime();
            for (int r = 0; r < reps; ++r) run_task((Var)v, d, r % nB);
            worst = omp_get_wtime() - t0;
          }
          std::printf("  %-24s %8.0f GFLOP/s total, %6.0f per thread\n", kNames[v], flop_task * reps * nt / worst / 1e9,
                      flop_task * reps / worst / 1e9);
        }
      }
    }
  }
  return 0;
}
