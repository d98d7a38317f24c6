// The Sparrow draft's batched levels (sparrow/models/draft_compile.py: draft_layers, draft_level,
// greedy_chain) as plain loops, for a small float32 draft on the CPU. A draft level is one small
// decoder layer over ~100 keys: through torch it is ~80 tiny ops, each paying a dispatch (and in
// Python its interpreter) of microseconds, for arithmetic of microseconds in all. Here a level is
// one pass: matrix-vector products with each weight row read once for all of the level's rows,
// RMSNorm, rotary, the window / pinned / tree mask and a softmax over each row's visible keys,
// all in registers and L1. The same maths as the Python functions, in float32 with float32
// accumulation (sums in another order: equal within float tolerance, tests/test_draft_native.py).
// A commit's emitted rows run only where real: a request brings fewer than the batch's M, and
// its padding rows (at PAD_POS, read by no live row) are skipped, their keys and values unwritten.
// Beside the levels, the copies around them that were per-request torch ops: a request's first
// entries (SparrowDraft.forward_entries), the batch's gather from the requests' caches, a chain's
// emitted entries kept in them, and their compaction (DraftKV.evict). Nothing reads a value on
// the host beyond what the Python reads; no allocation but the outputs and a level's scratch.
//
// Weights, flat: embed (V, E), fc (H, E + H), final norm (H), lm_head (V, H), fuse (H, F),
// rotary inverse frequencies (D / 2), then per layer: input norm (H), qkv (Q, H), qkv bias (Q),
// o (H, hq D), post norm (H), gate_up (2 I, H), down (H, I); Q = (hq + 2 hkv) D.
// Lean headers, not torch/extension.h (the whole C++ frontend: a fresh build took 39 s, now 21 s).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using at::Tensor;
using TensorList = std::vector<Tensor>;
constexpr int64_t HEAD_WEIGHTS = 6;  // embed, fc, final norm, lm_head, fuse, inv_freq
constexpr int64_t PER_LAYER = 7;

struct Layer {
  const float *in_norm, *qkv_w, *qkv_b, *o_w, *post_norm, *gate_up_w, *down_w;
};

struct Net {
  const float *embed, *fc, *final_norm, *head, *fuse, *inv_freq;
  std::vector<Layer> layers;
  int64_t vocab, embed_dim, hidden, features, inter, hq, hkv, d;
  float eps;
  int64_t window;
};

const float* f32(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "native draft: ", what, " must be a contiguous float32 CPU tensor");
  return t.data_ptr<float>();
}

Net make_net(const TensorList& w, int64_t hq, int64_t hkv, int64_t d, double eps, int64_t window) {
  TORCH_CHECK(w.size() > HEAD_WEIGHTS && (w.size() - HEAD_WEIGHTS) % PER_LAYER == 0, "native draft: weight list");
  Net n;
  n.embed = f32(w[0], "embed");
  n.fc = f32(w[1], "fc");
  n.final_norm = f32(w[2], "final norm");
  n.head = f32(w[3], "lm_head");
  n.fuse = f32(w[4], "fuse");
  n.inv_freq = f32(w[5], "inv_freq");
  n.vocab = w[3].size(0);
  n.embed_dim = w[0].size(1);
  n.hidden = w[1].size(0);
  n.features = w[4].size(1);
  n.hq = hq;
  n.hkv = hkv;
  n.d = d;
  n.eps = static_cast<float>(eps);
  n.window = window;
  n.inter = w[HEAD_WEIGHTS + 5].size(0) / 2;
  TORCH_CHECK(w[1].size(1) == n.embed_dim + n.hidden && w[3].size(1) == n.hidden && w[5].numel() == d / 2,
              "native draft: weight shapes");
  for (size_t i = HEAD_WEIGHTS; i < w.size(); i += PER_LAYER)
    n.layers.push_back({f32(w[i], "input norm"), f32(w[i + 1], "qkv"), f32(w[i + 2], "qkv bias"), f32(w[i + 3], "o"),
                        f32(w[i + 4], "post norm"), f32(w[i + 5], "gate_up"), f32(w[i + 6], "down")});
  return n;
}

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y[r, o] (+)= W[o, :] . x[r, :] (+ bias[o]) for `rows` rows: four weight rows at a time against
// each input row (four independent sums: no single add chain; the block's weights stay in L1
// for all rows)
void matvec(const float* w, const float* bias, int64_t out, int64_t in, const float* x, int64_t x_stride, int64_t rows,
            float* y, int64_t y_stride, bool accumulate) {
  int64_t o = 0;
  for (; o + 4 <= out; o += 4) {
    const float *w0 = w + o * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * x_stride;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t i = 0; i < in; ++i) {
        a0 += w0[i] * xr[i];
        a1 += w1[i] * xr[i];
        a2 += w2[i] * xr[i];
        a3 += w3[i] * xr[i];
      }
      const float v[4] = {a0, a1, a2, a3};
      for (int64_t j = 0; j < 4; ++j) {
        float& dst = y[r * y_stride + o + j];
        const float val = v[j] + (bias ? bias[o + j] : 0.f);
        dst = accumulate ? dst + val : val;
      }
    }
  }
  for (; o < out; ++o)
    for (int64_t r = 0; r < rows; ++r) {
      const float val = dot(w + o * in, x + r * x_stride, in) + (bias ? bias[o] : 0.f);
      float& dst = y[r * y_stride + o];
      dst = accumulate ? dst + val : val;
    }
}

