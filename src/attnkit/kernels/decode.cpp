// The decode kernel: a few queries against a long key/value cache, in one pass over the cache.
//
// Decoding is bound by memory: every step reads the whole cache once. Two matrix-vector products
// (q . K, then weights . V) read it twice over and, in bf16 on CPUs without bf16 matrix units, run
// at a fraction of the bus speed. Here each work item (batch row, key/value head, split of the keys)
// streams its keys and values once, block by block, with the online softmax of FlashAttention: the
// scores of a block, their running max and sum, and the output rescaled as the max grows. Every
// query row of a key/value head (the group of GQA, times the queries) shares the one read of K and V.
// Arithmetic is in float32 whatever the cache's dtype. Splits of long caches keep both threads busy
// and are merged at the end from each one's output, max and sum.
//
// Layout: q (b, h_kv, rows, d), k, v (b, h_kv, s, d), all of one dtype with the last dim contiguous
// (views of a cache buffer are fine); key_mask (b, s) bool or empty (all real). Learned sinks (a
// logit per query head that joins the denominator and brings no value) enter the final merge as
// one more split with output 0.
//
// Non-finite values follow attnkit's rule (rules/nonfinite.py): a padding key (key_mask False) is never
// read into a result, whatever it holds; a row with a real key whose score is not finite (NaN or
// infinite q or k) is NaN; a non-finite value reaches the rows that see its key. Built with
// -ffast-math but -fno-finite-math-only, so that the checks for NaN and infinity stay.

// ATen and torch's pybind11 glue, not <torch/extension.h>: the whole C++ API's headers tripled
// the build's time, and a first call waits for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "decode_pairs.h"  // many query rows over a bf16 cache, on AVX512-BF16
#include "fast_exp.h"
#include "gemv.h"  // the projections' matrix-vector product, bound beside decode

namespace {

constexpr int64_t kBlock = 64;     // keys scored together before one softmax update
constexpr int64_t kMaxRows = 16;   // query rows per key/value head
constexpr int64_t kMaxDim = 576;  // DeepSeek-V3's latent with its RoPE key, 512 + 64
#if defined(__AVX512BF16__)
static_assert(kMaxDim == kPairMaxDim);
#endif
// How far ahead of its use a row is asked for, and into which cache, chosen per CPU kind
// (docs/bench/choices.md): into L1 on AVX2 CPUs; on AVX-512 ones the L1's few outstanding misses
// held the stream back, and further ahead into L2 ran closer to the memory bus's limit.
#if defined(__AVX512F__)
constexpr int64_t kPrefetchBytes = 16384;
constexpr int kPrefetchLocality = 2;  // prefetcht1: into L2
#else
constexpr int64_t kPrefetchBytes = 8192;
constexpr int kPrefetchLocality = 3;  // prefetcht0: into L1
#endif

inline bool finite(float x) { return std::fabs(x) <= FLT_MAX; }

// Ask for the row kPrefetchBytes of data ahead, every cache line of it: the hardware prefetchers
// alone left bandwidth unused with two streams per thread.
template <typename T>
inline void prefetch_ahead(const T* row, int64_t stride_s, int64_t d) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  const char* ahead = reinterpret_cast<const char*>(row + kPrefetchBytes / row_bytes * stride_s);
  for (int64_t offset = 0; offset < row_bytes; offset += 64) {
    __builtin_prefetch(ahead + offset, 0, kPrefetchLocality);
  }
}

// A row of K or V as float32: the row itself for a float cache, else converted into `buffer`.
template <typename T, int64_t D>
inline const float* as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t n = D ? D : dim;
    for (int64_t c = 0; c < n; ++c) buffer[c] = static_cast<float>(row[c]);
    return buffer;
  }
}

// Rows j .. j + 3 of K or V as float32 (converted into `buffer` for a half-precision cache), each
// prefetched ahead.
template <typename T, int64_t D>
inline void four_rows(const T* base, int64_t j, int64_t stride_s, int64_t d,
                      float (*buffer)[kMaxDim], const float* rows[4]) {
  for (int u = 0; u < 4; ++u) {
    const T* row = base + (j + u) * stride_s;
    prefetch_ahead(row, stride_s, d);
    rows[u] = as_float<T, D>(row, buffer[u], d);
  }
}

