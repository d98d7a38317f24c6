// Unmasked attention of every query row of a kv head over its cached prefix, on the CPU: the
// prefix part of kernels/packed.py. One pass over the keys serves all R rows (the G query heads
// of the kv head times the step's nq tokens): keys and values are read once, a block of BN at a
// time (K transposed to fp32 by W x W register tiles, fp32 V read in place, bf16 converted),
// while the block AHEAD blocks on is prefetched into L2 a few lines at a time from inside the
// arithmetic, so the loads overlap it. Rows go in groups of at most RB, as even as they split (each key
// / value load serves a whole group: 10 rows are one group of 10, not 8 and a slow 2);
// each row keeps its running max / sum / accumulator (online softmax, base 2, exp2 by a
// polynomial). Vectors are GCC/Clang vector extensions of one register of what -march=native
// gives: 16 floats with AVX-512, 8 otherwise (a 16-float vector on an AVX2 CPU is lowered to
// spills and half-register moves: 4-10x slower than torch's op on a Zen 3). Work items are (batch,
// kv head, split): with fewer (batch, kv head) pairs than torch threads the keys are cut into
// splits, merged at the end by log-sum-exp. Returns the normalised outputs (B, Hkv, R, Dv) and
// the rows' natural log-sum-exps (B, Hkv, R), both fp32.
// Lean headers, not torch/extension.h (the whole C++ frontend: ~20 s of every fresh build).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <torch/csrc/utils/pybind.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int BN = 128;                      // keys per block
#if defined(__AVX512F__)
constexpr int W = 16;                        // floats per vector: one register (32 of them)
constexpr int ACC = 16;                      // accumulator registers a row group may hold
constexpr int RB = 8;                        // rows sharing each load of a key or value, at most
#else
constexpr int W = 8;                         // one AVX2 register (16 of them)
constexpr int ACC = 12;                      // 12 accumulators, a key vector and a broadcast: 14 of 16
constexpr int RB = 12;
#endif
constexpr int NV = BN / W;                   // vectors per block of scores
constexpr int AHEAD = 6;                     // blocks between the one computed and the one prefetched
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float FLOOR = -1e30f;              // the running max before any key (finite: no inf - inf)

// GCC/Clang vector extensions: the compiler maps them onto the widest registers -march gives
typedef float vf __attribute__((vector_size(W * 4)));   // naturally aligned: memory is read by memcpy (loadv)
typedef int32_t vi __attribute__((vector_size(W * 4)));

// x in every lane. Not `vf{} + x`: adding +0 is not a no-op (-0 + 0 = +0), so the compiler keeps a
// scalar add before each broadcast; x - 0 is x exactly and folds away.
inline vf splat(float x) { return x - vf{}; }
inline vf loadv(const float* p) { vf r; std::memcpy(&r, p, sizeof r); return r; }
inline void storev(float* p, vf x) { std::memcpy(p, &x, sizeof x); }

// 2^x for x <= 0 (clamped at -126), ~1e-7 relative: round to n, 2^f on [-0.5, 0.5] by its Taylor
// series to degree 6, times 2^n by the exponent bits.
inline vf exp2v(vf x) {
#if defined(__AVX512F__)                         // round and 2^n in one instruction each
  const __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vf f = x - (vf)n;                        // [-0.5, 0.5]; the coefficients are ln2^i / i!
  vf p = splat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 0.24022650695910071f;
  p = p * f + 0.69314718055994531f;
  p = p * f + 1.f;
  return (vf)_mm512_scalef_ps((__m512)p, n);     // far below: 0, not a denormal of another scale
#else
  const vf lo = splat(-126.f);
  x = x < lo ? lo : x;
  const vi n = __builtin_convertvector(x - 0.5f, vi);  // x <= 0: truncation of x - 0.5 is round(x)
  const vf f = (x - __builtin_convertvector(n, vf)) * LN2;
  vf p = splat(1.f / 720.f);
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  return p * (vf)((n + 127) << 23);
#endif
}