// out = x / sqrt(mean(x^2) + eps) * weight, per row of n
void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  const float inv = 1.f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

// one row of head_dim d rotated in place at angle table cos/sin (d / 2 each): x * cos + cat(-x2, x1) * sin
void rotate(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; ++j) {
    const float x1 = x[j], x2 = x[j + h];
    x[j] = x1 * cos[j] - x2 * sin[j];
    x[j + h] = x2 * cos[j] + x1 * sin[j];
  }
}

// The request batch's buffers a level reads and writes (draft_compile.draft_layers' arguments).
struct Batch {
  int64_t b, c, cap;       // requests; key slots a row may see ([0, c)); slots a request's buffers hold
  int64_t* pos;            // (B, cap), written at the level's slots
  const bool* pinned;      // (B, cap)
  const bool* allowed;     // (B, Ra, c), Ra = 1 (broadcast over rows) or R; null: every slot allowed
  int64_t allowed_rows;
  std::vector<float*> keys, values;   // per layer (B, Hkv, cap, D), written at the level's slots
};

Batch make_batch(Tensor& pos, const Tensor& pinned, const Tensor* allowed, TensorList& keys, TensorList& values,
                 int64_t c) {
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == at::kLong && pinned.is_contiguous() &&
                  pinned.scalar_type() == at::kBool && (!allowed || (allowed->is_contiguous() &&
                  allowed->scalar_type() == at::kBool)), "native draft: pos (long), pinned and allowed (bool) must be contiguous");
  Batch bt{pos.dim() == 1 ? 1 : pos.size(0), c, pos.size(-1), pos.data_ptr<int64_t>(), pinned.data_ptr<bool>(),
           allowed ? allowed->data_ptr<bool>() : nullptr, allowed ? allowed->size(1) : 1, {}, {}};
  for (size_t i = 0; i < keys.size(); ++i) {
    TORCH_CHECK(keys[i].size(2) == bt.cap && values[i].size(2) == bt.cap, "native draft: key buffers and positions differ");
    bt.keys.push_back(const_cast<float*>(f32(keys[i], "keys")));
    bt.values.push_back(const_cast<float*>(f32(values[i], "values")));
  }
  return bt;
}

// z = fc [embed(token), hidden] for `rows` rows: the layers' input of drafted (or emitted) tokens
void embed_rows(const Net& n, const int64_t* tokens, const float* hidden, int64_t rows, float* x) {
  const int64_t h = n.hidden, width = n.embed_dim + h;
  std::vector<float> z(rows * width);
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(tokens[row] >= 0 && tokens[row] < n.vocab, "native draft: token id out of range");
    std::copy_n(n.embed + tokens[row] * n.embed_dim, n.embed_dim, z.data() + row * width);
    std::copy_n(hidden + row * h, h, z.data() + row * width + n.embed_dim);
  }
  matvec(n.fc, nullptr, h, width, z.data(), width, rows, x, h, false);
}

// Which request and key slot each row of a layers() call is: all rows (b, r) of a (B, R) grid at
// slots[r] (`grid`), or a subset of them (a commit's real emitted rows).
struct Rows {
  std::vector<int64_t> req, within, slot;     // per row: its request b, its r (the tree rule's row), its slot
  int64_t size() const { return static_cast<int64_t>(req.size()); }
  void add(int64_t b, int64_t r, int64_t s) {
    req.push_back(b);
    within.push_back(r);
    slot.push_back(s);
  }
};