// scores[r][j] = q_r . k_{j0 + j} for the query rows r and the n keys of a block.
template <typename T, int64_t D, int64_t R>
inline void score_block(const float* q, int64_t rows_given, int64_t dim, const T* k,
                        int64_t stride_s, int64_t j0, int64_t n, float (*buffer)[kMaxDim],
                        float (*scores)[kBlock]) {
  const int64_t d = D ? D : dim;
  const int64_t rows = R ? R : rows_given;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // four keys at a time: four independent chains of FMAs
    const float* key[4];
    four_rows<T, D>(k, j0 + j, stride_s, d, buffer, key);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      float dot0 = 0.f, dot1 = 0.f, dot2 = 0.f, dot3 = 0.f;
      for (int64_t c = 0; c < d; ++c) {
        dot0 += qr[c] * key[0][c];
        dot1 += qr[c] * key[1][c];
        dot2 += qr[c] * key[2][c];
        dot3 += qr[c] * key[3][c];
      }
      scores[r][j] = dot0;
      scores[r][j + 1] = dot1;
      scores[r][j + 2] = dot2;
      scores[r][j + 3] = dot3;
    }
  }
  for (; j < n; ++j) {
    const float* key = as_float<T, D>(k + (j0 + j) * stride_s, buffer[0], d);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * d;
      float dot = 0.f;
      for (int64_t c = 0; c < d; ++c) dot += qr[c] * key[c];
      scores[r][j] = dot;
    }
  }
}

// A block's scores made ready for the softmax: a padding key's score becomes -FLT_MAX, and a row
// with a real key whose score is not finite is marked bad, its scores all -FLT_MAX. `real`: the
// block's keys, null when all are real.
template <int64_t R>
inline void mask_block(const bool* real, int64_t rows_given, int64_t n, float (*scores)[kBlock],
                       bool* bad) {
  const int64_t rows = R ? R : rows_given;
  if (real != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      if (!real[j]) {
        for (int64_t r = 0; r < rows; ++r) scores[r][j] = -FLT_MAX;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // a padding key's -FLT_MAX is finite: only real keys count
    bool all_finite = true;
    for (int64_t j = 0; j < n; ++j) all_finite = all_finite && finite(scores[r][j]);
    if (!all_finite) {
      bad[r] = true;
      std::fill(scores[r], scores[r] + n, -FLT_MAX);  // weight 0 here: the row ends as NaN
    }
  }
}

// The online softmax's update for a block: each row's scores become its weights, its running max
// m and sum l take the block in, and its output so far is rescaled to the new max.
template <int64_t D, int64_t R>
inline void update_rows(int64_t rows_given, int64_t dim, int64_t n, float (*scores)[kBlock],
                        float* m, float* l, float (*acc)[kMaxDim]) {
  const int64_t d = D ? D : dim;
  const int64_t rows = R ? R : rows_given;
  for (int64_t r = 0; r < rows; ++r) {
    float block_max = m[r];
    for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, scores[r][j]);
    const float alpha = exp_nonpositive(m[r] - block_max);
    m[r] = block_max;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      // A masked key's -FLT_MAX minus a real max is below -87: its weight is 0.
      const float p = exp_nonpositive(scores[r][j] - block_max);
      scores[r][j] = p;
      sum += p;
    }
    l[r] = l[r] * alpha + sum;
    if (alpha != 1.f) {
      for (int64_t c = 0; c < d; ++c) acc[r][c] *= alpha;
    }
  }
}