#if defined(__AVX512F__)
inline float hmax(vf x) { return _mm512_reduce_max_ps((__m512)x); }
inline float hsum(vf x) { return _mm512_reduce_add_ps((__m512)x); }
#else
inline float hmax(vf x) { float m = x[0]; for (int i = 1; i < W; ++i) m = std::max(m, x[i]); return m; }
inline float hsum(vf x) { float s = 0.f; for (int i = 0; i < W; ++i) s += x[i]; return s; }
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline vf load_row(const float* p) { return loadv(p); }
inline vf load_row(const c10::BFloat16* p) {      // W bf16 -> fp32: the bits shifted up
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

// W x W transpose in registers: at each stage, bit b of the row index and of the column index
// trade places (two-source shuffles), so after log2(W) stages a[i][c] holds the old a[c][i].
// Stage b's masks: lane c takes x[c] / y[c - b] (lo) where bit b of c is clear / set, and
// x[c + b] / y[c] (hi); y's lanes are numbered from W.
constexpr int stage_lane(int b, bool hi, int c) {
  return (c & b) ? (hi ? c + W : c - b + W) : (hi ? c + b : c);
}

template <int... C>
constexpr vi stage_mask(int b, bool hi, std::integer_sequence<int, C...>) {
  return vi{stage_lane(b, hi, C)...};
}

template <int B>
inline void transpose_stage(vf* a) {
  constexpr vi lo = stage_mask(B, false, std::make_integer_sequence<int, W>()),   // constants: one shuffle each
               hi = stage_mask(B, true, std::make_integer_sequence<int, W>());
  for (int i = 0; i < W; ++i) {
    if (i & B) continue;
    const vf x = a[i], y = a[i | B];
    a[i] = __builtin_shuffle(x, y, lo);
    a[i | B] = __builtin_shuffle(x, y, hi);
  }
}

inline void transpose_tile(vf* a) {
#if defined(__clang__)                           // clang's shuffle takes constant indices only
  float t[W][W];
  for (int i = 0; i < W; ++i) storev(t[i], a[i]);
  for (int i = 0; i < W; ++i)
    for (int c = 0; c < W; ++c) a[i][c] = t[c][i];
#else
  transpose_stage<1>(a);
  transpose_stage<2>(a);
  transpose_stage<4>(a);
  if constexpr (W > 8) transpose_stage<8>(a);
#endif
}

// Rows j0 .. j0 + n of K into kt (D x BN, fp32): W x W tiles transposed in registers where D
// is whole vectors and the block is whole tiles; element by element otherwise.
template <typename T>
inline void load_keys_t(const T* k, int64_t k_stride, int64_t n, int64_t D, float* kt) {
  if (D % W == 0 && n == BN) {
    for (int64_t g = 0; g < BN; g += W)
      for (int64_t e = 0; e < D; e += W) {
        vf a[W];
        for (int i = 0; i < W; ++i) a[i] = load_row(k + (g + i) * k_stride + e);
        transpose_tile(a);
        for (int i = 0; i < W; ++i) storev(kt + (e + i) * BN + g, a[i]);
      }
    return;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * BN + j] = to_float(k[j * k_stride + d]);
}

// The lines of one block of keys and values (AHEAD blocks past the one computed), prefetched into
// L2 a few at a time from inside the arithmetic (the value loop), so that memory streams while
// the core computes. Issued in one burst a block, they filled the core's miss buffers and the
// arithmetic waited behind them: cold, 5 rows over 25k keys cost the 1-row time plus the
// warm compute, not the larger of the two.
struct Prefetch {
  const char* k;
  const char* v;
  int64_t k_stride, v_stride;     // bytes between key rows, value rows
  int64_t lk, lv;                 // cache lines a key row, a value row
  int64_t j = 0, c = 0;           // the next line: row j, line c (keys' lines first)
  int64_t left = 0;               // lines of the block not yet issued

  void start(int64_t row, int64_t rows) {
    j = row;
    c = 0;
    left = rows * (lk + lv);
  }
  inline void some(int64_t count) {
    for (count = std::min(count, left); count > 0; --count, --left) {
      __builtin_prefetch(c < lk ? k + j * k_stride + c * 64 : v + j * v_stride + (c - lk) * 64, 0, 2);
      if (++c == lk + lv) {
        c = 0;
        ++j;
      }
    }
  }
};

// NR rows (r0 ..) against the block in kt (D x BN, K transposed) and vb (BN x DVP): scores,
// the online-softmax update of m, l and the accumulators acc (rows x DVP). Never inlined: GCC
// inlined the 7-12 row instances into attend_range's block loop, where they ran 10-18% slower
// (cold 25k keys, one kv head pair of dim 32, AVX2 Zen 3: 8 rows 2.88 -> 2.46 ms, 10 rows
// 3.24 -> 2.75, 26 rows 6.1 -> 5.5; 1-6 rows, kept out of line already, unchanged).
template <int NR, int DC>
__attribute__((noinline)) void rows_block(const float* q, int64_t d_rt, int64_t dvp, int64_t n, const float* kt, const float* vb,
                       int64_t vs, float* m, float* l, float* acc, float* p, Prefetch& pf, int64_t share) {
  const int64_t D = DC > 0 ? DC : d_rt;
  constexpr int TN = ACC / NR >= 4 ? 4 : ACC / NR >= 2 ? 2 : 1;   // vectors a row: NR x TN accumulators
  for (int c0 = 0; c0 < NV; c0 += TN) {             // scores, TN vectors of keys at a time: NR x TN registers
    vf s[NR][TN];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < TN; ++c) s[r][c] = vf{};
    for (int64_t d = 0; d < D; ++d) {
      vf kd[TN];
      for (int c = 0; c < TN; ++c) kd[c] = loadv(kt + d * BN + (c0 + c) * W);
      for (int r = 0; r < NR; ++r) {
        const vf qd = splat(q[r * D + d]);
        for (int c = 0; c < TN; ++c) s[r][c] += qd * kd[c];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < TN; ++c) storev(p + r * BN + (c0 + c) * W, s[r][c]);
  }
  if (n < BN)                                        // the last block: keys past n do not exist
    for (int r = 0; r < NR; ++r)
      for (int64_t j = n; j < BN; ++j) p[r * BN + j] = FLOOR;
  float alpha[NR];
  for (int r = 0; r < NR; ++r) {
    float* pr = p + r * BN;
    vf mv = loadv(pr);
    for (int c = 1; c < NV; ++c) { const vf x = loadv(pr + c * W); mv = x > mv ? x : mv; }
    const float mx = std::max(m[r], hmax(mv));
    alpha[r] = exp2v(splat(m[r] - mx))[0];
    vf sum = vf{};
    const vf mxv = splat(mx);
    for (int c = 0; c < NV; ++c) {
      const vf e = exp2v(loadv(pr + c * W) - mxv);
      sum += e;
      storev(pr + c * W, e);
    }
    if (n < BN)                                      // 2^-126 each, not 0: taken out again
      for (int64_t j = n; j < BN; ++j) { sum[0] -= pr[j]; pr[j] = 0.f; }
    m[r] = mx;
    l[r] = l[r] * alpha[r] + hsum(sum);
  }
  const int64_t passes = (dvp + TN * W - 1) / (TN * W), per_key = (share + passes * n - 1) / (passes * n);
  for (int64_t d0 = 0; d0 < dvp; d0 += TN * W) {      // accumulators in registers, NV vectors a row at a time
    const int nc = static_cast<int>(std::min<int64_t>(TN, (dvp - d0) / W));
    vf a[NR][TN];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < nc; ++c) a[r][c] = loadv(acc + r * dvp + d0 + c * W) * alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      pf.some(per_key);
      vf vj[TN];
      for (int c = 0; c < nc; ++c) vj[c] = loadv(vb + j * vs + d0 + c * W);
      for (int r = 0; r < NR; ++r) {
        const vf pj = splat(p[r * BN + j]);
        for (int c = 0; c < nc; ++c) a[r][c] += pj * vj[c];
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < nc; ++c) storev(acc + r * dvp + d0 + c * W, a[r][c]);
  }
}

