// Paged attention for XLA:CPU, called through the XLA FFI (kernels_cpu/__init__.py).
//
// Why C++: XLA:CPU runs the pure-JAX reference (kernels_pallas/reference.py) as many small
// batched matmuls plus scatter merges, far below what the machine can do, and that was most
// of every engine step. Here a work item is one sequence's rows: it gathers the keys and
// values they see from the pages once (into fp32, contiguous), then takes an exact softmax
// per query. Decode items (one row, all KV heads) are bound by reading the pages; prefill
// items (up to 16 rows, one KV head) by arithmetic, so they run as small register-tiled
// matrix products. Items spread over XLA's intra-op thread pool.
//
// Semantics are the reference's: pages [num_blocks, block_size, Hkv, D] in fp32, bf16, or
// uint16 holding bf16 bits (how the engine stores a bf16 cache on CPU); a query at position p
// sees keys lo..p (lo = p - window + 1 with a sliding window, else 0); rows that see nothing
// return zeros; products and the softmax in fp32; with 16-bit pages the probabilities are
// rounded to bf16 before they weight V (as the reference and the GPU kernels do); the output
// is in q's dtype.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeadDim = 1024;
// Prefill rows of one sequence per work item: they share one gather of the keys they see.
constexpr int64_t kRowsPerItem = 16;

inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as XLA's convert does (a NaN stays a NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A probability (finite, >= 0) rounded to bf16, nearest even; branch-free, so it vectorises.
inline float round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (a score minus the row's max), written so that the compiler vectorises
// it: 2^n * exp(r) with |r| <= ln2 / 2 and a degree-7 Taylor polynomial (relative error
// below 1e-7, against expf's half an ulp: well inside the 1e-5 the tests hold).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.9841270e-4f;
  p = p * r + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return p * two_n;
}

// Page and query element types: fp32, or bf16 (its bits, whether XLA calls it BF16 or U16).
inline float load(float x) { return x; }
inline float load(uint16_t x) { return bf16_to_f32(x); }
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = f32_to_bf16(x); }

// One layer's pages and their geometry.
template <typename T>
struct Pages {
  const T* k;
  const T* v;
  int64_t num_blocks, block_size, num_kv_heads;
};

// A query row of the packed q, at position pos, seeing keys lo..pos (pos < lo: nothing).
struct Row {
  int64_t row, pos, lo;
};

// Work item: consecutive rows of one sequence (its block-table row), for KV heads
// heads..heads + num_heads - 1.
struct Item {
  const int32_t* table;
  int64_t first, count;  // into the rows
  int64_t heads, num_heads;
};

// fp32 vectors of 16 through GCC's vector types (AVX-512 registers here, pairs on AVX2).
using v16 = float __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(v16 a) {
  a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return a[0];
}