// One block of keys [j0, j0 + n) of a work item: its scores, its softmax update, acc += P V.
template <typename T, int64_t D, int64_t R>
inline void attend_block(const float* q, int64_t rows, int64_t d, int64_t dv, const T* k,
                         const T* v, int64_t stride_s, int64_t stride_v, const bool* real,
                         int64_t j0, int64_t n, float (&scores)[kMaxRows][kBlock],
                         float (&acc)[kMaxRows][kMaxDim], float (&buffer)[4][kMaxDim], float* m,
                         float* l, bool* bad) {
  const auto is_real = [](bool r) { return r; };
  if (real != nullptr && std::none_of(real + j0, real + j0 + n, is_real)) {
    return;  // the block adds nothing: neither its keys nor its values are read
  }
  const bool all_real = real == nullptr || std::all_of(real + j0, real + j0 + n, is_real);
  const bool* block_real = all_real ? nullptr : real + j0;
  score_block<T, D, R>(q, rows, d, k, stride_s, j0, n, buffer, scores);
  mask_block<R>(block_real, rows, n, scores, bad);
  update_rows<D, R>(rows, dv, n, scores, m, l, acc);
  // acc += P V stays inline with the steps above: decode is built with -ffast-math, and with
  // these loops in a function of their own GCC associates the four-value sum differently (the
  // last bit of some outputs changes) and some builds run slower.
  int64_t j = 0;
  if (!all_real) {  // selection, not multiplication: 0 * a padding value's NaN would be NaN
    for (; j < n; ++j) {
      if (!real[j0 + j]) continue;
      const float* value = as_float<T, D>(v + (j0 + j) * stride_v, buffer[0], dv);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r][j];
        for (int64_t c = 0; c < dv; ++c) acc[r][c] += p * value[c];
      }
    }
  }
  for (; j + 4 <= n; j += 4) {  // four values at a time: one load and store of acc per four
    const float* value[4];
    four_rows<T, D>(v, j0 + j, stride_v, dv, buffer, value);
    for (int64_t r = 0; r < rows; ++r) {
      const float p0 = scores[r][j], p1 = scores[r][j + 1];
      const float p2 = scores[r][j + 2], p3 = scores[r][j + 3];
      float* a = acc[r];
      for (int64_t c = 0; c < dv; ++c) {
        a[c] += p0 * value[0][c] + p1 * value[1][c] + p2 * value[2][c] + p3 * value[3][c];
      }
    }
  }
  for (; j < n; ++j) {
    const float* value = as_float<T, D>(v + (j0 + j) * stride_v, buffer[0], dv);
    for (int64_t r = 0; r < rows; ++r) {
      const float p = scores[r][j];
      for (int64_t c = 0; c < dv; ++c) acc[r][c] += p * value[c];
    }
  }
}

// One work item: keys [begin, end) of one (batch row, key/value head) for `rows` query rows. D is the
// head dim of keys and values when known at compile time (the common widths, equal), 0 for any
// other widths `dim` and `dv`; R is the rows when known (one query of multi-head attention: 1-4%
// faster, the loops over rows gone), else 0.
template <typename T, int64_t D, int64_t R>
void attend_split(const float* q, int64_t rows_given, int64_t dim, int64_t dim_v, const T* k,
                  const T* v, int64_t stride_s, int64_t stride_v, const bool* real, int64_t begin,
                  int64_t end, float* out, float* max_out, float* sum_out) {
  const int64_t d = D ? D : dim, dv = D ? D : dim_v;
  const int64_t rows = R ? R : rows_given;
  alignas(64) float scores[kMaxRows][kBlock];
  alignas(64) float acc[kMaxRows][kMaxDim];
  alignas(64) float buffer[4][kMaxDim];  // rows of a half-precision cache, as float32
  float m[kMaxRows], l[kMaxRows];
  bool bad[kMaxRows];  // a real key's score was NaN or infinite: the row's output is NaN
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -FLT_MAX;  // no real key yet
    l[r] = 0.f;
    bad[r] = false;
    std::fill(acc[r], acc[r] + dv, 0.f);
  }
  for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
    const int64_t n = std::min(kBlock, end - j0);
    attend_block<T, D, R>(q, rows, d, dv, k, v, stride_s, stride_v, real, j0, n, scores, acc,
                          buffer, m, l, bad);
  }
  for (int64_t r = 0; r < rows; ++r) {
    max_out[r] = m[r];
    sum_out[r] = bad[r] ? NAN : l[r];  // NaN marks the row for the merge
    std::copy(acc[r], acc[r] + dv, out + r * dv);
  }
}

// The query rows of one (batch row, key/value head) of q (b, h_kv, rows, d), as float32 times
// `scale`, into `queries` (rows x d).
template <typename T>
inline void scaled_queries(const at::Tensor& q, int64_t batch, int64_t head, int64_t rows,
                           int64_t d, double scale, float* queries) {
  const T* qp = q.data_ptr<T>() + batch * q.stride(0) + head * q.stride(1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      queries[r * d + c] = static_cast<float>(qp[r * q.stride(2) + c]) * scale;
    }
  }
}