// rows_block for a group of nr rows (1 .. RB): one instance a size, so every group's accumulators
// stay in registers.
template <int DC, int NR = 1>
inline void rows_group(int nr, const float* q, int64_t d_rt, int64_t dvp, int64_t n, const float* kt,
                       const float* vb, int64_t vs, float* m, float* l, float* acc, float* p, Prefetch& pf,
                       int64_t share) {
  if constexpr (NR < RB) {
    if (nr != NR) return rows_group<DC, NR + 1>(nr, q, d_rt, dvp, n, kt, vb, vs, m, l, acc, p, pf, share);
  }
  rows_block<NR, DC>(q, d_rt, dvp, n, kt, vb, vs, m, l, acc, p, pf, share);
}

// One (batch, kv head, key range) item. q: R x D rows (fp32, already times scale * log2 e);
// k, v: the head's first key row and the stride between key rows. Writes the range's normalised
// output rows (R x Dv) and base-2 log-sum-exps (R).
template <typename T, int DC>
void attend_range(const float* q, int64_t rows, int64_t d_rt, int64_t dv, const T* k, int64_t k_stride,
                  const T* v, int64_t v_stride, int64_t begin, int64_t end, float* out, float* lse2) {
  const int64_t D = DC > 0 ? DC : d_rt;
  const int64_t dvp = (dv + W - 1) / W * W;           // value rows padded to whole vectors (zeros)
  std::vector<float> kt(D * BN, 0.f), vb(BN * dvp, 0.f), p(RB * BN), m(rows, FLOOR), l(rows, 0.f),
      acc(rows * dvp, 0.f);
  // fp32 values of whole vectors are read where they lie; others are converted / padded into vb
  const bool v_direct = std::is_same<T, float>::value && dv % W == 0;
  const int64_t vs = v_direct ? v_stride : dvp;
  // The block AHEAD blocks on is prefetched into L2 while this one is computed, its lines shared
  // among the row groups and issued from inside their arithmetic (Prefetch).
  Prefetch pf{reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v),
              k_stride * static_cast<int64_t>(sizeof(T)), v_stride * static_cast<int64_t>(sizeof(T)),
              (D * static_cast<int64_t>(sizeof(T)) + 63) / 64, (dv * static_cast<int64_t>(sizeof(T)) + 63) / 64};
  const int64_t groups = (rows + RB - 1) / RB;
  for (int64_t j0 = begin; j0 < end; j0 += BN) {
    const int64_t n = std::min<int64_t>(BN, end - j0);
    pf.some(pf.left);                          // what is left of the last block's share
    const int64_t ahead = j0 + AHEAD * BN;
    pf.start(ahead, ahead < end ? std::min<int64_t>(BN, end - ahead) : 0);
    if (!v_direct)                             // the block, fp32: V as is, K transposed (D x BN)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dv; ++d) vb[j * dvp + d] = to_float(v[(j0 + j) * v_stride + d]);
    load_keys_t(k + j0 * k_stride, k_stride, n, D, kt.data());
    const float* vblock = v_direct ? reinterpret_cast<const float*>(v + j0 * v_stride) : vb.data();
    const int64_t share = (pf.left + groups - 1) / groups;
    for (int64_t r = 0; r < rows;) {           // groups as even as they split: 18 rows are 9 + 9
      const int64_t left = rows - r, nr = (left + (left + RB - 1) / RB - 1) / ((left + RB - 1) / RB);
      rows_group<DC>(static_cast<int>(nr), q + r * D, D, dvp, n, kt.data(), vblock, vs, m.data() + r, l.data() + r,
                     acc.data() + r * dvp, p.data(), pf, share);
      r += nr;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < dv; ++d) out[r * dv + d] = acc[r * dvp + d] * inv;
    lse2[r] = m[r] + std::log2(l[r]);
  }
}