Rows grid(int64_t b, int64_t rows_per, const int64_t* slots) {
  Rows rows;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t r = 0; r < rows_per; ++r) rows.add(i, r, slots[r]);
  return rows;
}

// draft_layers' decoder layers for `rows`: x (N, H) their inputs, overwritten by their outputs;
// q_pos (N,); live (N,). Writes their keys, values and positions at their slots, and seen (N,).
// A row attends to the keys of its own request only.
void layers(const Net& n, Batch& bt, const Rows& rows, float* x, const int64_t* q_pos, const bool* live,
            int64_t* seen) {
  const int64_t nr = rows.size(), h = n.hidden, d = n.d, half = d / 2, group = n.hq / n.hkv;
  const int64_t q_width = (n.hq + 2 * n.hkv) * d;
  for (int64_t row = 0; row < nr; ++row) bt.pos[rows.req[row] * bt.cap + rows.slot[row]] = q_pos[row];
  // the visible keys of each row, and the rotary tables at its position
  std::vector<uint8_t> mask(nr * bt.c);
  std::vector<float> cs(nr * d);
  for (int64_t row = 0; row < nr; ++row) {
    const int64_t b = rows.req[row], r = rows.within[row], q = q_pos[row];
    const bool* allow =
        bt.allowed ? bt.allowed + (b * bt.allowed_rows + (bt.allowed_rows == 1 ? 0 : r)) * bt.c : nullptr;
    int64_t count = 0;
    for (int64_t c = 0; c < bt.c; ++c) {
      const int64_t k = bt.pos[b * bt.cap + c];
      const bool v = k <= q && (k > q - n.window || bt.pinned[b * bt.cap + c]) && (!allow || allow[c]);
      mask[row * bt.c + c] = v;
      count += v;
    }
    seen[row] = live[row] ? count : 0;
    const float p = static_cast<float>(std::max<int64_t>(q, 0));
    for (int64_t j = 0; j < half; ++j) {
      const float ang = p * n.inv_freq[j];
      cs[row * d + j] = std::cos(ang);
      cs[row * d + half + j] = std::sin(ang);
    }
  }
  std::vector<float> xn(nr * h), qkv(nr * q_width), att(nr * n.hq * d), gu(nr * 2 * n.inter), act(nr * n.inter),
      scores(bt.c);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  for (size_t li = 0; li < n.layers.size(); ++li) {
    const Layer& l = n.layers[li];
    for (int64_t row = 0; row < nr; ++row) rms_norm(x + row * h, l.in_norm, h, n.eps, xn.data() + row * h);
    matvec(l.qkv_w, l.qkv_b, q_width, h, xn.data(), h, nr, qkv.data(), q_width, false);
    for (int64_t row = 0; row < nr; ++row) {              // rotary on q and k heads; k, v into the row's slot
      float* t = qkv.data() + row * q_width;
      for (int64_t head = 0; head < n.hq + n.hkv; ++head) rotate(t + head * d, cs.data() + row * d, cs.data() + row * d + half, d);
      const int64_t b = rows.req[row], slot = rows.slot[row];
      for (int64_t g = 0; g < n.hkv; ++g) {
        const int64_t at_ = ((b * n.hkv + g) * bt.cap + slot) * d;
        std::copy_n(t + (n.hq + g) * d, d, bt.keys[li] + at_);
        std::copy_n(t + (n.hq + n.hkv + g) * d, d, bt.values[li] + at_);
      }
    }
    for (int64_t row = 0; row < nr; ++row) {              // softmax over the row's visible keys, per query head
      const int64_t b = rows.req[row];
      const uint8_t* m = mask.data() + row * bt.c;
      for (int64_t head = 0; head < n.hq; ++head) {
        const float* qh = qkv.data() + row * q_width + head * d;
        const int64_t g = head / group;
        const float* kh = bt.keys[li] + (b * n.hkv + g) * bt.cap * d;
        const float* vh = bt.values[li] + (b * n.hkv + g) * bt.cap * d;
        float* out = att.data() + (row * n.hq + head) * d;
        std::fill_n(out, d, 0.f);
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t c = 0; c < bt.c; ++c)
          if (m[c]) top = std::max(top, scores[c] = dot(qh, kh + c * d, d) * scale);
        if (top == -std::numeric_limits<float>::infinity()) continue;      // no key: a row nobody reads
        for (int64_t c = 0; c < bt.c; ++c) {
          if (!m[c]) continue;
          const float p = std::exp(scores[c] - top);
          sum += p;
          const float* vc = vh + c * d;
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) out[j] += p * vc[j];
        }
        for (int64_t j = 0; j < d; ++j) out[j] /= sum;
      }
    }
    matvec(l.o_w, nullptr, h, n.hq * d, att.data(), n.hq * d, nr, x, h, true);
    for (int64_t row = 0; row < nr; ++row) rms_norm(x + row * h, l.post_norm, h, n.eps, xn.data() + row * h);
    matvec(l.gate_up_w, nullptr, 2 * n.inter, h, xn.data(), h, nr, gu.data(), 2 * n.inter, false);
    for (int64_t row = 0; row < nr; ++row)
      for (int64_t j = 0; j < n.inter; ++j) {
        const float g = gu[row * 2 * n.inter + j];
        act[row * n.inter + j] = g / (1.f + std::exp(-g)) * gu[row * 2 * n.inter + n.inter + j];
      }
    matvec(l.down_w, nullptr, h, n.inter, act.data(), n.inter, nr, x, h, true);
  }
}

