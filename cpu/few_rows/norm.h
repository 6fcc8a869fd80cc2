// RMSNorm of rows, rounded where eager PyTorch rounds it: model.py's rms_norm op on the CPU.
#pragma once

namespace {

template <class T>
inline float rounded(float v) {  // v rounded to T (bf16: nearest, ties to even), as a float
  return float(T(v));
}

// The same, 8 at a time: bf16's rounding as c10::BFloat16 does it (a NaN becomes its quiet NaN), in integer lanes.
template <class T>
inline f32x8 rounded8(f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    u32x8 bits;
    std::memcpy(&bits, &v, sizeof v);
    bits = (bits + ((bits >> 16) & 1u) + 0x7FFFu) & 0xFFFF0000u;
    bits = (u32x8)(v != v) ? u32x8{} + 0x7FC00000u : bits;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
}

// x[l]^2 into sum[l] for l < V, each square rounded by itself, as PyTorch's pow(2) rounds it.
template <int V>
__attribute__((optimize("fp-contract=off"))) void add_squares(float* sum, const float* x) {
  for (int l = 0; l < V; l++) sum[l] += x[l] * x[l];
}

// The sum of x[i]^2 in the order of PyTorch's CPU sum over a contiguous row (SumKernel.cpp's vectorized_inner_sum,
// which runs 8-lane vectors here even where PyTorch's other kernels run AVX-512's 16): the row's vectors taken 4 at a
// time into 4 vector sums, which a cascade adds up in chunks of 2^p groups (p = max(4, ceil(log2 groups) / 4)), the
// vectors left over into the first sum, the 4 sums in turn, then the elements left over and the lanes in order.
// RMSNorm's mean then is eager PyTorch's bit for bit, and so are its bf16 roundings (without the cascade, a third of
// the Qwen 1.5B's rows got another mean, and one of them 11 other bf16 outputs).
inline float sum_of_squares(const float* x, int64_t n) {
  constexpr int V = 8;
  typedef float lanes[V];
  const int64_t vectors = n / V, groups = vectors / 4;
  const int64_t ceil_log2 = groups <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(groups - 1));
  const int64_t power = std::max<int64_t>(4, ceil_log2 / 4), step = int64_t(1) << power, mask = step - 1;
  lanes acc[4][4] = {};  // [level][sum]
  int64_t i = 0;
  while (i + step <= groups) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int k = 0; k < 4; k++) add_squares<V>(acc[0][k], x + (4 * i + k) * V);
    for (int level = 1; level < 4; level++) {
      for (int k = 0; k < 4; k++)
        for (int l = 0; l < V; l++) acc[level][k][l] += acc[level - 1][k][l], acc[level - 1][k][l] = 0.f;
      if (i & (mask << (level * power))) break;
    }
  }
  for (; i < groups; i++)
    for (int k = 0; k < 4; k++) add_squares<V>(acc[0][k], x + (4 * i + k) * V);
  for (int level = 1; level < 4; level++)
    for (int k = 0; k < 4; k++)
      for (int l = 0; l < V; l++) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = 4 * groups; v < vectors; v++) add_squares<V>(acc[0][0], x + v * V);
  for (int k = 1; k < 4; k++)
    for (int l = 0; l < V; l++) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = vectors * V; e < n; e++) add_squares<1>(&total, x + e);
  for (int l = 0; l < V; l++) total += acc[0][0][l];
  return total;
}

// Rows of T (bf16 or float) x [R, dim] into out [R, dim] of T: each row in float32 (a row's floats in `row`), its outputs
// rounded to T before and after the weight.
template <class T>
void rms_norm_rows(const T* x, const T* w, double eps, int64_t R, int64_t dim, T* out) {
  std::vector<float> row(dim), y(dim);
  for (int64_t r = 0; r < R; r++) {
    for (int64_t i = 0; i < dim; i++) row[i] = float(x[r * dim + i]);
    const float scale = 1.f / std::sqrt(sum_of_squares(row.data(), dim) / float(dim) + float(eps));
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) store8(&y[i], rounded8<T>(load8(w + i) * rounded8<T>(load8(&row[i]) * scale)));
    for (; i < dim; i++) y[i] = rounded<T>(float(w[i]) * rounded<T>(row[i] * scale));
    for (int64_t i = 0; i < dim; i++) out[r * dim + i] = T(y[i]);  // exact: y holds values of T
  }
}

// Whether rms_norm takes these: x [..., dim] and a weight [dim] of its dtype, bf16 or float32.
bool rms_norm_takes(const at::Tensor& x, const at::Tensor& weight) {
  return x.dim() >= 1 && weight.dim() == 1 && weight.numel() == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
}

// model.py's rms_norm op: x [..., dim] and weight [dim] in the model's dtype, each row by itself.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_takes(x, weight), "few_rows: rms_norm takes bf16 or float32 x [..., dim] and weight [dim] of "
              "its dtype");
  const at::Tensor xc = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(xc.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), eps, rows, dim,
                  out.data_ptr<c10::BFloat16>());
  else
    rms_norm_rows(xc.data_ptr<float>(), w.data_ptr<float>(), eps, rows, dim, out.data_ptr<float>());
  return out;
}

}  // namespace