// A work item as attend_split_pairs (decode_pairs.h) takes it where it applies: many query rows
// over a bf16 cache whose head dims are multiples of 32, in a build with AVX512-BF16. False where
// the float32 path must run.
template <typename T>
bool attend_in_pairs(const T* q, int64_t q_row_stride, int64_t rows, int64_t d, int64_t dv,
                     double scale, const T* k, const T* v, int64_t stride_s, int64_t stride_v,
                     const bool* real, int64_t begin, int64_t end, float* out, float* max_out,
                     float* sum_out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (rows >= kPairsFrom && d % 32 == 0 && dv % 32 == 0) {
      attend_split_pairs(q, q_row_stride, rows, d, dv, static_cast<float>(scale), k, v, stride_s,
                         stride_v, real, begin, end, out, max_out, sum_out);
      return true;
    }
  }
#endif
  return false;
}

// sinks: the sink logit of each query row of each key/value head (h_kv x rows), or null.
template <typename T, int64_t D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& key_mask, double scale, int64_t splits, const float* sinks,
         at::Tensor& out) {
  const int64_t b = q.size(0), h_kv = q.size(1), rows = q.size(2), d = q.size(3), s = k.size(2);
  const int64_t dv = v.size(3);
  const int64_t per_split = (s + splits - 1) / splits;
  const int64_t items = b * h_kv * splits;
  // Each split's unnormalised output, running max and sum, merged below.
  std::vector<float> part_out(items * rows * dv), part_max(items * rows), part_sum(items * rows);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  at::parallel_for(0, items, 1, [&](int64_t first, int64_t last) {
    alignas(64) float queries[kMaxRows * kMaxDim];
    for (int64_t item = first; item < last; ++item) {
      const int64_t split = item % splits, bh = item / splits;
      const int64_t batch = bh / h_kv, head = bh % h_kv;
      const int64_t begin = std::min(s, split * per_split);
      const int64_t end = std::min(s, begin + per_split);
      if (attend_in_pairs<T>(q.data_ptr<T>() + batch * q.stride(0) + head * q.stride(1),
                             q.stride(2), rows, d, dv, scale,
                             kp + batch * k.stride(0) + head * k.stride(1),
                             vp + batch * v.stride(0) + head * v.stride(1), k.stride(2),
                             v.stride(2), mp ? mp + batch * key_mask.stride(0) : nullptr, begin,
                             end, part_out.data() + item * rows * dv,
                             part_max.data() + item * rows, part_sum.data() + item * rows)) {
        continue;
      }
      scaled_queries<T>(q, batch, head, rows, d, scale, queries);
      auto attend = rows == 1 ? attend_split<T, D, 1> : attend_split<T, D, 0>;
      attend(queries, rows, d, dv, kp + batch * k.stride(0) + head * k.stride(1),
             vp + batch * v.stride(0) + head * v.stride(1), k.stride(2), v.stride(2),
             mp ? mp + batch * key_mask.stride(0) : nullptr, begin, end,
             part_out.data() + item * rows * dv, part_max.data() + item * rows,
             part_sum.data() + item * rows);
    }
  });
  // Merge the splits of each (b, h_kv), and the sink: rescale to the overall max, divide by the
  // total sum. A row with no real key has sum 0 (or the sink's alone) and gets zeros.
  T* op = out.data_ptr<T>();
  for (int64_t bh = 0; bh < b * h_kv; ++bh) {
    for (int64_t r = 0; r < rows; ++r) {
      const float sink = sinks ? sinks[(bh % h_kv) * rows + r] : -INFINITY;
      float overall = std::max(-FLT_MAX, sink);
      for (int64_t sp = 0; sp < splits; ++sp) {
        overall = std::max(overall, part_max[(bh * splits + sp) * rows + r]);
      }
      float total = std::exp(sink - overall);  // 0 without a sink
      float merged[kMaxDim] = {};
      bool bad = sink != sink || sink == INFINITY;  // a NaN or infinite score: a NaN row
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t at = (bh * splits + sp) * rows + r;
        bad = bad || part_sum[at] != part_sum[at];
        if (part_sum[at] == 0.f || bad) continue;
        const float factor = std::exp(part_max[at] - overall);
        total += part_sum[at] * factor;
        const float* po = part_out.data() + at * dv;
        for (int64_t c = 0; c < dv; ++c) merged[c] += po[c] * factor;
      }
      const float inverse = bad ? NAN : total > 0.f ? 1.f / total : 0.f;
      T* o = op + (bh * rows + r) * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = static_cast<T>(merged[c] * inverse);
    }
  }
}

}  // namespace