// x and y each hold 2^k sums to finish, in groups of P lanes; returns their 2^(k+1) sums in
// groups of P / 2 lanes, x's first (each group's two halves added).
#define OMNI_HALVE(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
inline v16 combine16(v16 x, v16 y) {
  return OMNI_HALVE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         OMNI_HALVE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 combine8(v16 x, v16 y) {
  return OMNI_HALVE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         OMNI_HALVE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline v16 combine4(v16 x, v16 y) {
  return OMNI_HALVE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         OMNI_HALVE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline v16 combine2(v16 x, v16 y) {
  return OMNI_HALVE(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         OMNI_HALVE(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef OMNI_HALVE

// Dot products and weighted sums over a head of D = NV * 16 (NV = 0: any D, plain loops).
template <int NV>
struct Head {
  static v16 partial(const v16* q, const float* k) {
    v16 acc = q[0] * load16(k);
    for (int j = 1; j < NV; ++j) acc += q[j] * load16(k + 16 * j);
    return acc;
  }
  // scores[t] = q . keys[t], t in [0, n): sixteen keys at a time, their sums finished together
  // (15 shuffle-and-add steps for 16 keys instead of 4 for each).
  static void scores(const float* qp, const float* keys, int64_t n, int64_t, float* out) {
    constexpr int64_t D = NV * 16;
    v16 q[NV];
    for (int j = 0; j < NV; ++j) q[j] = load16(qp + 16 * j);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      const float* k = keys + t * D;
      v16 a[8];
      for (int i = 0; i < 8; ++i) a[i] = combine16(partial(q, k + 2 * i * D), partial(q, k + (2 * i + 1) * D));
      v16 b[4];
      for (int i = 0; i < 4; ++i) b[i] = combine8(a[2 * i], a[2 * i + 1]);
      const v16 r = combine2(combine4(b[0], b[1]), combine4(b[2], b[3]));
      std::memcpy(out + t, &r, sizeof r);
    }
    for (; t < n; ++t) out[t] = hsum(partial(q, keys + t * D));
  }
  // out[0..D) = sum_t w[t] * x[t * D ..], t in [0, n); two keys at a time, so that twice as
  // many independent accumulations hide the FMA latency.
  static void weighted_sum(const float* w, const float* x, int64_t n, int64_t, float* out) {
    constexpr int64_t D = NV * 16;
    v16 acc[NV] = {}, acc2[NV] = {};
    int64_t t = 0;
    for (; t + 2 <= n; t += 2)
      for (int j = 0; j < NV; ++j) {
        acc[j] += w[t] * load16(x + t * D + 16 * j);
        acc2[j] += w[t + 1] * load16(x + (t + 1) * D + 16 * j);
      }
    for (; t < n; ++t)
      for (int j = 0; j < NV; ++j) acc[j] += w[t] * load16(x + t * D + 16 * j);
    for (int j = 0; j < NV; ++j) acc[j] += acc2[j];
    std::memcpy(out, acc, sizeof acc);
  }
};

template <>
struct Head<0> {
  static void scores(const float* q, const float* keys, int64_t n, int64_t d, float* out) {
    for (int64_t t = 0; t < n; ++t) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += q[i] * keys[t * d + i];
      out[t] = s;
    }
  }
  static void weighted_sum(const float* w, const float* x, int64_t n, int64_t d, float* out) {
    std::fill(out, out + d, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) out[i] += w[t] * x[t * d + i];
    }
  }
};

struct Scratch {
  std::vector<float> k, v, scores, q, out;
};

// Scores x[0..n) become exp(x - max) (rounded to bf16 with round_p, for bf16 values);
// returns 1 / their sum (taken before rounding, as the reference does).
inline float softmax_weights(float* x, int64_t n, bool round_p) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < n; ++t) m = x[t] > m ? x[t] : m;
  float l = 0.0f;
#pragma omp simd reduction(+ : l)
  for (int64_t t = 0; t < n; ++t) {
    const float e = exp_nonpositive(x[t] - m);
    l += e;
    x[t] = round_p ? round_bf16(e) : e;
  }
  return 1.0f / l;
}

// The keys lo..hi that any of the item's rows sees; false if none sees any.
inline bool visible_keys(const Item& item, const Row* rows, int64_t& lo, int64_t& hi) {
  lo = INT64_MAX;
  hi = -1;
  for (int64_t r = item.first; r < item.first + item.count; ++r) {
    if (rows[r].pos >= std::max<int64_t>(rows[r].lo, 0)) {
      lo = std::min(lo, rows[r].lo);
      hi = std::max(hi, rows[r].pos);
    }
  }
  return hi >= 0;
}

// fn(t, k, v) for each key lo + t, t in [0, hi - lo], page by page through the block table;
// k and v point at the key's row for KV head h (the following heads come next in memory).
template <typename PT, typename F>
void for_each_key(const Pages<PT>& pg, const int32_t* table, int64_t lo, int64_t hi, int64_t h,
                  int64_t d, const F& fn) {
  const int64_t bs = pg.block_size, stride = pg.num_kv_heads * d;
  for (int64_t p = lo / bs; p <= hi / bs; ++p) {
    // A block id out of range (never written by the engine) is clamped, not read past.
    const int64_t block = std::min<int64_t>(std::max(table[p], 0), pg.num_blocks - 1);
    const int64_t first = std::max(lo - p * bs, int64_t{0}), last = std::min(hi - p * bs, bs - 1);
    const PT* k = pg.k + block * bs * stride + h * d;
    const PT* v = pg.v + block * bs * stride + h * d;
    for (int64_t o = first; o <= last; ++o) fn(p * bs + o - lo, k + o * stride, v + o * stride);
  }
}

// One work item: the keys its rows see, lo..hi, are gathered once from the pages into fp32
// (bf16 converted once), then each row and query head scores them, takes an exact softmax
// and sums the values.
template <typename QT, typename PT, int NV>
void attend_item(const Pages<PT>& pg, const Item& item, const Row* rows, const QT* q, QT* out,
                 int64_t hq, int64_t d, float scale, Scratch& s) {
  const int64_t G = hq / pg.num_kv_heads;
  int64_t lo, hi;
  if (!visible_keys(item, rows, lo, hi)) return;  // the rows stay zeros
  const int64_t n = hi - lo + 1, nh = item.num_heads;
  s.k.resize(nh * n * d);  // [head][key][d]
  s.v.resize(nh * n * d);
  s.scores.resize(n);
  s.q.resize(d);
  s.out.resize(d);
  for_each_key(pg, item.table, lo, hi, item.heads, d, [&](int64_t t, const PT* k, const PT* v) {
    for (int64_t h = 0; h < nh; ++h) {
      float* kd = s.k.data() + (h * n + t) * d;
      float* vd = s.v.data() + (h * n + t) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        kd[i] = load(k[h * d + i]);
        vd[i] = load(v[h * d + i]);
      }
    }
  });
  const bool round_p = sizeof(PT) == 2;
  for (int64_t r = item.first; r < item.first + item.count; ++r) {
    const Row& row = rows[r];
    if (row.pos < std::max<int64_t>(row.lo, 0)) continue;
    const int64_t a = row.lo - lo, len = row.pos - row.lo + 1;
    for (int64_t head = item.heads * G; head < (item.heads + nh) * G; ++head) {
      const float* keys = s.k.data() + ((head / G - item.heads) * n + a) * d;
      const float* values = s.v.data() + ((head / G - item.heads) * n + a) * d;
      const int64_t at = (row.row * hq + head) * d;
      for (int64_t i = 0; i < d; ++i) s.q[i] = load(q[at + i]) * scale;
      float* sc = s.scores.data();
      Head<NV>::scores(s.q.data(), keys, len, d, sc);
      const float inv = softmax_weights(sc, len, round_p);
      Head<NV>::weighted_sum(sc, values, len, d, s.out.data());
      for (int64_t i = 0; i < d; ++i) store(out + at + i, s.out[i] * inv);
    }
  }
}

