// The backward of the gated delta rule in chunks (delta_chunks.h): the chunks in reverse, each one's
// forward recomputed from its starting state, then the gradients of its products. With dS the
// gradient of the state after the chunk and dO of its outputs:
//   d delta = P^T dO + Kd dS,   dKd = delta dS^T,   dQd = dO S^T,   dP = dO delta^T (lower)
//   dS (before the chunk) = e_C dS + Qd^T dO - W^T d delta
// and, with beta, through the two triangular solves ((I + A)^T X = dU back substitution):
//   dVb = (I + A)^-T d delta,  dKbe = (I + A)^-T (-d delta S^T),  dA = -(dVb U^T + dKbe W^T)
// where Qd = diag(e) Q, Kd = diag(e_C / e) K, Vb = diag(b) V, Kbe = diag(b e) K. The running log
// decay's gradient gathers every exp's share and becomes g's by a reverse running sum.
#pragma once

#include "delta_chunks.h"

namespace chunks {

// One thread's gradient buffers for one chunk.
struct Grads {
  std::vector<float> d_o, qd, kd, dqd, dkd, d_delta, dw, dp, da, dq, dk, db, scratch;
  std::vector<double> dc;  // the running log decay's: a sum of shares of either sign, in double
  Grads(int64_t dk_, int64_t dv)
      : d_o(kC * dv), qd(kC * dk_), kd(kC * dk_), dqd(kC * dk_), dkd(kC * dk_),
        d_delta(kC * dv), dw(kC * dk_), dp(kC * kC), da(kC * kC), dq(kC * dk_), dk(kC * dk_),
        db(kC), scratch(kC * std::max(dk_, dv)), dc(kC) {}
};

inline float dot(const float* x, const float* y, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// X (n, width) = (I + A)^-T X = T^T X in place, through scratch.
inline void solve_transposed(const Chunk& ch, float* x, int64_t width, float* scratch) {
  std::copy_n(x, ch.n * width, scratch);
  gemm::tn(false, ch.n, width, ch.n, 1.f, ch.t.data(), kC, scratch, width, 0.f, x, width);
}

// The gradients through the corrections (beta given): of K, beta and c, from d delta (become dVb
// in place) and the chunk's starting state s; returns nothing, adds into gr.dk, gr.db, gr.dc.
inline void through_solve(const Inputs& in, const float* s, const Chunk& ch, Grads& gr) {
  const int64_t n = ch.n, dk = in.dk, dv = in.dv;
  float *dvb = gr.d_delta.data(), *dkbe = gr.dw.data(), *da = gr.da.data();
  gemm::nt(in.half, n, dk, dv, -1.f, dvb, dv, s, dv, 0.f, dkbe, dk);  // dW = -d delta S^T
  solve_transposed(ch, dvb, dv, gr.scratch.data());
  solve_transposed(ch, dkbe, dk, gr.scratch.data());
  gemm::nt(in.half, n, n, dv, -1.f, dvb, dv, ch.u.data(), dv, 0.f, da, kC);
  gemm::nt(in.half, n, n, dk, -1.f, dkbe, dk, ch.w.data(), dk, 1.f, da, kC);
  // A_ij = b_i (K K^T)_ij D_ij below the diagonal: da becomes the symmetric d(K K^T)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) {
      const float grad = da[i * kC + j], kkd = ch.a[i * kC + j];
      gr.db[i] += grad * kkd;
      const double dc = grad * ch.beta[i] * kkd;
      gr.dc[i] += dc;
      gr.dc[j] -= dc;
      da[i * kC + j] = grad * ch.beta[i] * std::exp(ch.c[i] - ch.c[j]);
    }
    da[i * kC + i] = 0.f;
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i + 1; j < n; ++j) da[i * kC + j] = da[j * kC + i];
  }
  gemm::nn(in.half, n, dk, n, 1.f, da, kC, ch.k.data(), dk, 1.f, gr.dk.data(), dk);
  for (int64_t i = 0; i < n; ++i) {  // Vb = diag(b) V and Kbe = diag(b e) K
    gr.db[i] += dot(dvb + i * dv, ch.v.data() + i * dv, dv);
    const float e = std::exp(ch.c[i]), t = e * dot(dkbe + i * dk, ch.k.data() + i * dk, dk);
    gr.db[i] += t;
    gr.dc[i] += ch.beta[i] * t;
    for (int64_t x = 0; x < dk; ++x) gr.dk[i * dk + x] += ch.beta[i] * e * dkbe[i * dk + x];
  }
}

