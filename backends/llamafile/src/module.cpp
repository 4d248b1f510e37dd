// ktcore_llamafile._ext: GGUF-block expert kernels behind a torch-free pybind11 boundary.
// Tensors cross as addresses and sizes; every buffer is owned by the Python caller.
//
//   Engine(threads, isa)                       isa: "auto" | "vnni" | "avx2" | "scalar"
//   Engine.quantize_act(...)                   fp32 rows -> per-32 int8 blocks (scale, scale * sum)
//   Engine.quantize_act16(...)                 fp32 rows -> per-32 int16 blocks (scale, scale * sum)
//   Engine.matmul(...)                         out[r, n] = W_e[n, :] . x[r, :] for the rows r routed to expert e
//   Engine.matmul16(...)                       the same on int16 activations (expanded int16 weights, tiles)
//   Engine.route(...)                          the routed slots sorted by expert (offsets, order, token, weight)
//   Engine.combine(...)                        y[t] = sum_k w * out[row of slot (t, k)] (the forward's last step)
//   Engine.matmul_t(...)                       out[r, :] += sum_n g[r, n] * W_e[n, :]  (transposed, from the blocks)
//   dequantize / quantize / type_info          block helpers (tests, pack, ktcore convert)
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "blocks.hpp"
#include "kernels.hpp"
#include "ktcore/thread_pool.hpp"

namespace py = pybind11;
using namespace ktl;

namespace {

bool cpu_has(const char* what) {
  __builtin_cpu_init();
  std::string w(what);
  if (w == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  if (w == "vnni") return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

// The one run-time ISA dispatch point.
const Kernels& select_kernels(const std::string& isa) {
  if (isa == "auto") return cpu_has("vnni") ? vnni_kernels() : cpu_has("avx2") ? avx2_kernels() : scalar_kernels();
  if (isa == "scalar") return scalar_kernels();
  if (isa == "avx2" || isa == "vnni") {
    if (!cpu_has(isa.c_str())) throw std::runtime_error("this CPU cannot run the " + isa + " kernels");
    return isa == "avx2" ? avx2_kernels() : vnni_kernels();
  }
  throw std::invalid_argument("isa must be auto, vnni, avx2 or scalar, not " + isa);
}

template <class T>
T* P(uintptr_t a) { return reinterpret_cast<T*>(a); }

int nc8_of(int kp) { return (kp / 32 + 7) / 8 * 8; }

struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> f;
  std::vector<int16_t> w16;
  std::vector<float> f16;
  void need16(int64_t kp, int64_t nc8, int rows) {
    if ((int64_t)w16.size() < rows * kp) w16.resize(rows * kp);
    if ((int64_t)f16.size() < rows * 3 * nc8) f16.resize(rows * 3 * nc8);
    if ((int64_t)q.size() < kp) q.resize(kp);
  }
  void need(int64_t kp) {
    if ((int64_t)q.size() < kp) q.resize(kp);
    if ((int64_t)f.size() < kp + 3 * (kp / 32 + 1)) f.resize(kp + 3 * (kp / 32 + 1));
  }
};

class Engine {
 public:
  Engine(int threads, const std::string& isa) : k_(select_kernels(isa)), pool_(threads), scratch_(pool_.num_threads()) {}

  int num_threads() const { return pool_.num_threads(); }
  std::string isa() const { return k_.name; }

  // activations="q8": x rows (fp32, ldx) -> xq [R, kp] int8, xd [R, kp/32] scale, xm [R, kp/32] scale * sum(q);
  // columns >= k are 0. Each 32-element block is quantised by ggml's Q8 rule (d = amax / 127, q = round(x / d),
  // half away from zero). rows: int32 [R] source row of each output row, or 0 for the identity.
  void quantize_act(uintptr_t x, int64_t ldx, uintptr_t rows, int64_t R, int k, int kp, uintptr_t xq, uintptr_t xd,
                    uintptr_t xm) {
    const int nc = kp / 32;
    run(R, (int64_t)R * kp, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = rows ? P<int32_t>(rows)[r] : r;
        const float* xr = P<float>(x) + src * ldx;
        for (int c = 0; c < nc; ++c) {
          float amax = 0.f;
          for (int i = 0; i < 32; ++i)
            if (32 * c + i < k) amax = std::max(amax, std::fabs(xr[32 * c + i]));
          const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
          int8_t* q = P<int8_t>(xq) + r * kp + 32 * c;
          int sum = 0;
          for (int i = 0; i < 32; ++i) {
            const float v = 32 * c + i < k ? xr[32 * c + i] : 0.f;
            const int iv = std::max(-127, std::min(127, (int)std::round(v * id)));
            q[i] = (int8_t)iv;
            sum += iv;
          }
          P<float>(xd)[r * nc + c] = d;
          P<float>(xm)[r * nc + c] = d * (float)sum;
        }
      }
    });
  }

