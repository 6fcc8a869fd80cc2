// Products with fp32 and bf16 weights by rows (DenseWeight: bf16 in column tiles is columns.h), and the inputs that
// packed MX 6-bit codes multiply in pairs (pair_inputs).
#pragma once

namespace {

// A weight matrix hands out rows; row(k) gives the 16 weights from k as floats. Codes of type T, times one
// factor per block of 2^shift along k (Blocks). One factor per row (Rows) multiplies the row's finished sums
// instead: a multiply per output, not per 16 weights.
enum Factors { None, Blocks, Rows };
template <class T, Factors F>
struct DenseWeight {
  const T* w;
  const float* factors;
  int64_t K, per_row, shift;
  struct Row {
    const T* w;
    const float* factors;
    int64_t shift;
    void prefetch(int64_t k) const { __builtin_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_BYTES); }
    __attribute__((always_inline)) f32x16 operator()(int64_t k) const {
      f32x16 v = to_float(w + k);
      return F == Blocks ? v * factors[k >> shift] : v;
    }
    float finish(float sum) const { return F == Rows ? sum * factors[0] : sum; }
  };
  Row row(int64_t n) const { return {w + n * K, factors + n * per_row, shift}; }
};

// The input rows [M, K] as packed MX 6-bit codes multiply them in pairs (fp6.h): bf16 in order for vdpbf16ps;
// elsewhere floats, each 32 along k stored as its 16 odd elements, then its 16 even ones (lane i: elements 2i + 1 and
// 2i).
// In a tensor, for its 64-byte alignment (a 64-byte load of x must not straddle two cache lines).
#if FR_AVX512BF16
typedef uint16_t PairInput;
constexpr auto kPairInput = at::kBFloat16;
#else
typedef float PairInput;
constexpr auto kPairInput = at::kFloat;
#endif
// The scalar reference (and AVX2's code): each input rounded to bf16, nearest, ties to even, kept as a float.
inline void pair_inputs_reference(const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 2 * L)
    for (int j = 0; j < L; j++) {
      out[i + j] = bf16_value(round_to_bf16(x[i + 2 * j + 1]));
      out[i + L + j] = bf16_value(round_to_bf16(x[i + 2 * j]));
    }
}

at::Tensor pair_inputs(const float* x, int64_t M, int64_t K) {
  at::Tensor buffer = at::empty({M * K}, at::TensorOptions().dtype(kPairInput));
  PairInput* out = reinterpret_cast<PairInput*>(buffer.data_ptr());
#if FR_AVX512BF16  // nearest, ties to even, 32 at a time (denormals flushed to zero, as in vdpbf16ps)
  for (int64_t i = 0; i < M * K; i += 2 * L)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + L), _mm512_loadu_ps(x + i)));
#else
  pair_inputs_reference(x, M * K, out);
#endif
  return buffer;
}

// The 16 high (odd) and low (even) elements of 32 bf16 weights from p, as floats.
inline void pair_halves_reference(const uint16_t* p, f32x16& high, f32x16& low) {
  for (int j = 0; j < L; j++) {
    high.part[j / W][j % W] = bf16_value(p[2 * j + 1]);
    low.part[j / W][j % W] = bf16_value(p[2 * j]);
  }
}

// R input rows (up to RowsPerPass) times weight rows n0 .. n1 - 1, one pass over each weight row, streaming one
// row of weights at a time (several side by side were slower on the AMD CPUs measured). Two sums per row, of the
// even and the odd 16 weights of each 32, added at the end: one chain of FMAs waited on itself. Registers: 2R
// sums and two converted weight vectors. Not inlined: inlined into product's parallel loop, GCC kept the
// accumulators on the stack; the explicit zeroing, unlike `= {}`, does not clear a stack copy at every call.
// (What each choice measured: docs/performance.md, few_rows.cpp's design.)
template <int R, class Weight>
__attribute__((noinline)) void tile(const Weight& weight, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1,
                                    float* y) {
  for (int64_t n = n0; n < n1; n++) {
    f32x16 even[R], odd[R];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < L / W; h++) even[r].part[h] = odd[r].part[h] = native{};
    const auto row = weight.row(n);
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
      const f32x16 w0 = row(k), w1 = row(k + L);
      row.prefetch(k);
      row.prefetch(k + L);
      for (int r = 0; r < R; r++) {
        even[r] += load(x + r * K + k) * w0;
        odd[r] += load(x + r * K + k + L) * w1;
      }
    }
    if (k < K) {  // K an odd multiple of 16
      const f32x16 w0 = row(k);
      for (int r = 0; r < R; r++) even[r] += load(x + r * K + k) * w0;
    }
    for (int r = 0; r < R; r++) y[r * N + n] = row.finish(sum_lanes(even[r] += odd[r]));
  }
}

template <class T, Factors F>
struct RowsPerPass<DenseWeight<T, F>> {
  static constexpr int value = W == 16 ? 7 : 3;  // AVX2 holds 16 lanes in two of its 16 registers; 8 rows were slower
};

template <class T>
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const T* codes = reinterpret_cast<const T*>(w.data_ptr());
  const float* xp = x.data_ptr<float>();
  if (!factors) return product(DenseWeight<T, None>{codes, nullptr, K, 0, 0}, xp, M, K, N);
  TORCH_CHECK(factors->scalar_type() == at::kFloat && factors->is_contiguous() && factors->size(0) == N,
              "few_rows: factors must be contiguous float32 [N] or [N, K / block]");
  const int64_t per_row = factors->numel() / N;
  if (per_row == 1) return product(DenseWeight<T, Rows>{codes, factors->data_ptr<float>(), K, 1, 0}, xp, M, K, N);
  return product(DenseWeight<T, Blocks>{codes, factors->data_ptr<float>(), K, per_row,
                                        block_shift(K, per_row, "factors")}, xp, M, K, N);
}

}  // namespace