// A prefill work item (rows of one sequence, one KV head) as small matrix products: many
// query rows share each key, so the keys are gathered transposed ([d][key], padded to whole
// tiles with zeros) and each step multiplies 4 queries by 64 keys in 16 registers, with no
// horizontal sums; the values are summed 4 (or 2, for head dim 128) queries at a time. Each
// query keeps its own visible range; scores outside it are never used (probabilities 0).
template <typename QT, typename PT, int NV>
void attend_prefill_item(const Pages<PT>& pg, const Item& item, const Row* rows, const QT* q,
                         QT* out, int64_t hq, float scale, Scratch& s) {
  constexpr int64_t D = NV * 16, kKeyTile = 64, kQueryTile = 4;
  constexpr int kValueQueries = NV <= 4 ? 4 : 2;
  const int64_t G = hq / pg.num_kv_heads, h = item.heads;
  int64_t lo, hi;
  if (!visible_keys(item, rows, lo, hi)) return;
  const int64_t n = hi - lo + 1, padded = (n + kKeyTile - 1) / kKeyTile * kKeyTile;
  s.k.assign(D * padded, 0.0f);  // [d][key]
  s.v.resize(n * D);             // [key][d]
  for_each_key(pg, item.table, lo, hi, h, D, [&](int64_t t, const PT* k, const PT* v) {
    for (int64_t i = 0; i < D; ++i) s.k[i * padded + t] = load(k[i]);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) s.v[t * D + i] = load(v[i]);
  });
  // The item's queries: (row, head) pairs with their visible keys [begin, end) (relative to lo).
  struct Query {
    int64_t at, begin, end;
  };
  std::vector<Query> queries;
  for (int64_t r = item.first; r < item.first + item.count; ++r) {
    const Row& row = rows[r];
    if (row.pos < std::max<int64_t>(row.lo, 0)) continue;
    for (int64_t g = 0; g < G; ++g)
      queries.push_back({(row.row * hq + h * G + g) * D, row.lo - lo, row.pos - lo + 1});
  }
  const int64_t nq = static_cast<int64_t>(queries.size());
  s.q.resize(nq * D);
  s.scores.resize(nq * padded);
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t i = 0; i < D; ++i) s.q[j * D + i] = load(q[queries[j].at + i]) * scale;
  // Scores, 4 queries x 64 keys per tile, over the keys any of the 4 sees.
  for (int64_t j0 = 0; j0 < nq; j0 += kQueryTile) {
    const int64_t jn = std::min(kQueryTile, nq - j0);
    int64_t begin = INT64_MAX, end = 0;
    for (int64_t j = j0; j < j0 + jn; ++j) {
      begin = std::min(begin, queries[j].begin);
      end = std::max(end, queries[j].end);
    }
    const float* qs[kQueryTile];
    for (int64_t j = 0; j < kQueryTile; ++j) qs[j] = s.q.data() + std::min(j0 + j, nq - 1) * D;
    for (int64_t t0 = begin / kKeyTile * kKeyTile; t0 < end; t0 += kKeyTile) {
      v16 acc[kQueryTile][4] = {};
      for (int64_t i = 0; i < D; ++i) {
        const float* kt = s.k.data() + i * padded + t0;
        const v16 k0 = load16(kt), k1 = load16(kt + 16), k2 = load16(kt + 32), k3 = load16(kt + 48);
        for (int j = 0; j < kQueryTile; ++j) {
          const float x = qs[j][i];
          acc[j][0] += x * k0;
          acc[j][1] += x * k1;
          acc[j][2] += x * k2;
          acc[j][3] += x * k3;
        }
      }
      for (int64_t j = 0; j < jn; ++j)
        std::memcpy(s.scores.data() + (j0 + j) * padded + t0, acc[j], sizeof acc[j]);
    }
  }
  // Softmax of each query over its own keys; zeros elsewhere in its tile's range.
  const bool round_p = sizeof(PT) == 2;
  std::vector<float>& inv = s.out;
  inv.resize(nq);
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = s.scores.data() + j * padded;
    const int64_t b = queries[j].begin, e = queries[j].end;
    inv[j] = softmax_weights(sc + b, e - b, round_p);
    std::fill(sc, sc + b, 0.0f);
    std::fill(sc + e, sc + padded, 0.0f);
  }
  // Values: kValueQueries queries at a time share each value row.
  for (int64_t j0 = 0; j0 < nq; j0 += kValueQueries) {
    const int64_t jn = std::min<int64_t>(kValueQueries, nq - j0);
    int64_t begin = INT64_MAX, end = 0;
    for (int64_t j = j0; j < j0 + jn; ++j) {
      begin = std::min(begin, queries[j].begin);
      end = std::max(end, queries[j].end);
    }
    const float* ps[kValueQueries];
    for (int j = 0; j < kValueQueries; ++j) ps[j] = s.scores.data() + std::min(j0 + j, nq - 1) * padded;
    v16 acc[kValueQueries][NV] = {};
    for (int64_t t = begin; t < end; ++t) {
      v16 vr[NV];
      for (int i = 0; i < NV; ++i) vr[i] = load16(s.v.data() + t * D + 16 * i);
      for (int j = 0; j < kValueQueries; ++j) {
        const float w = ps[j][t];
        for (int i = 0; i < NV; ++i) acc[j][i] += w * vr[i];
      }
    }
    for (int64_t j = 0; j < jn; ++j) {
      QT* o = out + queries[j0 + j].at;
      for (int i = 0; i < NV; ++i)
        for (int x = 0; x < 16; ++x) store(o + 16 * i + x, acc[j][i][x] * inv[j0 + j]);
    }
  }
}