// Attention of q (b, h, t, d) over k (b, h_kv, s, d) and v (b, h_kv, s, dv), query head i using
// key/value head i / (h / h_kv); returns (b, h, t, dv) in q's dtype. v may be a view of k's rows
// (multi-head latent attention's values are the first dv numbers of its keys): each row is then
// read from memory once. sinks: float32 (h,) or empty (none). The keys
// are cut into splits so that every thread has work, but into no more than s / min_keys_per_split,
// so that each split streams.
at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& key_mask, const at::Tensor& sinks, double scale,
                  int64_t min_keys_per_split) {
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1 && q.scalar_type() == k.scalar_type(),
              "decode: q must be (b, h, t, d) with a contiguous last dim, of k's dtype");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && v.sizes().slice(0, 3) == k.sizes().slice(0, 3) &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k.scalar_type() == v.scalar_type(),
              "decode: k (b, h_kv, s, d) and v (b, h_kv, s, dv) of one dtype, last dims contiguous");
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3), dv = v.size(3);
  const int64_t h_kv = k.size(1), s = k.size(2);
  TORCH_CHECK(b == k.size(0) && h_kv > 0 && h % h_kv == 0 && d == k.size(3),
              "decode: q (b, h, t, d) and k (b, h_kv, s, d) disagree on b or d, or h % h_kv != 0");
  const int64_t rows = (h / h_kv) * t;  // the query rows of one key/value head, side by side
  TORCH_CHECK(d > 0 || q.numel() == 0, "decode: head dim 0 with queries to attend");
  TORCH_CHECK(rows <= kMaxRows && d <= kMaxDim && dv <= kMaxDim,
              "decode: at most 16 query rows per key/value head and head dims of 576");
  TORCH_CHECK(min_keys_per_split >= 1, "decode: min_keys_per_split must be >= 1");
  TORCH_CHECK(key_mask.numel() == 0 || (key_mask.scalar_type() == at::kBool &&
                                        key_mask.dim() == 2 && key_mask.stride(1) == 1),
              "decode: key_mask must be an empty tensor or a (b, s) bool tensor");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.dim() == 1 &&
                                     sinks.size(0) == h && sinks.is_contiguous()),
              "decode: sinks must be an empty tensor or a contiguous float32 (h,) tensor");
  std::vector<float> sink_rows;  // the sink of each query row of each key/value head
  if (sinks.numel()) {
    const float* sp = sinks.data_ptr<float>();
    for (int64_t head = 0; head < h_kv; ++head) {
      for (int64_t r = 0; r < rows; ++r) sink_rows.push_back(sp[head * (h / h_kv) + r / t]);
    }
  }
  const float* sink_ptr = sink_rows.empty() ? nullptr : sink_rows.data();
  auto out = at::empty({b, h_kv, rows, dv},
                         q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out.view({b, h, t, dv});  // b, t or dv is 0: nothing to compute
  const auto grouped = q.reshape({b, h_kv, rows, d});
  const int64_t wanted = (2 * at::get_num_threads() + b * h_kv - 1) / (b * h_kv);  // 2 per thread
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, s / min_keys_per_split));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "decode", [&] {
    switch (d == dv ? d : 0) {
      case 64: run<scalar_t, 64>(grouped, k, v, key_mask, scale, splits, sink_ptr, out); break;
      case 128: run<scalar_t, 128>(grouped, k, v, key_mask, scale, splits, sink_ptr, out); break;
      default: run<scalar_t, 0>(grouped, k, v, key_mask, scale, splits, sink_ptr, out);
    }
  });
  return out.view({b, h, t, dv});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &decode, "Attention of a few queries over a key/value cache, in one pass");
  m.def("linear", &linear, "x w_i^T + bias_i for a few rows of x and a few weights, on every thread");
  m.def("has_avx512_bf16", [] {
#if defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
  }, "Whether this build takes many rows over a bf16 cache in AVX512-BF16 pair products");
}
