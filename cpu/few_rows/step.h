// A whole few-row step of a Llama-family model in one call (llama_step).
#pragma once

namespace {

// A whole few-row step of a Llama-family model in one call (cpu.modules.OneCallStep): the embedding
// rows, then per layer RMSNorm, q/k/v, rotary, the cache write, attention, the output product and the residual,
// RMSNorm, gate/up, SiLU(gate) times up, down and the residual; then the final RMSNorm and the LM head. The same
// operations as model.py's forward, rounded to the model's dtype where its eager PyTorch rounds them, and every
// row computed by itself, so a verify's rows are a decode's. It replaces ~150 small kernels that a compiled step
// ran from Python between the products (docs/how-it-works.md has what that saved).
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

// out[i] = round(x[i] + y[i]), or round(x[i]) without y: a residual add, a bias, a product's output in T.
template <class T>
void add_rounded(const float* x, const float* y, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, rounded8<T>(y ? load8(x + i) + load8(y + i) : load8(x + i)));
  for (; i < n; i++) out[i] = rounded<T>(y ? x[i] + y[i] : x[i]);
}

// out[i] = round(round(silu(gate[i])) * up[i]), as F.silu(gate) * up in T; silu(g) = g / (1 + exp(-g)) with exp8,
// and exp(-g) infinite for g < -88 (exp8 does not reach infinity by itself), so silu is -0 there, as in PyTorch.
template <class T>
void silu_times(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f32x8 g = load8(gate + i);
    const f32x8 e = g < -88.f ? f32x8{} + INFINITY : exp8(-g);
    store8(out + i, rounded8<T>(rounded8<T>(g / (1.f + e)) * load8(up + i)));
  }
  for (; i < n; i++) out[i] = rounded<T>(rounded<T>(gate[i] / (1.f + std::exp(-gate[i]))) * up[i]);
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

template <class T>
void rms_norm_rows(const float* x, const at::Tensor& weight, double eps, int64_t R, int64_t dim, float* out) {
  const T* w = reinterpret_cast<const T*>(weight.data_ptr());
  for (int64_t r = 0; r < R; r++) {
    const float* xr = x + r * dim;
    const float scale = 1.f / std::sqrt(sum_of_squares(xr, dim) / float(dim) + float(eps));
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
      store8(out + r * dim + i, rounded8<T>(load8(w + i) * rounded8<T>(load8(xr + i) * scale)));
    for (; i < dim; i++) out[r * dim + i] = rounded<T>(float(w[i]) * rounded<T>(xr[i] * scale));
  }
}

// rms_norm_rows as an op, for the tests: x [R, dim] and weight [dim] in the model's dtype, as model.RMSNorm takes them.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "few_rows: rms_norm takes bf16 or float32 x [R, dim] and weight [dim] of its dtype");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(x.sizes(), xf.options());
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<c10::BFloat16>(xf.data_ptr<float>(), weight, eps, x.size(0), x.size(1), out.data_ptr<float>());
  else
    rms_norm_rows<float>(xf.data_ptr<float>(), weight, eps, x.size(0), x.size(1), out.data_ptr<float>());
  return out.to(x.scalar_type());
}

// One head's q or k, rotated on its first 2 * half dims (pairs j, j + half; model.apply_rotary) and rounded to T:
// each product rounded, as PyTorch's eager rotary computes them (not fused into multiply-adds).
template <class T>
__attribute__((optimize("fp-contract=off"))) void rotate(const float* in, const float* cos, const float* sin,
                                                          int64_t half, int64_t D, T* out) {
  for (int64_t j = 0; j < half; j++) {
    out[j] = T(in[j] * cos[j] - in[j + half] * sin[j]);
    out[j + half] = T(in[j + half] * cos[j] + in[j] * sin[j]);
  }
  for (int64_t j = 2 * half; j < D; j++) out[j] = T(in[j]);
}

// What llama_step takes besides tokens and positions (cpu.modules.OneCallStep.operands): per layer 2
// norms and 4 products (q/k/v stacked, wo, gate/up stacked, w2) with their factors, tables and biases, then the
// final norm and the LM head.
struct StepOperands {
  const at::Tensor& embeddings;
  const at::Tensor& cos;
  const at::Tensor& sin;
  at::TensorList norms, weights;
  const c10::List<std::optional<at::Tensor>>& factors;
  const c10::List<std::optional<at::Tensor>>& tables;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::TensorList k_caches, v_caches;
  int64_t n_heads, n_kv_heads;
  double eps;
};