template <typename T, int DC>
void run(const at::Tensor& qs, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = qs.size(0), H = qs.size(1), R = qs.size(2), D = qs.size(3);
  const int64_t P = k.size(2), DV = v.size(3);
  const int64_t pairs = B * H;
  const int64_t threads = at::get_num_threads();
  // splits of >= 1024 keys each, only as many as the idle threads need
  int64_t splits = pairs >= threads ? 1 : std::min<int64_t>((threads + pairs - 1) / pairs, std::max<int64_t>(1, P / 1024));
  const int64_t chunk = ((P + splits - 1) / splits + BN - 1) / BN * BN;
  splits = (P + chunk - 1) / chunk;
  std::vector<float> part_out(splits > 1 ? pairs * splits * R * DV : 0), part_lse(pairs * splits * R);
  const float* qp = qs.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, pairs * splits, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t pair = item / splits, sp = item % splits, b = pair / H, h = pair % H;
      const int64_t begin = sp * chunk, end = std::min(P, begin + chunk);
      float* o = splits > 1 ? part_out.data() + item * R * DV : op + pair * R * DV;
      attend_range<T, DC>(qp + pair * R * D, R, D, DV, kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
                               vp + b * v.stride(0) + h * v.stride(1), v.stride(2), begin, end, o,
                               part_lse.data() + item * R);
    }
  });
  float* lp = lse.data_ptr<float>();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t r = 0; r < R; ++r) {
      const float* ls = part_lse.data() + pair * splits * R + r;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, ls[sp * R]);
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) total += std::exp2(ls[sp * R] - mx);
      const float lse2 = mx + std::log2(total);
      lp[pair * R + r] = lse2 * LN2;
      if (splits == 1) continue;
      float* o = op + (pair * R + r) * DV;
      std::fill(o, o + DV, 0.f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float w = std::exp2(ls[sp * R] - lse2);
        const float* po = part_out.data() + ((pair * splits + sp) * R + r) * DV;
        for (int64_t d = 0; d < DV; ++d) o[d] += w * po[d];
      }
    }
  }
}