// One chunk's gradients, given its starting state s and ds, the gradient of the state after it,
// which becomes the gradient of s. ch holds the chunk prepared, with its corrections.
inline void chunk_backward(const Inputs& in, const float* s, float* ds, const Chunk& ch,
                           Grads& gr) {
  const int64_t n = ch.n, dk = in.dk, dv = in.dv;
  const float last = ch.c[n - 1], gamma = std::exp(last);
  const float* d_o = gr.d_o.data();
  float *d_delta = gr.d_delta.data(), *dp = gr.dp.data();
  decayed(ch, ch.k.data(), dk, true, gr.kd.data());
  decayed(ch, ch.q.data(), dk, false, gr.qd.data());
  gemm::tn(in.half, n, dv, n, 1.f, ch.p.data(), kC, d_o, dv, 0.f, d_delta, dv);
  gemm::nn(in.half, n, dv, dk, 1.f, gr.kd.data(), dk, ds, dv, 1.f, d_delta, dv);
  gemm::nt(in.half, n, dk, dv, 1.f, ch.delta.data(), dv, ds, dv, 0.f, gr.dkd.data(), dk);
  gemm::nt(in.half, n, dk, dv, 1.f, d_o, dv, s, dv, 0.f, gr.dqd.data(), dk);
  gemm::nt(in.half, n, n, dv, 1.f, d_o, dv, ch.delta.data(), dv, 0.f, dp, kC);
  const float d_gamma = dot(s, ds, dk * dv);
  for (int64_t x = 0; x < dk * dv; ++x) ds[x] *= gamma;
  gemm::tn(in.half, dk, dv, n, 1.f, gr.qd.data(), dk, d_o, dv, 1.f, ds, dv);
  if (in.beta) gemm::tn(in.half, dk, dv, n, -1.f, ch.w.data(), dk, d_delta, dv, 1.f, ds, dv);
  std::fill_n(gr.dq.data(), n * dk, 0.f);
  std::fill_n(gr.dk.data(), n * dk, 0.f);
  std::fill_n(gr.dc.data(), n, 0.0);
  std::fill_n(gr.db.data(), n, 0.f);
  if (in.beta) through_solve(in, s, ch, gr);  // d delta becomes dVb
  for (int64_t i = 0; i < n; ++i) {  // P = lower(Q K^T o D)
    for (int64_t j = 0; j <= i; ++j) {
      const double share = dp[i * kC + j] * ch.p[i * kC + j];
      gr.dc[i] += share;
      gr.dc[j] -= share;
      dp[i * kC + j] *= std::exp(ch.c[i] - ch.c[j]);
    }
    std::fill(dp + i * kC + i + 1, dp + i * kC + n, 0.f);
  }
  gemm::nn(in.half, n, dk, n, 1.f, dp, kC, ch.k.data(), dk, 1.f, gr.dq.data(), dk);
  gemm::tn(in.half, n, dk, n, 1.f, dp, kC, ch.q.data(), dk, 1.f, gr.dk.data(), dk);
  for (int64_t i = 0; i < n; ++i) {  // Qd = diag(e) Q, Kd = diag(e_C / e) K
    const float e = std::exp(ch.c[i]), f = std::exp(last - ch.c[i]);
    const float *dqd = gr.dqd.data() + i * dk, *dkd = gr.dkd.data() + i * dk;
    gr.dc[i] += e * dot(dqd, ch.q.data() + i * dk, dk);
    const double w = f * dot(dkd, ch.k.data() + i * dk, dk);
    gr.dc[n - 1] += w;
    gr.dc[i] -= w;
    for (int64_t x = 0; x < dk; ++x) {
      gr.dq[i * dk + x] += e * dqd[x];
      gr.dk[i * dk + x] += f * dkd[x];
    }
  }
  gr.dc[n - 1] += static_cast<double>(gamma) * d_gamma;
  for (int64_t i = n - 2; i >= 0; --i) gr.dc[i] += gr.dc[i + 1];  // c_i sums g up to i
}