// Product i of the step: y [R, N] = x [R, K] times weight i (with its factors and table), plus its bias, each
// output rounded to T as the Linear modules round theirs.
template <class T>
at::Tensor step_product(const at::Tensor& x, const StepOperands& s, int64_t i, int64_t outputs) {
  at::Tensor y = linear(x, s.weights[i], s.factors.get(i), s.tables.get(i));
  TORCH_CHECK(y.size(1) == outputs, "few_rows: llama_step's product ", i, " has ", y.size(1), " outputs, not ",
              outputs);
  float* yp = y.data_ptr<float>();
  const int64_t R = y.size(0), N = y.size(1);
  const std::optional<at::Tensor> bias = s.biases.get(i);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "few_rows: llama_step's biases must be float32 [outputs]");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < R; r++) add_rounded<T>(yp + r * N, b, N, yp + r * N);
  return y;
}

template <class T>
at::Tensor llama_step_rows(const at::Tensor& tokens, const at::Tensor& positions, const StepOperands& s) {
  const at::Tensor& embeddings = s.embeddings;
  const int64_t n_heads = s.n_heads, n_kv_heads = s.n_kv_heads;
  const int64_t B = tokens.size(0), S = tokens.size(1), R = B * S, dim = embeddings.size(1);
  const int64_t layers = s.k_caches.size(), D = s.k_caches[0].size(3), slots = s.k_caches[0].size(2);
  const int64_t G = n_heads / n_kv_heads, half = s.cos.size(1), Q = n_heads * D, KV = n_kv_heads * D;
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_p = s.cos.data_ptr<float>();
  const float* sin_p = s.sin.data_ptr<float>();
  const T* table = reinterpret_cast<const T*>(embeddings.data_ptr());
  const auto floats = embeddings.options().dtype(at::kFloat);
  std::vector<float> x(R * dim);  // the residual stream, values of T
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < dim; i++) x[r * dim + i] = float(table[token[r] * dim + i]);
  at::Tensor h = at::empty({R, dim}, floats), a = at::empty({R, Q}, floats);
  at::Tensor q = at::empty({B, n_kv_heads, G * S, D}, embeddings.options());
  T* qp = reinterpret_cast<T*>(q.data_ptr());
  float* hp = h.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  for (int64_t l = 0; l < layers; l++) {
    rms_norm_rows<T>(x.data(), s.norms[2 * l], s.eps, R, dim, hp);
    const at::Tensor qkv = step_product<T>(h, s, 4 * l, Q + 2 * KV);
    const float* qkv_p = qkv.data_ptr<float>();
    T* kc = reinterpret_cast<T*>(s.k_caches[l].data_ptr());
    T* vc = reinterpret_cast<T*>(s.v_caches[l].data_ptr());
    for (int64_t r = 0; r < R; r++) {
      const int64_t b = r / S, t = r % S, p = pos[r];
      const float* row = qkv_p + r * (Q + 2 * KV);
      const float *c = cos_p + p * half, *sn = sin_p + p * half;
      for (int64_t head = 0; head < n_heads; head++)  // q [B, KV heads, G * S, D], row g * S + t of its KV head
        rotate(row + head * D, c, sn, half, D, qp + ((b * n_kv_heads + head / G) * G * S + (head % G) * S + t) * D);
      for (int64_t head = 0; head < n_kv_heads; head++) {
        const int64_t slot = ((b * n_kv_heads + head) * slots + p) * D;
        rotate(row + Q + head * D, c, sn, half, D, kc + slot);
        for (int64_t j = 0; j < D; j++) vc[slot + j] = T(row[Q + KV + head * D + j]);
      }
    }
    const at::Tensor y = attention_rows<T>(q, s.k_caches[l], s.v_caches[l], positions);
    const T* yp = reinterpret_cast<const T*>(y.data_ptr());
    for (int64_t r = 0; r < R; r++)  // y [B, H, S, D] -> a [B * S, H * D]
      for (int64_t head = 0; head < n_heads; head++)
        for (int64_t j = 0; j < D; j++)
          ap[r * Q + head * D + j] = float(yp[(((r / S) * n_heads + head) * S + r % S) * D + j]);
    const at::Tensor o = step_product<T>(a, s, 4 * l + 1, dim);
    add_rounded<T>(x.data(), o.data_ptr<float>(), R * dim, x.data());
    rms_norm_rows<T>(x.data(), s.norms[2 * l + 1], s.eps, R, dim, hp);
    const int64_t I = outputs(s.weights[4 * l + 2]) / 2;
    const at::Tensor gate_up = step_product<T>(h, s, 4 * l + 2, 2 * I);
    at::Tensor m = at::empty({R, I}, floats);
    const float* gu = gate_up.data_ptr<float>();
    float* mp = m.data_ptr<float>();
    for (int64_t r = 0; r < R; r++) silu_times<T>(gu + r * 2 * I, gu + r * 2 * I + I, I, mp + r * I);
    const at::Tensor down = step_product<T>(m, s, 4 * l + 3, dim);
    add_rounded<T>(x.data(), down.data_ptr<float>(), R * dim, x.data());
  }
  rms_norm_rows<T>(x.data(), s.norms[2 * layers], s.eps, R, dim, hp);
  const int64_t V = outputs(s.weights[4 * layers]);
  const at::Tensor logits = step_product<T>(h, s, 4 * layers, V);
  if constexpr (std::is_same_v<T, float>) {
    return logits.view({B, S, V});
  } else {  // values of T already: their upper halves
    at::Tensor out = at::empty({B, S, V}, embeddings.options());
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(logits.data_ptr<float>());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < R * V; i++) op[i] = uint16_t(bits[i] >> 16);
    return out;
  }
}