template <typename T>
void dispatch_dim(const at::Tensor& qs, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse) {
  switch (qs.size(3)) {
    case 32: return run<T, 32>(qs, k, v, out, lse);
    case 64: return run<T, 64>(qs, k, v, out, lse);
    case 128: return run<T, 128>(qs, k, v, out, lse);
    default: return run<T, 0>(qs, k, v, out, lse);
  }
}

// ----- a ragged batch's whole verify step, one call a layer -------------------------------------
// Segment s (one request) is rows starts[s] .. ends[s] (n_s of them) of the packed queries and
// its own keys ks[s], vs[s] (1, Hkv, P_s + n_s, D): P_s cached, then its n_s new ones. Every row
// sees the whole prefix and, among the new keys, what owns[s] (n_s x n_s bool; empty: causal)
// allows. Work items are (segment, kv head, split of the prefix), as in run(); a second pass per
// (segment, kv head) merges the splits and the new keys by log-sum-exp. qs: (Hq, N, D), already
// times scale * log2 e; out: (N, Hq, Dv), the layout the model's attention returns.
template <typename T>
struct Tag { using type = T; };

template <typename T, int DC>
void ragged_run(const at::Tensor& qs, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
                const std::vector<at::Tensor>& owns, at::Tensor& out) {
  const int64_t S = static_cast<int64_t>(ks.size()), Hq = qs.size(0), N = qs.size(1), D = qs.size(2);
  const int64_t Hkv = ks[0].size(1), G = Hq / Hkv, DV = vs[0].size(3);
  const int64_t pairs = S * Hkv, threads = at::get_num_threads();
  std::vector<int64_t> splits(S), chunk(S), first(S + 1, 0), base(S + 1, 0);   // items, part rows before s
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = ends[s] - starts[s], P = ks[s].size(2) - n;
    int64_t sp = P == 0 ? 0 : pairs >= threads ? 1
               : std::min<int64_t>((threads + pairs - 1) / pairs, std::max<int64_t>(1, P / 1024));
    chunk[s] = sp == 0 ? 0 : ((P + sp - 1) / sp + BN - 1) / BN * BN;
    splits[s] = sp == 0 ? 0 : (P + chunk[s] - 1) / chunk[s];
    first[s + 1] = first[s] + Hkv * splits[s];
    base[s + 1] = base[s] + Hkv * splits[s] * G * n;
  }
  std::vector<float> part_out(base[S] * DV), part_lse(base[S]);
  const float* qp = qs.data_ptr<float>();
  // the rows of (segment s, kv head h), r = g * n + i: query head h * G + g at token starts[s] + i
  const auto gather_rows = [&](int64_t s, int64_t h, float* rows) {
    const int64_t n = ends[s] - starts[s];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(rows + (g * n + i) * D, qp + ((h * G + g) * N + starts[s] + i) * D, D * sizeof(float));
  };
  const auto segment_of = [&](int64_t item) {
    return static_cast<int64_t>(std::upper_bound(first.begin(), first.end(), item) - first.begin()) - 1;
  };
  at::parallel_for(0, first[S], 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t s = segment_of(item), n = ends[s] - starts[s], R = G * n;
      const int64_t h = (item - first[s]) / splits[s], sp = (item - first[s]) % splits[s];
      const int64_t P = ks[s].size(2) - n, begin = sp * chunk[s], end = std::min(P, begin + chunk[s]);
      rows.resize(R * D);
      gather_rows(s, h, rows.data());
      const at::Tensor& k = ks[s];
      const at::Tensor& v = vs[s];
      const int64_t at = base[s] + (h * splits[s] + sp) * R;
      attend_range<T, DC>(rows.data(), R, D, DV, k.data_ptr<T>() + h * k.stride(1), k.stride(2),
                          v.data_ptr<T>() + h * v.stride(1), v.stride(2), begin, end,
                          part_out.data() + at * DV, part_lse.data() + at);
    }
  });
  float* op = out.data_ptr<float>();
  at::parallel_for(0, pairs, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> rows, score, acc(DV);
    for (int64_t pair = lo; pair < hi; ++pair) {
      const int64_t s = pair / Hkv, h = pair % Hkv, n = ends[s] - starts[s], R = G * n, sp_n = splits[s];
      const int64_t P = ks[s].size(2) - n;
      const at::Tensor& k = ks[s];
      const at::Tensor& v = vs[s];
      const T* kh = k.data_ptr<T>() + h * k.stride(1) + P * k.stride(2);     // the new keys
      const T* vh = v.data_ptr<T>() + h * v.stride(1) + P * v.stride(2);
      const bool* own = owns[s].numel() ? owns[s].data_ptr<bool>() : nullptr;
      rows.resize(R * D);
      score.resize(n);
      gather_rows(s, h, rows.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / n, i = r % n;
        const float* q = rows.data() + r * D;
        // the prefix's splits: their log-sum-exps (base 2) and normalised outputs
        const int64_t at = base[s] + h * sp_n * R + r;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < sp_n; ++sp) mx = std::max(mx, part_lse[at + sp * R]);
        for (int64_t j = 0; j < n; ++j) {
          const bool seen = own ? own[i * n + j] : j <= i;
          float dot = -std::numeric_limits<float>::infinity();
          if (seen) {
            dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += q[d] * to_float(kh[j * k.stride(2) + d]);
          }
          score[j] = dot;
          mx = std::max(mx, dot);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t sp = 0; sp < sp_n; ++sp) {
          const float w = std::exp2(part_lse[at + sp * R] - mx);
          const float* po = part_out.data() + (at + sp * R) * DV;
          for (int64_t d = 0; d < DV; ++d) acc[d] += w * po[d];
          total += w;
        }
        for (int64_t j = 0; j < n; ++j) {
          if (score[j] == -std::numeric_limits<float>::infinity()) continue;
          const float w = std::exp2(score[j] - mx);
          for (int64_t d = 0; d < DV; ++d) acc[d] += w * to_float(vh[j * v.stride(2) + d]);
          total += w;
        }
        float* o = op + ((starts[s] + i) * Hq + h * G + g) * DV;
        for (int64_t d = 0; d < DV; ++d) o[d] = acc[d] / total;
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "prefix_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "prefix_attention: q, k, v must be (B, Hkv, rows|P, D)");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "prefix_attention: k and v must share a dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(0) == q.size(0) && v.size(1) == q.size(1)
                  && k.size(2) == v.size(2) && k.size(3) == q.size(3) && k.size(2) >= 1,
              "prefix_attention: shapes do not match (q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ")");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "prefix_attention: k and v need a contiguous last dim");
  // q times scale * log2(e): the scores come out in base 2, exp2 needs no further multiply
  const at::Tensor qs = (q.to(at::kFloat) * (scale * LOG2E)).contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (k.scalar_type() == at::kFloat) {
    dispatch_dim<float>(qs, k, v, out, lse);
  } else if (k.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(qs, k, v, out, lse);
  } else {
    TORCH_CHECK(false, "prefix_attention: keys must be float32 or bfloat16, not ", k.scalar_type());
  }
  return {out, lse};
}

