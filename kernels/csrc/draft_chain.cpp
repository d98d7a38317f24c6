// The Sparrow draft's batched levels (sparrow/models/draft_compile.py: draft_layers, draft_level,
// greedy_chain) as plain loops, for a small float32 draft on the CPU. A draft level is one small
// decoder layer over ~100 keys: through torch it is ~80 tiny ops, each paying a dispatch (and in
// Python its interpreter) of microseconds, for arithmetic of microseconds in all. Here a level is
// one pass: matrix-vector products with each weight row read once for all of the level's rows,
// RMSNorm, rotary, the window / pinned / tree mask and a softmax over each row's visible keys,
// all in registers and L1. The same maths as the Python functions, in float32 with float32
// accumulation (sums in another order: equal within float tolerance, tests/test_draft_native.py).
// Nothing reads a value on the host beyond what the Python reads; no allocation but the outputs.
//
// Weights, flat: embed (V, E), fc (H, E + H), final norm (H), lm_head (V, H), fuse (H, F),
// rotary inverse frequencies (D / 2), then per layer: input norm (H), qkv (Q, H), qkv bias (Q),
// o (H, hq D), post norm (H), gate_up (2 I, H), down (H, I); Q = (hq + 2 hkv) D.
#include <torch/extension.h>

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

// draft_layers' decoder layers for rows (b, r), b < B, r < R: x (B, R, H) their inputs, overwritten
// by their outputs; q_pos (B, R); live (B, R); slots (R,). Writes their keys, values and positions
// at `slots`, and seen (B, R).
void layers(const Net& n, Batch& bt, int64_t rows_per, float* x, const int64_t* q_pos, const bool* live,
            const int64_t* slots, int64_t* seen) {
  const int64_t nr = bt.b * rows_per, h = n.hidden, d = n.d, half = d / 2, group = n.hq / n.hkv;
  const int64_t q_width = (n.hq + 2 * n.hkv) * d;
  for (int64_t b = 0; b < bt.b; ++b)
    for (int64_t r = 0; r < rows_per; ++r) bt.pos[b * bt.cap + slots[r]] = q_pos[b * rows_per + r];
  // the visible keys of each row, and the rotary tables at its position
  std::vector<uint8_t> mask(nr * bt.c);
  std::vector<float> cs(nr * d);
  for (int64_t b = 0; b < bt.b; ++b) {
    for (int64_t r = 0; r < rows_per; ++r) {
      const int64_t row = b * rows_per + r, q = q_pos[row];
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
      const int64_t b = row / rows_per, slot = slots[row % rows_per];
      for (int64_t g = 0; g < n.hkv; ++g) {
        const int64_t at_ = ((b * n.hkv + g) * bt.cap + slot) * d;
        std::copy_n(t + (n.hq + g) * d, d, bt.keys[li] + at_);
        std::copy_n(t + (n.hq + n.hkv + g) * d, d, bt.values[li] + at_);
      }
    }
    for (int64_t row = 0; row < nr; ++row) {              // softmax over the row's visible keys, per query head
      const int64_t b = row / rows_per;
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
  layers(n, bt, r, x.data_ptr<float>(), i64(q_pos, "q_pos"), flags(live, "live"), i64(slots, "slots"),
         seen.data_ptr<int64_t>());
  logits_top(n, x.data_ptr<float>(), b * r, logits.data_ptr<float>(), logp.data_ptr<float>(), id.data_ptr<int64_t>());
  return {x, logits, logp, id, seen};
}

// draft_compile.greedy_chain: hidden (B, 1, H); q_pos (L, B); live (L, B, 1); slots (L, 1); emitted: empty,
// or (tokens (B, M), features (B, M, F), pos (B, M), last (B,), slots (M,)); pad_pos: PAD_POS.
// Returns (B, 2 (L + 1) + 1) float64 (tokens, cumulative log-probabilities, most keys seen) and the
// output the chains started from (B, 1, H).
std::vector<Tensor> greedy_chain(int64_t hq, int64_t hkv, int64_t d, double eps, int64_t window, int64_t pad_pos,
                                 const TensorList& w, const Tensor& hidden, const Tensor& q_pos, const Tensor& live,
                                 const Tensor& allowed, const Tensor& slots, Tensor pos, const Tensor& pinned,
                                 TensorList keys, TensorList values, const TensorList& emitted) {
  const Net n = make_net(w, hq, hkv, d, eps, window);
  Batch bt = make_batch(pos, pinned, &allowed, keys, values, pos.size(1));
  const int64_t b = hidden.size(0), h = n.hidden, levels = q_pos.size(0), width = 2 * (levels + 1) + 1;
  Tensor start = hidden.clone();
  float* x = start.data_ptr<float>();
  std::vector<int64_t> most(b, 0);
  if (!emitted.empty()) {                    // the emitted entries first; a request with any starts from its last
    const int64_t m = emitted[0].size(1);
    const int64_t* e_pos = i64(emitted[2], "emitted pos");
    const int64_t* last = i64(emitted[3], "emitted last");
    std::vector<uint8_t> real(b * m);
    for (int64_t i = 0; i < b * m; ++i) real[i] = e_pos[i] != pad_pos;
    std::vector<float> fused(b * m * h), out(b * m * h);
    std::vector<int64_t> seen(b * m);
    matvec(n.fuse, nullptr, h, n.features, f32(emitted[1], "emitted features"), n.features, b * m, fused.data(), h, false);
    embed_rows(n, i64(emitted[0], "emitted tokens"), fused.data(), b * m, out.data());
    layers(n, bt, m, out.data(), e_pos, reinterpret_cast<const bool*>(real.data()), i64(emitted[4], "emitted slots"),
           seen.data());
    for (int64_t i = 0; i < b; ++i) {
      bool any = false;
      for (int64_t j = 0; j < m; ++j) {
        any = any || real[i * m + j];
        most[i] = std::max(most[i], seen[i * m + j]);
      }
      if (any) std::copy_n(out.data() + (i * m + last[i]) * h, h, x + i * h);
    }
  }
  Tensor result = at::empty({b, width}, hidden.options().dtype(at::kDouble));
  double* res = result.data_ptr<double>();
  std::vector<float> logits(b * n.vocab), logp(b), cur(x, x + b * h), next(b * h);
  std::vector<int64_t> token(b), seen(b);
  std::vector<double> score(b);
  logits_top(n, cur.data(), b, logits.data(), logp.data(), token.data());
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
    layers(n, bt, 1, next.data(), qp + level * b, lv + level * b, sl + level, seen.data());
    logits_top(n, next.data(), b, logits.data(), logp.data(), token.data());
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
  layers(n, bt, rows, x.data_ptr<float>(), i64(q_pos, "q_pos"), reinterpret_cast<const bool*>(live.data()),
         slots.data(), seen.data());
  return {x, rows ? *std::max_element(seen.begin(), seen.end()) : 0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a call runs: a server's other threads (gRPC, request preparation) go on
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("draft_level", &draft_level, "one draft level (draft_compile.draft_level)", free);
  m.def("greedy_chain", &greedy_chain, "a greedy chain of levels (draft_compile.greedy_chain)", free);
  m.def("entries", &entries, "one request's new entries through the layers (SparrowDraft.forward_entries)", free);
}