// logits (rows, V) of outputs x, and each row's top log-probability and id (log_softmax's max, first on ties)
void logits_top(const Net& n, const float* x, int64_t rows, float* logits, float* top_logp, int64_t* top_id) {
  std::vector<float> xn(rows * n.hidden);
  for (int64_t r = 0; r < rows; ++r) rms_norm(x + r * n.hidden, n.final_norm, n.hidden, n.eps, xn.data() + r * n.hidden);
  matvec(n.head, nullptr, n.vocab, n.hidden, xn.data(), n.hidden, rows, logits, n.vocab, false);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * n.vocab;
    int64_t best = 0;
    for (int64_t v = 1; v < n.vocab; ++v)
      if (l[v] > l[best]) best = v;
    double sum = 0.0;
    for (int64_t v = 0; v < n.vocab; ++v) sum += std::exp(static_cast<double>(l[v] - l[best]));
    top_logp[r] = static_cast<float>(-std::log(sum));
    top_id[r] = best;
  }
}

// speculative/sampling.py's seeded noise, bit for bit in the integers: splitmix64's finalizer,
// the key of (seed, output position), and a token's standard Gumbel draw under it.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

float gumbel(uint64_t key, int64_t token) {
  const uint64_t bits = mix64(key * 0xBF58476D1CE4E5B9ULL + static_cast<uint64_t>(token));
  const double u = (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
  return static_cast<float>(-std::log(-std::log(u)));
}

// A seeded request's draw from the draft's q = softmax(logits / temperature): Gumbel-max under its
// noise at this output position (PositionNoise.pick), and log q of the token drawn.
void pick_seeded(const float* l, int64_t vocab, double temperature, uint64_t seed, int64_t position,
                 int64_t* token, float* logp) {
  const float t = static_cast<float>(temperature);
  const uint64_t key = mix64(seed ^ mix64(static_cast<uint64_t>(position)));
  float top = -std::numeric_limits<float>::infinity(), best = top;
  int64_t arg = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float s = l[v] / t;
    top = std::max(top, s);
    const float z = s + gumbel(key, v);
    if (z > best) best = z, arg = v;
  }
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(l[v] / t - top));
  *token = arg;
  *logp = static_cast<float>(static_cast<double>(l[arg] / t - top) - std::log(sum));
}

const int64_t* i64(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
              "native draft: ", what, " must be a contiguous int64 CPU tensor");
  return t.data_ptr<int64_t>();
}

const bool* flags(const Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBool && t.is_contiguous(),
              "native draft: ", what, " must be a contiguous bool CPU tensor");
  return t.data_ptr<bool>();
}