at::Tensor ragged_attention(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
                            const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
                            const std::vector<at::Tensor>& owns, double scale) {
  const int64_t S = static_cast<int64_t>(ks.size());
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && q.size(0) == 1, "ragged_attention: q must be (1, Hq, N, D) on the CPU");
  TORCH_CHECK(S >= 1 && static_cast<int64_t>(vs.size()) == S && static_cast<int64_t>(starts.size()) == S
                  && static_cast<int64_t>(ends.size()) == S && static_cast<int64_t>(owns.size()) == S,
              "ragged_attention: one key, value, start, end and mask entry a segment");
  const int64_t Hq = q.size(1), N = q.size(2), D = q.size(3);
  const auto dtype = ks[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "ragged_attention: keys must be float32 or bfloat16");
  const int64_t Hkv = ks[0].size(1), DV = vs[0].size(3);
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "ragged_attention: query heads must be a multiple of kv heads");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = ends[s] - starts[s];
    const at::Tensor& k = ks[s];
    const at::Tensor& v = vs[s];
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k.scalar_type() == dtype && v.scalar_type() == dtype,
                "ragged_attention: keys and values on the CPU, one dtype");
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == 1 && v.size(0) == 1 && k.size(1) == Hkv
                    && v.size(1) == Hkv && k.size(3) == D && v.size(3) == DV && k.size(2) == v.size(2),
                "ragged_attention: segment ", s, " has keys ", k.sizes(), " and values ", v.sizes());
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "ragged_attention: keys and values need a contiguous last dim");
    TORCH_CHECK(n >= 1 && starts[s] >= 0 && ends[s] <= N && (s == 0 || starts[s] >= ends[s - 1]) && k.size(2) >= n,
                "ragged_attention: segment ", s, " rows ", starts[s], "..", ends[s], " do not fit");
    TORCH_CHECK(owns[s].numel() == 0 || (owns[s].scalar_type() == at::kBool && owns[s].is_contiguous()
                                         && owns[s].dim() == 2 && owns[s].size(0) == n && owns[s].size(1) == n),
                "ragged_attention: segment ", s, "'s own mask must be empty or (n, n) bool");
  }
  const at::Tensor qs = (q[0].to(at::kFloat) * (scale * LOG2E)).contiguous();     // (Hq, N, D)
  at::Tensor out = at::zeros({N, Hq, DV}, q.options().dtype(at::kFloat));
  const auto go = [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (D) {
      case 32: return ragged_run<T, 32>(qs, ks, vs, starts, ends, owns, out);
      case 64: return ragged_run<T, 64>(qs, ks, vs, starts, ends, owns, out);
      case 128: return ragged_run<T, 128>(qs, ks, vs, starts, ends, owns, out);
      default: return ragged_run<T, 0>(qs, ks, vs, starts, ends, owns, out);
    }
  };
  if (dtype == at::kFloat) go(Tag<float>()); else go(Tag<c10::BFloat16>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefix_attention", &prefix_attention, "unmasked attention of all rows over the cached prefix (out, lse)");
  m.def("ragged_attention", &ragged_attention,
        "a ragged batch's verify attention: every segment's rows over its prefix and its own new keys, (N, Hq, Dv)");
}
