// Attention of a step's rows over the KV cache, each row by itself.
#pragma once

namespace {

// Attention of a few query rows over the KV cache, each row on its own (the same arithmetic whatever the number
// of rows, as for the products). q [B, H, R, D]: the R = G * T query rows of KV head h, row i being token i % T;
// k, v [B, H, L, D], the cache; visible [B, T, L], the slots token t sees (model.py's glue decides them). A row
// scores the slots from its first visible one, rounded down to 8, to its last; those it does not see are masked. In
// float: a score is a dot product in two 8-lane chains (even and odd 8-element chunks of D) summed in a fixed tree
// (sum4x8); the softmax's exp is exp8; the weighted sum of values runs over slots in order. The G rows of a token (its
// query heads) go together, sharing each load of a key or a value, which is converted to float in registers as it is
// read (not copied to a float cache first: the copy was written at every call and spilled out of L2 at long contexts).
// The scores of RB query rows (float [RB][D]) over slots s0 .. s0 + 3 of keys [4][D]: per row and slot a dot
// product in two 8-lane chains (even and odd 8-element chunks of D) summed in a fixed tree (sum4x8).
template <int RB, class T>
inline void scores4(const T* keys, const float* queries, int64_t D, float* scores, int64_t stride) {
  f32x8 even[RB][4], odd[RB][4];
  for (int r = 0; r < RB; r++)
    for (int j = 0; j < 4; j++) even[r][j] = odd[r][j] = f32x8{};
  for (int64_t d = 0; d < D; d += 16)
    for (int j = 0; j < 4; j++) {
      const f32x8 k_even = load8(keys + j * D + d), k_odd = load8(keys + j * D + d + 8);
      for (int r = 0; r < RB; r++) {
        even[r][j] += k_even * load8(&queries[r * D + d]);
        odd[r][j] += k_odd * load8(&queries[r * D + d + 8]);
      }
    }
  for (int r = 0; r < RB; r++) {
    for (int j = 0; j < 4; j++) even[r][j] += odd[r][j];
    sum4x8(even[r], scores + r * stride);
  }
}

// Scores of RB rows of one token (they share each key load) over slots 0 .. last of keys, 4 at a time: past last
// they are masked later; past the cache's end a zero-padded copy stands in.
template <int RB, class T>
void scores_rows(const T* keys, int64_t cache, const float* queries, int64_t last, int64_t D, float* scores,
                 int64_t stride) {
  int64_t s0 = 0;
  for (; s0 <= last && s0 + 4 <= cache; s0 += 4) scores4<RB>(keys + s0 * D, queries, D, scores + s0, stride);
  if (s0 <= last) {
    std::vector<T> tail(4 * D, T(0.f));
    std::copy(keys + s0 * D, keys + cache * D, tail.begin());
    scores4<RB>(tail.data(), queries, D, scores + s0, stride);
  }
}

// out[r][0 .. 8 NC) = (sum over slots s < n, in order, of weights[r][s] * values[s D + 0 .. 8 NC)) / total[r], for
// RB rows sharing each load of values.
template <int NC, int RB, class T>
void weighted_sum(const T* values, const float* weights, int64_t stride, int64_t n, int64_t D, const float* total,
                  float* out) {
  f32x8 acc[RB][NC];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = f32x8{};
  for (int64_t s = 0; s < n; s++)
    for (int c = 0; c < NC; c++) {
      const f32x8 value = load8(values + s * D + 8 * c);
      for (int r = 0; r < RB; r++) acc[r][c] += value * weights[r * stride + s];
    }
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NC; c++) {
      const f32x8 v = acc[r][c] / total[r];
      std::memcpy(out + r * D + 8 * c, &v, sizeof v);
    }
}

template <int RB, class T>
void weighted_sums(const T* values, const float* weights, int64_t stride, int64_t n, int64_t D, const float* total,
                   float* out) {
  for (int64_t d = 0; d < D; d += 64) {
    switch (std::min<int64_t>(D - d, 64) / 8) {  // D is a multiple of 16
      case 8: weighted_sum<8, RB>(values + d, weights, stride, n, D, total, out + d); break;
      case 6: weighted_sum<6, RB>(values + d, weights, stride, n, D, total, out + d); break;
      case 4: weighted_sum<4, RB>(values + d, weights, stride, n, D, total, out + d); break;
      default: weighted_sum<2, RB>(values + d, weights, stride, n, D, total, out + d); break;
    }
  }
}

// Rows of one token at a time, up to 3 together (AVX-512 has the registers; AVX2's 16 hold one row's chains).
#if FR_AVX512F
constexpr int ROW_BLOCK = 3;
#else
constexpr int ROW_BLOCK = 1;
#endif

// The first and last slot a token sees (last -1: none), from its row of visible, 8 bytes at a time where none is seen.
inline void visible_range(const bool* seen, int64_t n, int64_t& first, int64_t& last) {
  uint64_t word;
  first = 0;
  while (first + 8 <= n && (std::memcpy(&word, seen + first, 8), word == 0)) first += 8;
  while (first < n && !seen[first]) first++;
  last = n - 1;
  while (last - 7 >= first && (std::memcpy(&word, seen + last - 7, 8), word == 0)) last -= 8;
  while (last >= first && !seen[last]) last--;
  if (first == n) last = -1;
}

// Which of slots s .. s + 7 a row sees (none past last): the lanes' mask.
inline i32x8 seen8(const bool* seen, int64_t s, int64_t last) {
  i32x8 lanes;
  for (int j = 0; j < 8; j++) lanes[j] = s + j <= last && seen[s + j] ? -1 : 0;
  return lanes;
}