// body(i) for i in [0, n), on the caller and up to the pool's other threads. Items go to
// whichever thread asks next; the caller returns when every item is done. A pool task that
// starts late finds nothing left and returns without touching the call's buffers.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const F& body) {
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &body] {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      body(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t j = 0; j < helpers; ++j) pool.Schedule([work] { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

template <typename QT, typename PT, int NV>
void run_items(ffi::ThreadPool& pool, const std::vector<Item>& items, const std::vector<Row>& rows,
               const QT* q, QT* out, const Pages<PT>& pg, int64_t hq, int64_t d, float scale) {
  parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Scratch scratch;
    // Several rows per item (prefill) go through the tiled path; one row (decode) reads its
    // pages straight, as it is bound by memory, not arithmetic.
    if constexpr (NV > 0) {
      if (items[i].count > 1)
        return attend_prefill_item<QT, PT, NV>(pg, items[i], rows.data(), q, out, hq, scale, scratch);
    }
    attend_item<QT, PT, NV>(pg, items[i], rows.data(), q, out, hq, d, scale, scratch);
  });
}

template <typename QT, typename PT>
void run_typed(ffi::ThreadPool& pool, const std::vector<Item>& items, const std::vector<Row>& rows,
               ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::Result<ffi::AnyBuffer>& out, float scale) {
  auto kd = k.dimensions();
  const Pages<PT> pg{static_cast<const PT*>(k.untyped_data()),
                     static_cast<const PT*>(v.untyped_data()), kd[0], kd[1], kd[2]};
  const int64_t hq = q.dimensions()[1], d = q.dimensions()[2];
  const QT* qp = static_cast<const QT*>(q.untyped_data());
  QT* op = static_cast<QT*>(out->untyped_data());
  switch (d) {
    case 16: return run_items<QT, PT, 1>(pool, items, rows, qp, op, pg, hq, d, scale);
    case 32: return run_items<QT, PT, 2>(pool, items, rows, qp, op, pg, hq, d, scale);
    case 64: return run_items<QT, PT, 4>(pool, items, rows, qp, op, pg, hq, d, scale);
    case 128: return run_items<QT, PT, 8>(pool, items, rows, qp, op, pg, hq, d, scale);
    default: return run_items<QT, PT, 0>(pool, items, rows, qp, op, pg, hq, d, scale);
  }
}

bool is_16bit(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::U16; }

ffi::Error check(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, int64_t tables_rows,
                 int64_t rows) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("q must be float32 or bfloat16");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("k and v pages must have one dtype");
  if (k.element_type() != ffi::DataType::F32 && !is_16bit(k.element_type()))
    return ffi::Error::InvalidArgument("pages must be float32, bfloat16 or uint16 (bf16 bits)");
  if (qd.size() != 3 || kd.size() != 4 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("q must be [T, Hq, D] and pages [blocks, block, Hkv, D]");
  if (qd[2] != kd[3] || qd[1] % kd[2] != 0 || qd[1] / kd[2] > 64 || qd[2] > kMaxHeadDim)
    return ffi::Error::InvalidArgument("q heads must be a multiple (<= 64) of the KV heads, "
                                       "with the pages' head size (<= 1024)");
  if (tables_rows < rows)
    return ffi::Error::InvalidArgument("the block tables need a row per sequence");
  return ffi::Error::Success();
}

void run(ffi::ThreadPool& pool, const std::vector<Item>& items, const std::vector<Row>& rows,
         ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer>& out,
         float scale) {
  std::memset(out->untyped_data(), 0, out->size_bytes());
  const bool q16 = q.element_type() == ffi::DataType::BF16, p16 = is_16bit(k.element_type());
  if (q16 && p16)
    run_typed<uint16_t, uint16_t>(pool, items, rows, q, k, v, out, scale);
  else if (q16)
    run_typed<uint16_t, float>(pool, items, rows, q, k, v, out, scale);
  else if (p16)
    run_typed<float, uint16_t>(pool, items, rows, q, k, v, out, scale);
  else
    run_typed<float, float>(pool, items, rows, q, k, v, out, scale);
}

inline int64_t window_start(int64_t pos, int32_t window) {
  return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0;
}

// Decode: q [B, Hq, D], row b at position seq_lens[b] - 1 (0: a padded row, zeros).
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> seq_lens, ffi::Result<ffi::AnyBuffer> out,
                              float sm_scale, int32_t sliding_window) {
  const int64_t b = q.dimensions()[0];
  if (ffi::Error e = check(q, k, v, tables.dimensions()[0], b); e.failure()) return e;
  const int64_t width = tables.dimensions()[1], max_keys = width * k.dimensions()[1];
  const int64_t hkv = k.dimensions()[2];
  std::vector<Row> rows(b);
  std::vector<Item> items(b);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t pos = std::min<int64_t>(seq_lens.typed_data()[i], max_keys) - 1;
    rows[i] = {i, pos, window_start(pos, sliding_window)};
    // Decode reads each page once, for all heads: memory bound, and whole pages in order
    // are what the hardware prefetches best.
    items[i] = {tables.typed_data() + i * width, i, 1, 0, hkv};
  }
  run(pool, items, rows, q, k, v, out, sm_scale);
  return ffi::Error::Success();
}