  // activations="q16": x rows (fp32, ldx; rows as in quantize_act) -> xq int16 [R, kp], xd / xm [R, nc8] fp32
  // (Kernels::quant16: per 32 elements d = amax / 32767, q = round(x / d), m = d * sum(q); nc8 = kp/32 rounded
  // up to 8, the padding chunks 0).
  void quantize_act16(uintptr_t x, int64_t ldx, uintptr_t rows, int64_t R, int k, int kp, uintptr_t xq, uintptr_t xd,
                      uintptr_t xm) {
    const int nc8 = nc8_of(kp);
    run(R, (int64_t)R * kp, [&](int64_t r0, int64_t r1, int) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t src = rows ? P<int32_t>(rows)[r] : r;
        k_.quant16(P<float>(x) + src * ldx, k, kp, nc8, P<int16_t>(xq) + r * kp, P<float>(xd) + r * nc8,
                   P<float>(xm) + r * nc8);
      }
    });
  }

  // matmul on q16 activations (quantize_act16): out[r, n] (ldo) for the rows r of each expert e and weight rows
  // n < N. A task is (expert, 16 weight rows); it expands 4 weight rows at a time to int16 (L1-resident) and
  // runs them against the expert's tokens, 64 tokens at a time, in 4-row x 2-token register tiles.
  void matmul16(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int kp, uintptr_t offsets,
                int E, uintptr_t xq, uintptr_t xd, uintptr_t xm, uintptr_t out, int64_t ldo) {
    const TypeInfo ti = type_info(qtype);
    if (!ti.quantised) throw std::invalid_argument("matmul16: float block types take fp32 activations");
    const int nc = kp / 32, nc8 = nc8_of(kp), nblocks = kp / ti.block_elems;
    const bool split = qtype == Q6_K;
    const int64_t* off = P<int64_t>(offsets);
    const int tile = 16, RT = 4, TB = 64;
    const int64_t tiles = (N + tile - 1) / tile;
    std::vector<int> experts;
    for (int e = 0; e < E; ++e) if (off[e + 1] > off[e]) experts.push_back(e);
    pool_.parallel_for((int64_t)experts.size() * tiles, [&](int64_t b, int64_t end, int tid) {
      Scratch& s = scratch_[tid];
      s.need16(kp, nc8, RT);
      Row16 rows[RT];
      for (int i = 0; i < RT; ++i) {
        float* f = s.f16.data() + (int64_t)i * 3 * nc8;
        rows[i] = Row16{s.w16.data() + (int64_t)i * kp, f, f + nc8, f + 2 * nc8};
      }
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / tiles];
        const int n0 = (int)(job % tiles) * tile, n1 = std::min(N, n0 + tile);
        const int64_t r0 = off[e], nt = off[e + 1] - r0;
        const uint8_t* we = P<uint8_t>(w) + e * expert_stride;
        if (nt <= 3 && job + 1 < (int64_t)experts.size() * tiles && experts[(job + 1) / tiles] != e) {
          // decode: the kernels prefetch 16 KB ahead within an expert's rows; the next task's rows (most often this
          // thread's next task) lie in another expert, so start fetching their first 16 KB here
          const int64_t nb0 = (job + 1) % tiles * tile, bytes = std::min<int64_t>(16384, tile * row_bytes);
          const uint8_t* nx = P<uint8_t>(w) + experts[(job + 1) / tiles] * expert_stride + nb0 * row_bytes;
          for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(nx + c, 0, 3);
        }
        if (nt <= 3 && k_.row16 &&  // decode: a few tokens, dotted straight from the blocks
            k_.row16(qtype, we + n0 * row_bytes, row_bytes, n1 - n0, nblocks, (int)nt, P<int16_t>(xq) + r0 * kp, kp,
                     P<float>(xd) + r0 * nc8, P<float>(xm) + r0 * nc8, nc8, P<float>(out) + r0 * ldo + n0, ldo))
          continue;
        for (int64_t t0 = 0; t0 < nt; t0 += TB) {
          const int ntb = (int)std::min<int64_t>(TB, nt - t0);
          const int64_t rr = r0 + t0;
          for (int n = n0; n < n1; n += RT) {
            const int nr = std::min(RT, n1 - n);
            for (int i = 0; i < nr; ++i) k_.expand16(qtype, we + (n + i) * row_bytes, nblocks, nc8, rows[i], s.q.data());
            k_.dot16(rows, nr, split, ti.has_min, nc, ntb, P<int16_t>(xq) + rr * kp, kp, P<float>(xd) + rr * nc8,
                     P<float>(xm) + rr * nc8, nc8, P<float>(out) + rr * ldo + n, ldo, 1);
          }
        }
      }
    });
  }

  // out[r, n] (ldo) for the rows r in [off[e], off[e+1]) and weight rows n < N of expert e. Quantised types
  // read int8 activations (xq, xd, xm; quantize_act, row width kp), float types xf (fp32 [R, kp]).
  void matmul(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int kp, uintptr_t offsets,
              int E, uintptr_t xq, uintptr_t xd, uintptr_t xm, uintptr_t xf, uintptr_t out, int64_t ldo) {
    const TypeInfo ti = type_info(qtype);
    const int nc = kp / 32, nblocks = kp / ti.block_elems;
    const int64_t* off = P<int64_t>(offsets);
    const int tile = 16;
    const int64_t tiles = (N + tile - 1) / tile;
    std::vector<int> experts;
    for (int e = 0; e < E; ++e) if (off[e + 1] > off[e]) experts.push_back(e);
    pool_.parallel_for((int64_t)experts.size() * tiles, [&](int64_t b, int64_t end, int tid) {
      Scratch& s = scratch_[tid];
      s.need(kp);
      Unpacked u{s.q.data(), s.f.data(), s.f.data() + nc, s.f.data() + 2 * nc};
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / tiles];
        const int n0 = (int)(job % tiles) * tile, n1 = std::min(N, n0 + tile);
        const int64_t r0 = off[e], nt = off[e + 1] - r0;
        const uint8_t* we = P<uint8_t>(w) + e * expert_stride;
        for (int n = n0; n < n1; ++n) {
          float* o = P<float>(out) + r0 * ldo + n;
          if (ti.quantised) {
            const uint8_t* row = we + n * row_bytes;
            const int8_t* q = P<int8_t>(xq) + r0 * kp;
            const float* d = P<float>(xd) + r0 * nc;
            const float* m = P<float>(xm) + r0 * nc;
            if (!(k_.dot_row && k_.dot_row(qtype, row, nblocks, (int)nt, q, d, m, kp, o, ldo))) {
              unpack_row(qtype, row, nblocks, u);
              k_.dot_q(u.q, u.dlo, u.dhi, u.mn, ti.has_min, nc, (int)nt, q, d, m, kp, o, ldo);
            }
          } else {
            float* wf = s.f.data();
            float_row(qtype, we + n * row_bytes, kp, wf);
            k_.dot_f(wf, kp, (int)nt, P<float>(xf) + r0 * kp, kp, o, ldo);
          }
        }
      }
    });
  }

  // Routing: the T*K slots (ids int64, weights fp32, both [T*K]) sorted by expert, stably (slot order within an
  // expert); ids outside [0, E) are dropped. Writes offsets int64 [E+1], and for each row r < R (returned) its
  // slot order[r], token row_tok[r] = order[r] / K and weight w_row[r]. A counting sort, on the calling thread.
  int64_t route(uintptr_t ids, uintptr_t weights, int64_t TK, int K, int E, uintptr_t offsets, uintptr_t order,
                uintptr_t row_tok, uintptr_t w_row) {
    const int64_t* id = P<int64_t>(ids);
    int64_t* off = P<int64_t>(offsets);
    std::fill(off, off + E + 1, 0);
    for (int64_t s = 0; s < TK; ++s)
      if (id[s] >= 0 && id[s] < E) ++off[id[s] + 1];
    for (int e = 0; e < E; ++e) off[e + 1] += off[e];
    std::vector<int64_t> next(off, off + E);
    for (int64_t s = 0; s < TK; ++s)
      if (id[s] >= 0 && id[s] < E) {
        const int64_t r = next[id[s]]++;
        P<int64_t>(order)[r] = s;
        P<int32_t>(row_tok)[r] = (int32_t)(s / K);
        P<float>(w_row)[r] = P<float>(weights)[s];
      }
    return off[E];
  }

  // y[t, :] = sum over k < K of w_row[r] * out[r, :] for the row r whose slot order[r] is t * K + k (slots no row
  // took contribute 0), k ascending; order: int64 [R]. Replaces torch's scatter (index_put), whose OpenMP team
  // then spins on the cores for milliseconds and slows the next kernel call.
  void combine(uintptr_t out, int64_t ldo, uintptr_t w_row, uintptr_t order, int64_t R, int64_t T, int K, int H,
               uintptr_t y, int64_t ldy) {
    std::vector<int64_t> row_of(T * K, -1);
    for (int64_t r = 0; r < R; ++r) row_of[P<int64_t>(order)[r]] = r;
    run(T, T * K * H, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t) {
        float* yt = P<float>(y) + t * ldy;
        std::fill(yt, yt + H, 0.f);
        for (int k = 0; k < K; ++k) {
          const int64_t r = row_of[t * K + k];
          if (r >= 0) k_.axpy(P<float>(w_row)[r], P<float>(out) + r * ldo, yt, H);
        }
      }
    });
  }

  // h[i] = silu(g[i]) * u[i] for i < n (fp32). torch's elementwise kernels start their OpenMP team above 32K
  // elements (a decode step's R x I already), and that team's spinning then slows this pool's next call.
  void silu_mul(uintptr_t g_, uintptr_t u_, int64_t n, uintptr_t h_) {
    const float *g = P<float>(g_), *u = P<float>(u_);
    float* h = P<float>(h_);
    run(n, n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    });
  }

  // out[r, 0:k] += sum_n g[r, n] * W_e[n, 0:k] for the rows of each expert: the transposed product, with each
  // weight row dequantised block by block (a few blocks per task, never a resident dequantised copy).
  void matmul_t(int qtype, uintptr_t w, int64_t expert_stride, int64_t row_bytes, int N, int k, uintptr_t offsets,
                int E, uintptr_t g, int64_t ldg, uintptr_t out, int64_t ldo) {
    const TypeInfo ti = type_info(qtype);
    const int64_t* off = P<int64_t>(offsets);
    const int nblocks = (k + ti.block_elems - 1) / ti.block_elems;
    const int per = std::max(1, 256 / ti.block_elems);  // blocks per task (256 columns)
    const int64_t chunks = (nblocks + per - 1) / per;
    std::vector<int> experts;
    for (int e = 0; e < E; ++e) if (off[e + 1] > off[e]) experts.push_back(e);
    pool_.parallel_for((int64_t)experts.size() * chunks, [&](int64_t b, int64_t end, int) {
      float buf[256];
      for (int64_t job = b; job < end; ++job) {
        const int e = experts[job / chunks];
        const int b0 = (int)(job % chunks) * per, b1 = std::min(nblocks, b0 + per);
        const int c0 = b0 * ti.block_elems, c1 = std::min(k, b1 * ti.block_elems);
        const int64_t r0 = off[e], r1 = off[e + 1];
        const uint8_t* we = P<uint8_t>(w) + e * expert_stride;
        for (int n = 0; n < N; ++n) {
          const uint8_t* row = we + n * row_bytes;
          for (int ib = b0; ib < b1; ++ib)
            dequant_block(qtype, row + (int64_t)ib * ti.block_bytes, buf + (ib - b0) * ti.block_elems);
          for (int64_t r = r0; r < r1; ++r) {
            const float gv = P<float>(g)[r * ldg + n];
            if (gv != 0.f) k_.axpy(gv, buf, P<float>(out) + r * ldo + c0, c1 - c0);
          }
        }
      }
    });
  }

 private:
  // Small work (fewer than ~64K elements) runs on the calling thread: waking the pool costs more than it saves,
  // and much more while torch's OpenMP workers still spin on the cores after a torch op.
  template <class F>
  void run(int64_t n, int64_t work, const F& fn) {
    if (work < (1 << 16) || pool_.num_threads() == 1) fn(0, n, 0);
    else pool_.parallel_for(n, fn, std::max<int64_t>(1, n / (8 * pool_.num_threads())));
  }

  const Kernels& k_;
  ktcore::ThreadPool pool_;
  std::vector<Scratch> scratch_;
};