// Where the gradients of every token go: (tokens, h, dk) for q and k (per value head), (tokens,
// h, dv) for v, (tokens, h) for g and beta (null where not given); d_o the outputs' gradients.
struct Outputs {
  float *dq, *dk, *dv, *dg, *db;
  const float* d_o;
};

// The starting state of each of item's chunks into starts (one after the other), from s, the
// state before its first token (advanced in place to the last).
inline void states_of(const Inputs& in, const Item& item, float* s, float* starts, Chunk& ch) {
  const int64_t size = in.dk * in.dv;
  for (int64_t i = 0; i < chunk_count(item.length); ++i) {
    std::copy_n(s, size, starts + i * size);
    prepare(in, item, item.start + i * kChunk, ch);
    corrections(in, s, ch);
    advance(in, s, ch);
  }
}

// One work item's chunks in reverse: starts holds each chunk's starting state (apart floats from
// one to the next), ds the gradient of the final state, which becomes the initial state's.
inline void backward_item(const Inputs& in, const Item& item, const float* starts, int64_t apart,
                          float* ds, const Outputs& out, Chunk& ch, Grads& gr) {
  const int64_t dk = in.dk, dv = in.dv;
  for (int64_t i = chunk_count(item.length) - 1; i >= 0; --i) {
    const float* s = starts + i * apart;
    prepare(in, item, item.start + i * kChunk, ch);
    corrections(in, s, ch);
    for (int64_t r = 0; r < ch.n; ++r) {
      std::copy_n(out.d_o + ((ch.first + r) * in.h + item.head) * dv, dv, gr.d_o.data() + r * dv);
    }
    chunk_backward(in, s, ds, ch, gr);
    for (int64_t r = 0; r < ch.n; ++r) {
      const int64_t at = (ch.first + r) * in.h + item.head;
      std::copy_n(gr.dq.data() + r * dk, dk, out.dq + at * dk);
      std::copy_n(gr.dk.data() + r * dk, dk, out.dk + at * dk);
      const float b = in.beta ? ch.beta[r] : 1.f;  // dV = diag(b) dVb, or d delta without beta
      for (int64_t y = 0; y < dv; ++y) out.dv[at * dv + y] = b * gr.d_delta[r * dv + y];
      if (out.dg) out.dg[at] = static_cast<float>(gr.dc[r]);
      if (out.db) out.db[at] = gr.db[r];
    }
  }
}

// The gradients of the raw q and k rows (tokens, h_k, dk), from those of the prepared rows per
// value head (tokens, h, dk): each key head's group summed, then back through the scale and the
// normalisation x / n (n = sqrt(|x|^2 + eps)): dx = (dy - y (y . dy)) / n for y = x / n.
inline void to_raw_rows(const Inputs& in, int64_t tokens, const float* per_head, const Rows& x,
                        float factor, float* out) {
  const int64_t dk = in.dk, r = in.h / in.h_k;
  at::parallel_for(0, tokens * in.h_k, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> y(dk);
    for (int64_t row = begin; row < end; ++row) {  // row = token * h_k + key head
      float* dx = out + row * dk;
      const float* first = per_head + row * r * dk;  // its r value heads are neighbours
      scaled(first, dk, factor, dx);
      for (int64_t j = 1; j < r; ++j) {
        for (int64_t e = 0; e < dk; ++e) dx[e] += factor * first[j * dk + e];
      }
      if (in.eps < 0.f) continue;
      load(x, row, dk, y.data());
      const float inverse = inverse_norm(y.data(), dk, in.eps);
      scaled(y.data(), dk, inverse, y.data());
      const float along = dot(y.data(), dx, dk);
      for (int64_t e = 0; e < dk; ++e) dx[e] = (dx[e] - y[e] * along) * inverse;
    }
  });
}

}  // namespace chunks