at::Tensor llama_step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& embeddings,
                      const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
                      const c10::List<std::optional<at::Tensor>>& factors,
                      const c10::List<std::optional<at::Tensor>>& tables,
                      const c10::List<std::optional<at::Tensor>>& biases, at::TensorList k_caches,
                      at::TensorList v_caches, int64_t n_heads, int64_t n_kv_heads, double eps) {
  const int64_t layers = k_caches.size();
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  positions.sizes() == tokens.sizes() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "few_rows: llama_step takes contiguous int64 tokens and positions [B, S]");
  TORCH_CHECK(layers > 0 && int64_t(v_caches.size()) == layers && int64_t(norms.size()) == 2 * layers + 1 &&
                  int64_t(weights.size()) == 4 * layers + 1 && int64_t(factors.size()) == 4 * layers + 1 &&
                  int64_t(tables.size()) == 4 * layers + 1 && int64_t(biases.size()) == 4 * layers + 1,
              "few_rows: llama_step takes 2 norms and 4 products per layer, a final norm and the LM head");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && n_heads % n_kv_heads == 0,
              "few_rows: llama_step takes float32 rotary tables [positions, rotary_dim / 2]");
  const int64_t B = tokens.size(0), slots = k_caches[0].size(2), vocabulary = embeddings.size(0);
  for (int64_t l = 0; l < layers; l++)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].size(0) == B && k_caches[l].size(1) == n_kv_heads &&
                    k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == embeddings.scalar_type() &&
                    v_caches[l].scalar_type() == embeddings.scalar_type(),
                "few_rows: llama_step's caches must be contiguous [B, KV heads, slots, head dim] in the model's dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) >= slots &&
                  2 * cos.size(1) <= k_caches[0].size(3) && embeddings.dim() == 2 && embeddings.is_contiguous(),
              "few_rows: llama_step's rotary tables or embeddings do not fit its caches");
  for (int64_t i = 0; i < tokens.numel(); i++) {
    const int64_t token = tokens.data_ptr<int64_t>()[i], position = positions.data_ptr<int64_t>()[i];
    TORCH_CHECK(token >= 0 && token < vocabulary, "few_rows: token ", token, " is outside the vocabulary of ",
                vocabulary);
    TORCH_CHECK(position >= 0 && position < slots, "few_rows: position ", position, " is outside the cache of ",
                slots);
  }
  for (int64_t l = 0; l <= 2 * layers; l++)
    TORCH_CHECK(norms[l].numel() == embeddings.size(1) && norms[l].scalar_type() == embeddings.scalar_type() &&
                    norms[l].is_contiguous(),
                "few_rows: llama_step's norm weights must be [dim] in the model's dtype");
  const StepOperands operands{embeddings, cos, sin, norms, weights, factors, tables, biases, k_caches, v_caches,
                              n_heads, n_kv_heads, eps};
  switch (embeddings.scalar_type()) {
    case at::kBFloat16: return llama_step_rows<c10::BFloat16>(tokens, positions, operands);
    case at::kFloat: return llama_step_rows<float>(tokens, positions, operands);
    default:
      TORCH_CHECK(false, "few_rows: llama_step dtype must be bfloat16 or float32, not ", embeddings.scalar_type());
  }
}

}  // namespace