// draft_compile.draft_level: tokens (B, R), hidden (B, R, H), q_pos (B, R), live (B, R), slots (R,).
// Returns hidden (B, R, H), logits (B, R, V), top log-probability (B, R) float32, top id (B, R), seen (B, R).
std::vector<Tensor> draft_level(int64_t hq, int64_t hkv, int64_t d, double eps, int64_t window, const TensorList& w,
                                const Tensor& tokens, const Tensor& hidden, const Tensor& q_pos, const Tensor& live,
                                const Tensor& allowed, const Tensor& slots, Tensor pos, const Tensor& pinned,
                                TensorList keys, TensorList values) {
  const Net n = make_net(w, hq, hkv, d, eps, window);
  Batch bt = make_batch(pos, pinned, &allowed, keys, values, pos.size(1));
  const int64_t b = tokens.size(0), r = tokens.size(1);
  auto f = hidden.options();
  Tensor x = at::empty({b, r, n.hidden}, f), logits = at::empty({b, r, n.vocab}, f), logp = at::empty({b, r}, f);
  Tensor id = at::empty({b, r}, tokens.options()), seen = at::empty({b, r}, tokens.options());
  embed_rows(n, i64(tokens, "tokens"), f32(hidden, "hidden"), b * r, x.data_ptr<float>());
  layers(n, bt, grid(b, r, i64(slots, "slots")), x.data_ptr<float>(), i64(q_pos, "q_pos"), flags(live, "live"),
         seen.data_ptr<int64_t>());
  logits_top(n, x.data_ptr<float>(), b * r, logits.data_ptr<float>(), logp.data_ptr<float>(), id.data_ptr<int64_t>());
  return {x, logits, logp, id, seen};
}