void dequantize(int qtype, uintptr_t src, int64_t nblocks, uintptr_t dst) {
  const TypeInfo ti = type_info(qtype);
  for (int64_t i = 0; i < nblocks; ++i)
    dequant_block(qtype, P<uint8_t>(src) + i * ti.block_bytes, P<float>(dst) + i * ti.block_elems);
}

void quantize(int qtype, uintptr_t src, int64_t n, uintptr_t dst) { quantize_row(qtype, P<float>(src), n, P<uint8_t>(dst)); }

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "ktcore llamafile backend kernels (GGUF blocks; AVX-512 VNNI / AVX2 / scalar)";
  m.def("cpu_has", &cpu_has, "avx2 (with fma, f16c) or vnni (AVX-512 VL/BW/VNNI)");
  m.def("type_info", [](int t) {
    TypeInfo ti = type_info(t);
    return py::make_tuple(ti.block_elems, ti.block_bytes, ti.quantised, ti.has_min);
  });
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>());
  m.def("quantize", &quantize, py::call_guard<py::gil_scoped_release>());
  py::class_<Engine>(m, "Engine")
      .def(py::init<int, const std::string&>())
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("isa", &Engine::isa)
      .def("quantize_act", &Engine::quantize_act, py::call_guard<py::gil_scoped_release>())
      .def("matmul", &Engine::matmul, py::call_guard<py::gil_scoped_release>())
      .def("quantize_act16", &Engine::quantize_act16, py::call_guard<py::gil_scoped_release>())
      .def("matmul16", &Engine::matmul16, py::call_guard<py::gil_scoped_release>())
      .def("combine", &Engine::combine, py::call_guard<py::gil_scoped_release>())
      .def("silu_mul", &Engine::silu_mul, py::call_guard<py::gil_scoped_release>())
      .def("route", &Engine::route, py::call_guard<py::gil_scoped_release>())
      .def("matmul_t", &Engine::matmul_t, py::call_guard<py::gil_scoped_release>());
}