// Prefill chunks: q [T, Hq, D] packed; sequence s owns rows cu_q_lens[s]..cu_q_lens[s+1] and
// has kv_lens[s] tokens (cached + new), so its row i sits at kv_lens[s] - q_len + i. Rows
// outside cu_q_lens[0]..cu_q_lens[S] are zeros.
ffi::Error RaggedPagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                                    int32_t sliding_window) {
  const int64_t t = q.dimensions()[0], s = kv_lens.dimensions()[0];
  if (ffi::Error e = check(q, k, v, tables.dimensions()[0], s); e.failure()) return e;
  if (cu_q_lens.dimensions()[0] != s + 1)
    return ffi::Error::InvalidArgument("cu_q_lens must have one more entry than kv_lens");
  const int64_t width = tables.dimensions()[1], max_keys = width * k.dimensions()[1];
  const int64_t hkv = k.dimensions()[2];
  const int32_t* cu = cu_q_lens.typed_data();
  std::vector<Row> rows;
  std::vector<Item> items;
  rows.reserve(t);
  for (int64_t seq = 0; seq < s; ++seq) {
    const int64_t begin = std::max<int64_t>(cu[seq], 0), end = std::min<int64_t>(cu[seq + 1], t);
    const int64_t q_len = cu[seq + 1] - cu[seq];
    for (int64_t r = begin; r < end; r += kRowsPerItem) {
      // Prefill is compute bound: one head per item keeps its keys in the core's cache.
      const int64_t count = std::min(kRowsPerItem, end - r);
      for (int64_t h = 0; h < hkv; ++h)
        items.push_back({tables.typed_data() + seq * width, static_cast<int64_t>(rows.size()),
                         count, h, 1});
      for (int64_t i = r; i < r + count; ++i) {
        const int64_t pos = std::min<int64_t>(kv_lens.typed_data()[seq] - q_len + (i - cu[seq]),
                                              max_keys - 1);
        rows.push_back({i, pos, window_start(pos, sliding_window)});
      }
    }
  }
  run(pool, items, rows, q, k, v, out, sm_scale);
  return ffi::Error::Success();
}

}  // namespace

namespace {

// What both handlers take first: the pool; q, the K and V pages, the block tables and the
// sequences' lengths.
auto bind_paged() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OmniJaxPagedAttention, PagedAttentionImpl,
                              bind_paged()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OmniJaxRaggedPagedAttention, RaggedPagedAttentionImpl,
                              bind_paged()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window"));

// The key setup.py built this library for (kernels_cpu/build_info.py: source, flags, CPU);
// kernels_cpu/library.py refuses a library whose key no longer matches.
#ifndef OMNI_JAX_BUILD_KEY
#error "build through setup.py (pip install -e .): it defines OMNI_JAX_BUILD_KEY"
#endif
extern "C" const char* OmniJaxBuildKey() { return OMNI_JAX_BUILD_KEY; }