// draft_compile.greedy_chain: hidden (B, 1, H); q_pos (L, B); live (L, B, 1); slots (L, 1); emitted: empty,
// or (tokens (B, M), features (B, M, F), pos (B, M), last (B,), slots (M,)); pad_pos: PAD_POS; seeded:
// empty, or (temperature (B,) float64, seed (B,) int64, position (B,) int64): a row with a temperature
// > 0 draws each pick j of its chain by its seeded noise at output position position + j (pick_seeded).
// Returns (B, 2 (L + 1) + 1) float64 (tokens, cumulative log-probabilities, most keys seen) and the
// output the chains started from (B, 1, H).
std::vector<Tensor> greedy_chain(int64_t hq, int64_t hkv, int64_t d, double eps, int64_t window, int64_t pad_pos,
                                 const TensorList& w, const Tensor& hidden, const Tensor& q_pos, const Tensor& live,
                                 const Tensor& allowed, const Tensor& slots, Tensor pos, const Tensor& pinned,
                                 TensorList keys, TensorList values, const TensorList& emitted,
                                 const TensorList& seeded) {
  const Net n = make_net(w, hq, hkv, d, eps, window);
  Batch bt = make_batch(pos, pinned, &allowed, keys, values, pos.size(1));
  const int64_t b = hidden.size(0), h = n.hidden, levels = q_pos.size(0), width = 2 * (levels + 1) + 1;
  const double* temps = nullptr;
  const int64_t *seeds = nullptr, *positions = nullptr;
  if (!seeded.empty()) {
    TORCH_CHECK(seeded[0].scalar_type() == at::kDouble && seeded[0].is_contiguous() && seeded[0].numel() == b,
                "native draft: seeded temperatures must be a contiguous (B,) float64 tensor");
    TORCH_CHECK(seeded[1].numel() == b && seeded[2].numel() == b, "native draft: seeded needs (B,) seeds and positions");
    temps = seeded[0].data_ptr<double>();
    seeds = i64(seeded[1], "seeds");
    positions = i64(seeded[2], "positions");
  }
  // pick j of every row: the top token, or a seeded row's draw (replacing the top one logits_top found)
  auto pick = [&](const float* logits, float* logp, int64_t* token, int64_t j) {
    if (temps == nullptr) return;
    for (int64_t i = 0; i < b; ++i)
      if (temps[i] > 0.0)
        pick_seeded(logits + i * n.vocab, n.vocab, temps[i], static_cast<uint64_t>(seeds[i]), positions[i] + j,
                    token + i, logp + i);
  };
  Tensor start = hidden.clone();
  float* x = start.data_ptr<float>();
  std::vector<int64_t> most(b, 0);
  if (!emitted.empty()) {                    // the emitted entries first; a request with any starts from its last
    // Only the real rows run (a padding row's outputs, keys and values are read by nothing: its
    // position, PAD_POS, written at its slot, hides it from every query), packed together.
    const int64_t m = emitted[0].size(1), f = n.features;
    const int64_t* e_tokens = i64(emitted[0], "emitted tokens");
    const float* e_features = f32(emitted[1], "emitted features");
    const int64_t* e_pos = i64(emitted[2], "emitted pos");
    const int64_t* last = i64(emitted[3], "emitted last");
    const int64_t* e_slots = i64(emitted[4], "emitted slots");
    Rows rows;
    std::vector<int64_t> tokens, q_pos, at(b * m, -1);
    std::vector<float> features;
    for (int64_t i = 0; i < b; ++i)
      for (int64_t j = 0; j < m; ++j) {
        if (e_pos[i * m + j] == pad_pos) {
          bt.pos[i * bt.cap + e_slots[j]] = pad_pos;
          continue;
        }
        at[i * m + j] = rows.size();
        rows.add(i, j, e_slots[j]);
        tokens.push_back(e_tokens[i * m + j]);
        q_pos.push_back(e_pos[i * m + j]);
        features.insert(features.end(), e_features + (i * m + j) * f, e_features + (i * m + j + 1) * f);
      }
    const int64_t nr = rows.size();
    std::vector<float> fused(nr * h), out(nr * h);
    std::vector<int64_t> seen(nr);
    const std::vector<uint8_t> real(nr, 1);
    matvec(n.fuse, nullptr, h, f, features.data(), f, nr, fused.data(), h, false);
    embed_rows(n, tokens.data(), fused.data(), nr, out.data());
    layers(n, bt, rows, out.data(), q_pos.data(), reinterpret_cast<const bool*>(real.data()), seen.data());
    for (int64_t row = 0; row < nr; ++row) most[rows.req[row]] = std::max(most[rows.req[row]], seen[row]);
    for (int64_t i = 0; i < b; ++i) {
      bool any = false;
      for (int64_t j = 0; j < m; ++j) any = any || at[i * m + j] >= 0;
      if (!any) continue;
      TORCH_CHECK(last[i] >= 0 && last[i] < m && at[i * m + last[i]] >= 0, "native draft: a request's last emitted row is padding");
      std::copy_n(out.data() + at[i * m + last[i]] * h, h, x + i * h);
    }
  }
  Tensor result = at::empty({b, width}, hidden.options().dtype(at::kDouble));
  double* res = result.data_ptr<double>();
  std::vector<float> logits(b * n.vocab), logp(b), cur(x, x + b * h), next(b * h);
  std::vector<int64_t> token(b), seen(b);
  std::vector<double> score(b);
  logits_top(n, cur.data(), b, logits.data(), logp.data(), token.data());
  pick(logits.data(), logp.data(), token.data(), 0);
  for (int64_t i = 0; i < b; ++i) {
    score[i] = logp[i];
    res[i * width] = static_cast<double>(token[i]);
    res[i * width + levels + 1] = score[i];
  }
  const int64_t* qp = i64(q_pos, "q_pos");
  const bool* lv = flags(live, "live");
  const int64_t* sl = i64(slots, "slots");
  for (int64_t level = 0; level < levels; ++level) {
    embed_rows(n, token.data(), cur.data(), b, next.data());
    layers(n, bt, grid(b, 1, sl + level), next.data(), qp + level * b, lv + level * b, seen.data());
    logits_top(n, next.data(), b, logits.data(), logp.data(), token.data());
    pick(logits.data(), logp.data(), token.data(), level + 1);
    std::swap(cur, next);
    for (int64_t i = 0; i < b; ++i) {
      score[i] += static_cast<double>(logp[i]);
      res[i * width + level + 1] = static_cast<double>(token[i]);
      res[i * width + levels + 2 + level] = score[i];
      most[i] = std::max(most[i], seen[i]);
    }
  }
  for (int64_t i = 0; i < b; ++i) res[i * width + width - 1] = static_cast<double>(most[i]);
  return {result, start};
}