// The gradients of delta_chunks_forward's o and final state (d_final empty: none): of the raw q
// and k (tokens, h_k, dk), v, g and beta (empty where g or beta is), and the initial state (N, h,
// dk, dv). kept: the forward's starting states, or empty to recompute them.
inline std::vector<at::Tensor> delta_chunks_backward(at::Tensor q, at::Tensor k, at::Tensor v,
                                                     at::Tensor g, at::Tensor beta,
                                                     at::Tensor state, at::Tensor bounds,
                                                     double eps, double scale, bool half,
                                                     at::Tensor kept, at::Tensor d_o,
                                                     at::Tensor d_final) {
  const chunks::Inputs in = chunks::inputs_of(q, k, v, g, beta, eps, scale, half);
  const int64_t dk = in.dk, dv = in.dv, h = in.h, tokens = q.size(0);
  TORCH_CHECK(d_o.scalar_type() == at::kFloat && d_o.is_contiguous() && d_o.sizes() == v.sizes(),
              "delta_chunks_backward: d_o must be contiguous float32 of v's shape");
  TORCH_CHECK(d_final.numel() == 0 || (d_final.scalar_type() == at::kFloat &&
                                       d_final.is_contiguous() && d_final.sizes() == state.sizes()),
              "delta_chunks_backward: d_final must be empty or contiguous float32 of state's shape");
  TORCH_CHECK(bounds.dim() == 1 && bounds.scalar_type() == at::kLong && bounds.numel() >= 2 &&
                  bounds.is_cpu() && bounds.is_contiguous() &&
                  state.sizes() == at::IntArrayRef({bounds.numel() - 1, h, dk, dv}),
              "delta_chunks_backward: bounds (N + 1,) contiguous CPU int64, state (N, h, dk, dv)");
  const auto items = chunks::items_of(bounds, h, in.h_k);
  const auto offsets = chunks::chunk_offsets(bounds);
  TORCH_CHECK(kept.numel() == 0 || kept.size(0) == offsets.back(),
              "delta_chunks_backward: kept must hold every chunk's starting state, or nothing");
  const auto f32 = state.options();
  auto dq = at::empty({tokens, h, dk}, f32), dk_out = at::empty({tokens, h, dk}, f32);
  auto dv_out = at::empty(v.sizes(), f32);
  auto dg = at::empty({g.numel() ? tokens : 0, h}, f32);
  auto db = at::empty({beta.numel() ? tokens : 0, h}, f32);
  auto d_state = d_final.numel() ? d_final.clone() : at::zeros_like(state);
  chunks::Outputs out{dq.data_ptr<float>(), dk_out.data_ptr<float>(), dv_out.data_ptr<float>(),
                      g.numel() ? dg.data_ptr<float>() : nullptr,
                      beta.numel() ? db.data_ptr<float>() : nullptr, d_o.data_ptr<float>()};
  const float *sp = state.data_ptr<float>(), *kp = kept.numel() ? kept.data_ptr<float>() : nullptr;
  float* dsp = d_state.data_ptr<float>();
  const auto shares = chunks::shares_of(items);
  at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t begin, int64_t end) {
    chunks::Chunk ch(dk, dv);
    chunks::Grads gr(dk, dv);
    std::vector<float> own;  // the starting states, where the forward kept none
    for (const int64_t x : chunks::flat(shares, begin, end)) {
      const chunks::Item& item = items[x];
      const int64_t size = dk * dv, slot = item.sequence * h + item.head;
      if (kp) {
        const float* starts = kp + (offsets[item.sequence] * h + item.head) * size;
        chunks::backward_item(in, item, starts, h * size, dsp + slot * size, out, ch, gr);
        continue;
      }
      own.resize(chunks::chunk_count(item.length) * size);  // the forward again, keeping them
      std::vector<float> s(sp + slot * size, sp + (slot + 1) * size);
      chunks::states_of(in, item, s.data(), own.data(), ch);
      chunks::backward_item(in, item, own.data(), size, dsp + slot * size, out, ch, gr);
    }
  });
  auto dq_raw = at::empty(q.sizes(), f32), dk_raw = at::empty(k.sizes(), f32);
  chunks::to_raw_rows(in, tokens, dq.data_ptr<float>(), in.q, in.scale, dq_raw.data_ptr<float>());
  chunks::to_raw_rows(in, tokens, dk_out.data_ptr<float>(), in.k, 1.f, dk_raw.data_ptr<float>());
  return {dq_raw, dk_raw, dv_out, dg, db, d_state};
}