template <class T>
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                          float scale) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), cache = k.size(2), tokens = visible.size(1);
  at::Tensor y = at::empty(q.sizes(), q.options());
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const bool* vis = visible.data_ptr<bool>();
  const int64_t groups = R / tokens;  // query heads per KV head; row g * tokens + t is token t of head g
  // A task per KV head and token: a verify's 15 (5 tokens x 3 KV heads) split 8 / 7 over 2 threads, where the
  // 3 KV heads alone split 2 / 1.
  at::parallel_for(0, B * H * tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(ROW_BLOCK * D), scores, out(ROW_BLOCK * D);
    for (int64_t job = begin; job < end; job++) {
      const int64_t task = job / tokens, t = job % tokens, b = task / H;
      const bool* seen = vis + (b * tokens + t) * cache;
      int64_t first, last;
      visible_range(seen, cache, first, last);
      const int64_t base = first / 8 * 8;  // slots base .. last, as scores base .. last - base
      const T* head_keys = kp + (task * cache + base) * D;
      const T* head_values = vp + (task * cache + base) * D;
      const int64_t n = last - base;  // the last slot, counted from base
      for (int64_t g0 = 0; g0 < groups; g0 += ROW_BLOCK) {
        const int rb = int(std::min<int64_t>(ROW_BLOCK, groups - g0));
        if (last < 0) {  // a row that sees nothing: softmax over no slots
          for (int r = 0; r < rb; r++)
            for (int64_t d = 0; d < D; d++) yp[(task * R + (g0 + r) * tokens + t) * D + d] = static_cast<T>(NAN);
          continue;
        }
        const int64_t padded = (n + 8) / 8 * 8;  // scores go 4 and 8 slots at a time
        scores.resize(ROW_BLOCK * padded);
        for (int r = 0; r < rb; r++)
          for (int64_t d = 0; d < D; d++) queries[r * D + d] = float(qp[(task * R + (g0 + r) * tokens + t) * D + d]);
        switch (rb) {
          case 3: scores_rows<3>(head_keys, cache - base, queries.data(), n, D, scores.data(), padded); break;
          case 2: scores_rows<2>(head_keys, cache - base, queries.data(), n, D, scores.data(), padded); break;
          default: scores_rows<1>(head_keys, cache - base, queries.data(), n, D, scores.data(), padded); break;
        }
        float total[ROW_BLOCK];
        for (int r = 0; r < rb; r++) {
          float* row_scores = scores.data() + r * padded;
          f32x8 top = f32x8{} - INFINITY;  // slots the row does not see (and past last, to the next 8) are masked
          for (int64_t s0 = 0; s0 <= n; s0 += 8) {
            const f32x8 s = load8(&row_scores[s0]) * scale;
            std::memcpy(&row_scores[s0], &s, sizeof s);
            top = seen8(seen, base + s0, last) != 0 && s > top ? s : top;
          }
          float largest = top[0];
          total[r] = 0.f;
          for (int j = 1; j < 8; j++) largest = std::max(largest, top[j]);
          f32x8 totals = {};
          for (int64_t s0 = 0; s0 <= n; s0 += 8) {
            f32x8 e = exp8(load8(&row_scores[s0]) - largest);
            e = seen8(seen, base + s0, last) != 0 ? e : f32x8{};
            std::memcpy(&row_scores[s0], &e, sizeof e);
            totals += e;
          }
          for (int j = 0; j < 8; j++) total[r] += totals[j];
        }
        switch (rb) {
          case 3: weighted_sums<3>(head_values, scores.data(), padded, n + 1, D, total, out.data()); break;
          case 2: weighted_sums<2>(head_values, scores.data(), padded, n + 1, D, total, out.data()); break;
          default: weighted_sums<1>(head_values, scores.data(), padded, n + 1, D, total, out.data()); break;
        }
        for (int r = 0; r < rb; r++)
          for (int64_t d = 0; d < D; d++)
            yp[(task * R + (g0 + r) * tokens + t) * D + d] = static_cast<T>(out[r * D + d]);
      }
    }
  });
  return y;
}

// Whether attention takes these: q [B, H, R, D], k, v [B, H, L, D] of one dtype, bf16 or float32, D a multiple of 16,
// visible bool [B, T, L] with T dividing R.
bool attention_takes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible) {
  return q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
         k.size(3) == q.size(3) && q.size(3) % L == 0 && k.scalar_type() == q.scalar_type() &&
         v.scalar_type() == q.scalar_type() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) &&
         visible.scalar_type() == at::kBool && visible.dim() == 3 && visible.size(0) == q.size(0) &&
         visible.size(1) > 0 && q.size(2) % visible.size(1) == 0 && visible.size(2) == k.size(2);
}

// model.py's attention op: softmax(q k^T * scale) v, each query row over the slots its token sees.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                     double scale) {
  TORCH_CHECK(attention_takes(q, k, v, visible), "few_rows: attention takes q [B, H, R, D], k, v [B, H, L, D] of one "
              "dtype (bf16 or float32, D a multiple of 16) and bool visible [B, T, L], T dividing R");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), pc = visible.contiguous();
  if (q.scalar_type() == at::kBFloat16) return attention_rows<c10::BFloat16>(qc, kc, vc, pc, float(scale));
  return attention_rows<float>(qc, kc, vc, pc, float(scale));
}

}  // namespace