// SparrowDraft.forward_entries: one request's new entries z (N, H) (the layers' inputs) at positions
// q_pos (N,), pinned (N,), appended to its DraftKV's buffers (pos and pinned (cap,), keys and values
// per layer (1, Hkv, cap, D)) after its `length` filled entries, each attending by the window rule
// to the filled entries and the new ones. Returns the outputs (N, H) and the most keys a row saw.
std::tuple<Tensor, int64_t> entries(int64_t hq, int64_t hkv, int64_t d, double eps, int64_t window,
                                    const TensorList& w, const Tensor& z, const Tensor& q_pos, const Tensor& new_pinned,
                                    Tensor pos, Tensor pinned, TensorList keys, TensorList values, int64_t length) {
  const Net n = make_net(w, hq, hkv, d, eps, window);
  const int64_t rows = z.size(0);
  TORCH_CHECK(z.size(1) == n.hidden && length + rows <= pos.size(0), "native draft: entries do not fit");
  TORCH_CHECK(new_pinned.is_contiguous() && new_pinned.scalar_type() == at::kBool, "native draft: pinned flags");
  std::copy_n(new_pinned.data_ptr<bool>(), rows, pinned.data_ptr<bool>() + length);   // positions: layers writes them
  Batch bt = make_batch(pos, pinned, nullptr, keys, values, length + rows);
  Tensor x = z.clone();
  std::vector<int64_t> slots(rows), seen(rows);
  for (int64_t i = 0; i < rows; ++i) slots[i] = length + i;
  const std::vector<uint8_t> live(rows, 1);
  layers(n, bt, grid(1, rows, slots.data()), x.data_ptr<float>(), i64(q_pos, "q_pos"),
         reinterpret_cast<const bool*>(live.data()), seen.data());
  return {x, rows ? *std::max_element(seen.begin(), seen.end()) : 0};
}

// draft_compile.DraftLevels.gather's copies: request b's `lengths[b]` filled entries of its DraftKV
// (pos, pinned (cap_b,); keys, values per layer (1, Hkv, cap_b, D)) into the batch's buffers at
// slots [0, lengths[b]); slots [lengths[b], C) at pad_pos, unpinned, keys and values zero; the
// padding requests (b >= n) at pad_pos.
void gather(Tensor pos, Tensor pinned, TensorList keys, TensorList values, const TensorList& kv_pos,
            const TensorList& kv_pinned, const std::vector<TensorList>& kv_keys, const std::vector<TensorList>& kv_values,
            int64_t pad_pos) {
  Batch bt = make_batch(pos, pinned, nullptr, keys, values, pos.size(1));
  const int64_t n = static_cast<int64_t>(kv_pos.size());
  TORCH_CHECK(n <= bt.b && kv_pinned.size() == kv_pos.size() && kv_keys.size() == kv_pos.size() &&
              kv_values.size() == kv_pos.size(), "native draft: gather's lists");
  bool* batch_pinned = pinned.data_ptr<bool>();
  for (int64_t b = 0; b < bt.b; ++b) {
    const int64_t len = b < n ? kv_pos[b].size(0) : 0;
    TORCH_CHECK(len <= bt.cap, "native draft: a request's cache is longer than the batch's slots");
    if (b < n) {
      std::copy_n(i64(kv_pos[b], "cache positions"), len, bt.pos + b * bt.cap);
      std::copy_n(flags(kv_pinned[b], "cache pinned flags"), len, batch_pinned + b * bt.cap);
    }
    std::fill(bt.pos + b * bt.cap + len, bt.pos + (b + 1) * bt.cap, pad_pos);
    std::fill(batch_pinned + b * bt.cap + len, batch_pinned + (b + 1) * bt.cap, false);
    if (b >= n) continue;
    for (size_t layer = 0; layer < bt.keys.size(); ++layer) {
      for (const auto& [dst, src] : {std::pair<float*, const Tensor*>{bt.keys[layer], &kv_keys[b][layer]},
                                     std::pair<float*, const Tensor*>{bt.values[layer], &kv_values[b][layer]}}) {
        const Tensor& t = *src;        // (1, Hkv, cap_b, D), a view of the filled part or the whole buffer
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.stride(3) == 1 && t.size(2) >= len,
                    "native draft: cache keys must be float32 CPU rows");
        const int64_t hkv = t.size(1), d = t.size(3);
        const float* from = t.data_ptr<float>();
        for (int64_t g = 0; g < hkv; ++g) {
          float* to = dst + ((b * hkv + g) * bt.cap) * d;
          const float* head = from + g * t.stride(1);
          for (int64_t e = 0; e < len; ++e) std::copy_n(head + e * t.stride(2), d, to + e * d);
          std::fill(to + len * d, to + bt.cap * d, 0.f);
        }
      }
    }
  }
}

// The other way (SparrowProposer._keep_emitted's copies): request b's counts[b] entries at the batch's
// slots [start, start + counts[b]) appended to its DraftKV's whole buffers (pos, pinned (cap_b,);
// keys, values per layer (1, Hkv, cap_b, D)) after its lengths[b] filled entries, unpinned.
void scatter(const Tensor& pos, const TensorList& keys, const TensorList& values, int64_t start,
             const std::vector<int64_t>& counts, const std::vector<int64_t>& lengths, const TensorList& kv_pos,
             const TensorList& kv_pinned, const std::vector<TensorList>& kv_keys,
             const std::vector<TensorList>& kv_values) {
  const int64_t cap = pos.size(1);
  const int64_t* from_pos = i64(pos, "batch positions");
  for (size_t b = 0; b < counts.size(); ++b) {
    const int64_t m = counts[b], len = lengths[b];
    if (m == 0) continue;
    TORCH_CHECK(start + m <= cap && len + m <= kv_pos[b].size(0), "native draft: scatter out of range");
    std::copy_n(from_pos + b * cap + start, m, const_cast<int64_t*>(i64(kv_pos[b], "cache positions")) + len);
    std::fill_n(const_cast<bool*>(flags(kv_pinned[b], "cache pinned flags")) + len, m, false);
    for (size_t layer = 0; layer < keys.size(); ++layer) {
      for (const auto& [src, dst] : {std::pair<const Tensor*, const Tensor*>{&keys[layer], &kv_keys[b][layer]},
                                     std::pair<const Tensor*, const Tensor*>{&values[layer], &kv_values[b][layer]}}) {
        const int64_t hkv = dst->size(1), d = dst->size(3), dcap = dst->size(2);
        const float* in = f32(*src, "batch keys");
        float* out = const_cast<float*>(f32(*dst, "cache keys"));
        for (int64_t g = 0; g < hkv; ++g)
          std::copy_n(in + ((b * hkv + g) * cap + start) * d, m * d, out + (g * dcap + len) * d);
      }
    }
  }
}

// DraftKV.evict's compaction: of a DraftKV's `length` filled entries (pos, pinned (cap,); keys, values
// per layer (1, Hkv, cap, D)), keep those a query at >= next_pos can see (pinned, or within the
// window), in order, at the front. Returns how many are kept.
int64_t compact(Tensor pos, Tensor pinned, TensorList keys, TensorList values, int64_t length, int64_t next_pos,
                int64_t window) {
  int64_t* p = const_cast<int64_t*>(i64(pos, "cache positions"));
  bool* pin = const_cast<bool*>(flags(pinned, "cache pinned flags"));
  const int64_t cap = pos.size(0);
  TORCH_CHECK(length <= cap, "native draft: compact past the buffers");
  std::vector<float*> bufs;
  for (const TensorList* list : {&keys, &values})
    for (const Tensor& t : *list) bufs.push_back(const_cast<float*>(f32(t, "cache keys")));
  const int64_t hkv = keys.empty() ? 0 : keys[0].size(1), d = keys.empty() ? 0 : keys[0].size(3);
  int64_t kept = 0;
  for (int64_t e = 0; e < length; ++e) {
    if (!(pin[e] || p[e] > next_pos - window)) continue;
    if (e != kept) {
      p[kept] = p[e];
      pin[kept] = pin[e];
      for (float* buf : bufs)
        for (int64_t g = 0; g < hkv; ++g) std::copy_n(buf + (g * cap + e) * d, d, buf + (g * cap + kept) * d);
    }
    ++kept;
  }
  return kept;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a call runs: a server's other threads (gRPC, request preparation) go on
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("draft_level", &draft_level, "one draft level (draft_compile.draft_level)", free);
  m.def("greedy_chain", &greedy_chain, "a chain of levels, greedy or seeded (draft_compile.greedy_chain)", free);
  m.def("entries", &entries, "one request's new entries through the layers (SparrowDraft.forward_entries)", free);
  m.def("gather", &gather, "the requests' draft caches into a batch's buffers (DraftLevels.gather)", free);
  m.def("scatter", &scatter, "a batch's emitted entries appended to the requests' draft caches", free);
  m.def("compact", &compact, "a draft cache's entries no query can see dropped (DraftKV.evict)", free);
}
