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

// Values of T held as float32 [R, N] -> a tensor of T (bf16: the floats' upper halves).
template <class T>
at::Tensor as_model_dtype(const at::Tensor& values) {
  if constexpr (std::is_same_v<T, float>) {
    return values;
  } else {
    at::Tensor out = at::empty(values.sizes(), values.options().dtype(at::kBFloat16));
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(values.data_ptr<float>());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < values.numel(); i++) op[i] = uint16_t(bits[i] >> 16);
    return out;
  }
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

// One product of a step: its weight (or tiles) with their factors, table and bias.
struct Product {
  const at::Tensor& weight;
  std::optional<at::Tensor> factors, table, bias;
};

// y [R, N] = x [R, K] times the product, plus its bias, each output rounded to T as the Linear modules round theirs.
template <class T>
at::Tensor step_product(const at::Tensor& x, const Product& p, int64_t outputs) {
  at::Tensor y = linear(x, p.weight, p.factors, p.table);
  TORCH_CHECK(y.size(1) == outputs, "few_rows: a step's product has ", y.size(1), " outputs, not ", outputs);
  float* yp = y.data_ptr<float>();
  const int64_t R = y.size(0), N = y.size(1);
  TORCH_CHECK(!p.bias || (p.bias->scalar_type() == at::kFloat && p.bias->numel() == N && p.bias->is_contiguous()),
              "few_rows: a step's biases must be float32 [outputs]");
  const float* b = p.bias ? p.bias->data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < R; r++) add_rounded<T>(yp + r * N, b, N, yp + r * N);
  return y;
}

// The rows' rotary angles: row r's cos and sin at cos + at(r) * half, at(r) its position in the whole tables
// (llama_step) or r in tables already gathered by position (model.py's forward gathers them: attention_block).
struct Rotary {
  const float* cos;
  const float* sin;
  int64_t half;
  const int64_t* by_position;  // nullptr: gathered
  int64_t at(int64_t r) const { return (by_position ? by_position[r] : r) * half; }
};

// model.Attention.forward up to attend, on the rows h [B * S, dim] (values of T, normed): q/k/v (one product,
// stacked), rotary, the cache writes; -> q [B, KV heads, G * S, D] in T, as model.py hands it to attend.
template <class T>
at::Tensor attention_queries(const at::Tensor& h, const at::Tensor& positions, const Rotary& rotary,
                             const Product& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n_heads,
                             int64_t n_kv_heads) {
  const int64_t B = positions.size(0), S = positions.size(1), R = B * S;
  const int64_t D = k_cache.size(3), slots = k_cache.size(2), G = n_heads / n_kv_heads, half = rotary.half;
  const int64_t Q = n_heads * D, KV = n_kv_heads * D;
  const int64_t* pos = positions.data_ptr<int64_t>();
  at::Tensor q = at::empty({B, n_kv_heads, G * S, D}, k_cache.options());
  T* qp = reinterpret_cast<T*>(q.data_ptr());
  const at::Tensor qkv_rows = step_product<T>(h, qkv, Q + 2 * KV);
  const float* qkv_p = qkv_rows.data_ptr<float>();
  T* kc = reinterpret_cast<T*>(k_cache.data_ptr());
  T* vc = reinterpret_cast<T*>(v_cache.data_ptr());
  for (int64_t r = 0; r < R; r++) {
    const int64_t b = r / S, t = r % S, p = pos[r];
    const float* row = qkv_p + r * (Q + 2 * KV);
    const float *c = rotary.cos + rotary.at(r), *sn = rotary.sin + rotary.at(r);
    for (int64_t head = 0; head < n_heads; head++)  // q [B, KV heads, G * S, D], row g * S + t of its KV head
      rotate(row + head * D, c, sn, half, D, qp + ((b * n_kv_heads + head / G) * G * S + (head % G) * S + t) * D);
    for (int64_t head = 0; head < n_kv_heads; head++) {
      const int64_t slot = ((b * n_kv_heads + head) * slots + p) * D;
      rotate(row + Q + head * D, c, sn, half, D, kc + slot);
      for (int64_t j = 0; j < D; j++) vc[slot + j] = T(row[Q + KV + head * D + j]);
    }
  }
  return q;
}

// model.Attention.forward after attend: attend's output y [B, H, S, D] (in T) to rows [B * S, H * D], times wo;
// -> [B * S, dim], values of T.
template <class T>
at::Tensor attention_output(const at::Tensor& y, const Product& wo, int64_t dim) {
  const int64_t B = y.size(0), H = y.size(1), S = y.size(2), D = y.size(3), R = B * S, Q = H * D;
  at::Tensor a = at::empty({R, Q}, y.options().dtype(at::kFloat));
  float* ap = a.data_ptr<float>();
  const T* yp = reinterpret_cast<const T*>(y.data_ptr());
  for (int64_t r = 0; r < R; r++)
    for (int64_t head = 0; head < H; head++)
      for (int64_t j = 0; j < D; j++) ap[r * Q + head * D + j] = float(yp[(((r / S) * H + head) * S + r % S) * D + j]);
  return step_product<T>(a, wo, dim);
}

// model.Attention.forward on the rows h [B * S, dim] (values of T, normed): attention_queries, attention over the
// cache, attention_output; -> [B * S, dim], values of T.
template <class T>
at::Tensor attention_block(const at::Tensor& h, const at::Tensor& positions, const Rotary& rotary, const Product& qkv,
                           const Product& wo, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n_heads,
                           int64_t n_kv_heads) {
  const at::Tensor q = attention_queries<T>(h, positions, rotary, qkv, k_cache, v_cache, n_heads, n_kv_heads);
  const at::Tensor y = attention_rows<T>(q, k_cache, v_cache, positions);
  return attention_output<T>(y.view({positions.size(0), n_heads, positions.size(1), k_cache.size(3)}), wo, h.size(1));
}

// model.FeedForward.forward (gated) on the rows h [R, dim] (values of T, normed): gate/up (one product, stacked),
// SiLU(gate) times up, down; -> [R, dim], values of T.
template <class T>
at::Tensor mlp_block(const at::Tensor& h, const Product& gate_up, const Product& down) {
  const int64_t R = h.size(0), dim = h.size(1), I = outputs(gate_up.weight) / 2;
  const at::Tensor gu = step_product<T>(h, gate_up, 2 * I);
  at::Tensor m = at::empty({R, I}, h.options());
  const float* gp = gu.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  for (int64_t r = 0; r < R; r++) silu_times<T>(gp + r * 2 * I, gp + r * 2 * I + I, I, mp + r * I);
  return step_product<T>(m, down, dim);
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
  Product product(int64_t i) const { return {weights[i], factors.get(i), tables.get(i), biases.get(i)}; }
};

// out[i] = x[i] as another type, where it holds values of both (T and float32): element by element, without the
// dispatcher's copy and conversion ops (a few microseconds a call in a layer of a step).
template <class From, class To>
void convert(const From* x, int64_t n, To* out) {
  for (int64_t i = 0; i < n; i++) out[i] = To(x[i]);
}

// A fork's model.FeedForward.forward in the one-call step's place for it (cpu.one_call.ModelPyMlp): the step writes
// layer l's normed rows to rows[l] [B, S, dim] and their gate/up product (the stacked w1 and w3, as the fork's w1(x)
// and w3(x) return them) to gate_up[l] [B, S, 2 * I], both in the model's dtype (a layer apiece: what the fork keeps
// of them stays as it was), and calls `call(l)` (a Python function through ctypes), which returns 0 once it has
// written the MLP's output to `out` [B, S, dim], or 2 once it has written the input of its w2 to `hidden` [B, S, I]
// where the fork's forward returns that product as it is: the step computes it, a product less called from Python.
struct MlpCall {
  int (*call)(int64_t layer);
  const at::Tensor& rows;
  const at::Tensor& gate_up;
  const at::Tensor& out;
  const at::Tensor& hidden;
  template <class T>
  at::Tensor run(const at::Tensor& h, const Product& gate_up_product, const Product& down, int64_t layer) const {
    const int64_t n = h.numel(), gate_up_n = gate_up.numel() / gate_up.size(0);
    convert(h.data_ptr<float>(), n, reinterpret_cast<T*>(rows.data_ptr()) + layer * n);  // values of T: exact
    const at::Tensor gu = step_product<T>(h, gate_up_product, gate_up.size(-1));
    convert(gu.data_ptr<float>(), gate_up_n, reinterpret_cast<T*>(gate_up.data_ptr()) + layer * gate_up_n);
    const int done = call(layer);
    TORCH_CHECK(done == 0 || done == 2, "few_rows: the MLP's model.py code raised");
    if (done == 2) {
      at::Tensor x = at::empty({h.size(0), hidden.numel() / h.size(0)}, h.options());
      convert(reinterpret_cast<const T*>(hidden.data_ptr()), hidden.numel(), x.data_ptr<float>());
      return step_product<T>(x, down, h.size(1));
    }
    at::Tensor down_rows = at::empty(h.sizes(), h.options());
    convert(reinterpret_cast<const T*>(out.data_ptr()), n, down_rows.data_ptr<float>());
    return down_rows;
  }
};

template <class T>
at::Tensor llama_step_rows(const at::Tensor& tokens, const at::Tensor& positions, const StepOperands& s,
                           const MlpCall* mlp) {
  const at::Tensor& embeddings = s.embeddings;
  const int64_t B = tokens.size(0), S = tokens.size(1), R = B * S, dim = embeddings.size(1);
  const int64_t layers = s.k_caches.size();
  const int64_t* token = tokens.data_ptr<int64_t>();
  const Rotary rotary{s.cos.data_ptr<float>(), s.sin.data_ptr<float>(), s.cos.size(1), positions.data_ptr<int64_t>()};
  const T* table = reinterpret_cast<const T*>(embeddings.data_ptr());
  std::vector<float> x(R * dim);  // the residual stream, values of T
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < dim; i++) x[r * dim + i] = float(table[token[r] * dim + i]);
  at::Tensor h = at::empty({R, dim}, embeddings.options().dtype(at::kFloat));
  float* hp = h.data_ptr<float>();
  for (int64_t l = 0; l < layers; l++) {
    rms_norm_rows<T>(x.data(), s.norms[2 * l], s.eps, R, dim, hp);
    const at::Tensor o = attention_block<T>(h, positions, rotary, s.product(4 * l), s.product(4 * l + 1),
                                            s.k_caches[l], s.v_caches[l], s.n_heads, s.n_kv_heads);
    add_rounded<T>(x.data(), o.data_ptr<float>(), R * dim, x.data());
    rms_norm_rows<T>(x.data(), s.norms[2 * l + 1], s.eps, R, dim, hp);
    const at::Tensor down = mlp ? mlp->run<T>(h, s.product(4 * l + 2), s.product(4 * l + 3), l)
                                : mlp_block<T>(h, s.product(4 * l + 2), s.product(4 * l + 3));
    add_rounded<T>(x.data(), down.data_ptr<float>(), R * dim, x.data());
  }
  rms_norm_rows<T>(x.data(), s.norms[2 * layers], s.eps, R, dim, hp);
  const int64_t V = outputs(s.weights[4 * layers]);
  const at::Tensor logits = step_product<T>(h, s.product(4 * layers), V);
  return as_model_dtype<T>(logits).view({B, S, V});
}

at::Tensor llama_step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& embeddings,
                      const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
                      const c10::List<std::optional<at::Tensor>>& factors,
                      const c10::List<std::optional<at::Tensor>>& tables,
                      const c10::List<std::optional<at::Tensor>>& biases, at::TensorList k_caches,
                      at::TensorList v_caches, int64_t n_heads, int64_t n_kv_heads, double eps, int64_t mlp_call,
                      const std::optional<at::Tensor>& mlp_rows, const std::optional<at::Tensor>& mlp_gate_up,
                      const std::optional<at::Tensor>& mlp_out, const std::optional<at::Tensor>& mlp_hidden) {
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
  std::optional<MlpCall> mlp;
  if (mlp_call) {
    const auto shape = std::vector<int64_t>{B, tokens.size(1), embeddings.size(1)};
    const auto each = std::vector<int64_t>{layers, B, tokens.size(1), embeddings.size(1)};
    const auto each_gate_up = std::vector<int64_t>{layers, B, tokens.size(1), outputs(weights[2])};
    const auto hidden = std::vector<int64_t>{B, tokens.size(1), outputs(weights[2]) / 2};
    TORCH_CHECK(mlp_rows && mlp_gate_up && mlp_out && mlp_hidden && mlp_rows->sizes() == each &&
                    mlp_out->sizes() == shape && mlp_gate_up->sizes() == each_gate_up &&
                    mlp_hidden->sizes() == hidden && mlp_rows->is_contiguous() && mlp_gate_up->is_contiguous() &&
                    mlp_out->is_contiguous() && mlp_hidden->is_contiguous() &&
                    mlp_rows->scalar_type() == embeddings.scalar_type() &&
                    mlp_gate_up->scalar_type() == embeddings.scalar_type() &&
                    mlp_out->scalar_type() == embeddings.scalar_type() &&
                    mlp_hidden->scalar_type() == embeddings.scalar_type(),
                "few_rows: llama_step's MLP call takes contiguous rows and gate_up [layers, B, S, ...], out "
                "[B, S, dim] and hidden [B, S, intermediate] in the model's dtype");
    mlp.emplace(
        MlpCall{reinterpret_cast<int (*)(int64_t)>(mlp_call), *mlp_rows, *mlp_gate_up, *mlp_out, *mlp_hidden});
  }
  const MlpCall* around = mlp ? &*mlp : nullptr;
  switch (embeddings.scalar_type()) {
    case at::kBFloat16: return llama_step_rows<c10::BFloat16>(tokens, positions, operands, around);
    case at::kFloat: return llama_step_rows<float>(tokens, positions, operands, around);
    default:
      TORCH_CHECK(false, "few_rows: llama_step dtype must be bfloat16 or float32, not ", embeddings.scalar_type());
  }
}

// x [..., dim] as float32 rows [R, dim], RMS-normed by `norm` (model.RMSNorm) where one is given.
template <class T>
std::pair<at::Tensor, at::Tensor> rows_and_normed(const at::Tensor& x, const std::optional<at::Tensor>& norm,
                                                  double eps) {
  const at::Tensor xf = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  if (!norm) return {xf, xf};
  const int64_t R = xf.size(0), dim = xf.size(1);
  TORCH_CHECK(norm->numel() == dim && norm->scalar_type() == x.scalar_type() && norm->is_contiguous(),
              "few_rows: a block's norm weight must be [dim] in x's dtype");
  at::Tensor h = at::empty(xf.sizes(), xf.options());
  rms_norm_rows<T>(xf.data_ptr<float>(), *norm, eps, R, dim, h.data_ptr<float>());
  return {xf, h};
}

// y = part(h), h = x [R, dim] normed (x itself without a norm weight); with the norm, x + y (a residual branch of
// model.Block.forward: x + part(norm(x))); each result rounded to T. -> a tensor of T [R, dim].
template <class T, class Part>
at::Tensor residual_part(const at::Tensor& x, const std::optional<at::Tensor>& norm, double eps, Part part) {
  const std::pair<at::Tensor, at::Tensor> rows = rows_and_normed<T>(x, norm, eps);
  const at::Tensor& xf = rows.first;
  at::Tensor y = part(rows.second);
  if (norm) add_rounded<T>(xf.data_ptr<float>(), y.data_ptr<float>(), y.numel(), y.data_ptr<float>());
  return as_model_dtype<T>(y);
}

void check_attention(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n_heads, int64_t n_kv_heads) {
  TORCH_CHECK(x.dim() == 3 && positions.dim() == 2 && positions.size(0) == x.size(0) &&
                  positions.size(1) == x.size(1) && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "few_rows: attention takes x [B, S, dim] and contiguous int64 positions [B, S]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == x.size(0) && k_cache.size(1) == n_kv_heads &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == x.scalar_type() && v_cache.scalar_type() == x.scalar_type() &&
                  n_heads % n_kv_heads == 0,
              "few_rows: attention's caches must be contiguous [B, KV heads, slots, head dim] in x's dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == positions.numel() * cos.size(-1) &&
                  2 * cos.size(-1) <= k_cache.size(3),
              "few_rows: attention takes contiguous float32 cos and sin [B, S, 1, rotary_dim / 2]");
  for (int64_t i = 0; i < positions.numel(); i++)
    TORCH_CHECK(positions.data_ptr<int64_t>()[i] >= 0 && positions.data_ptr<int64_t>()[i] < k_cache.size(2),
                "few_rows: position ", positions.data_ptr<int64_t>()[i], " is outside the cache of ", k_cache.size(2));
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "few_rows: attention dtype must be bfloat16 or float32, not ", x.scalar_type());
}

// model.Attention.forward in one call (cpu.one_call.AttentionBlock), or with `norm` the whole attention branch of
// model.Block.forward, x + attention(RMSNorm(x)) (cpu.one_call.Halves), for a step where the rest runs model.py's
// code: x [B, S, dim], cos and sin [B, S, 1, half] float32 as model.py's forward gathers them, positions [B, S]; the
// products' operands as OneCallStep stacks them; -> [B, S, dim] in x's dtype, bit for bit the one-call step's.
at::Tensor attention_block_op(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& qkv, const std::optional<at::Tensor>& qkv_factors,
                              const std::optional<at::Tensor>& qkv_table, const std::optional<at::Tensor>& qkv_bias,
                              const at::Tensor& wo, const std::optional<at::Tensor>& wo_factors,
                              const std::optional<at::Tensor>& wo_table, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, int64_t n_heads, int64_t n_kv_heads,
                              const std::optional<at::Tensor>& norm, double eps) {
  check_attention(x, positions, cos, sin, k_cache, v_cache, n_heads, n_kv_heads);
  const Rotary rotary{cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(-1), nullptr};
  const Product q{qkv, qkv_factors, qkv_table, qkv_bias}, o{wo, wo_factors, wo_table, std::nullopt};
  if (x.scalar_type() == at::kBFloat16)
    return residual_part<c10::BFloat16>(x, norm, eps, [&](const at::Tensor& h) {
             return attention_block<c10::BFloat16>(h, positions, rotary, q, o, k_cache, v_cache, n_heads, n_kv_heads);
           }).view(x.sizes());
  return residual_part<float>(x, norm, eps, [&](const at::Tensor& h) {
           return attention_block<float>(h, positions, rotary, q, o, k_cache, v_cache, n_heads, n_kv_heads);
         }).view(x.sizes());
}

// model.Attention.forward up to attend (cpu.one_call.AttendAround), of RMSNorm(x) with `norm`: the q/k/v product,
// rotary, the cache writes; -> q [B, KV heads, G * S, D] in x's dtype, as model.py hands it to attend.
at::Tensor attention_queries_op(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& qkv,
                                const std::optional<at::Tensor>& qkv_factors,
                                const std::optional<at::Tensor>& qkv_table,
                                const std::optional<at::Tensor>& qkv_bias, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, int64_t n_heads, int64_t n_kv_heads,
                                const std::optional<at::Tensor>& norm, double eps) {
  check_attention(x, positions, cos, sin, k_cache, v_cache, n_heads, n_kv_heads);
  const Rotary rotary{cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(-1), nullptr};
  const Product q{qkv, qkv_factors, qkv_table, qkv_bias};
  if (x.scalar_type() == at::kBFloat16)
    return attention_queries<c10::BFloat16>(rows_and_normed<c10::BFloat16>(x, norm, eps).second, positions, rotary, q,
                                            k_cache, v_cache, n_heads, n_kv_heads);
  return attention_queries<float>(rows_and_normed<float>(x, norm, eps).second, positions, rotary, q, k_cache, v_cache,
                                  n_heads, n_kv_heads);
}

// model.Attention.forward after attend (cpu.one_call.AttendAround): attend's output y [B, KV heads, G * S, D] times wo;
// with `residual`, x + that (model.Block.forward's branch); -> [B, S, dim] in x's dtype.
at::Tensor attention_output_op(const at::Tensor& x, const at::Tensor& y, const at::Tensor& wo,
                               const std::optional<at::Tensor>& wo_factors, const std::optional<at::Tensor>& wo_table,
                               int64_t n_heads, bool residual) {
  TORCH_CHECK(x.dim() == 3 && y.dim() == 4 && y.size(0) == x.size(0) && y.size(2) * y.size(1) == n_heads * x.size(1) &&
                  y.scalar_type() == x.scalar_type() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "few_rows: attention_output takes x [B, S, dim] and attend's output [B, KV heads, G * S, D] in its dtype");
  const at::Tensor heads = y.contiguous().view({x.size(0), n_heads, x.size(1), y.size(3)});
  const Product o{wo, wo_factors, wo_table, std::nullopt};
  const at::Tensor rows = x.reshape({-1, x.size(2)}).to(at::kFloat).contiguous();
  at::Tensor out = x.scalar_type() == at::kBFloat16 ? attention_output<c10::BFloat16>(heads, o, x.size(2))
                                                    : attention_output<float>(heads, o, x.size(2));
  if (residual) {
    if (x.scalar_type() == at::kBFloat16)
      add_rounded<c10::BFloat16>(rows.data_ptr<float>(), out.data_ptr<float>(), out.numel(), out.data_ptr<float>());
    else
      add_rounded<float>(rows.data_ptr<float>(), out.data_ptr<float>(), out.numel(), out.data_ptr<float>());
  }
  return (x.scalar_type() == at::kBFloat16 ? as_model_dtype<c10::BFloat16>(out) : out).view(x.sizes());
}

// model.FeedForward.forward (gated) in one call (cpu.one_call.FeedForwardBlock), or with `norm` the MLP branch of
// model.Block.forward, x + MLP(RMSNorm(x)): x [B, S, dim], the gate/up and down products' operands as OneCallStep
// stacks them; -> [B, S, dim] in x's dtype.
at::Tensor mlp_block_op(const at::Tensor& x, const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_factors,
                        const std::optional<at::Tensor>& gate_up_table, const at::Tensor& down,
                        const std::optional<at::Tensor>& down_factors, const std::optional<at::Tensor>& down_table,
                        const std::optional<at::Tensor>& norm, double eps) {
  TORCH_CHECK(x.dim() == 3, "few_rows: mlp_block takes x [B, S, dim]");
  const Product gu{gate_up, gate_up_factors, gate_up_table, std::nullopt}, d{down, down_factors, down_table, std::nullopt};
  switch (x.scalar_type()) {
    case at::kBFloat16:
      return residual_part<c10::BFloat16>(x, norm, eps, [&](const at::Tensor& h) {
               return mlp_block<c10::BFloat16>(h, gu, d);
             }).view(x.sizes());
    case at::kFloat:
      return residual_part<float>(x, norm, eps, [&](const at::Tensor& h) { return mlp_block<float>(h, gu, d); })
          .view(x.sizes());
    default: TORCH_CHECK(false, "few_rows: mlp_block dtype must be bfloat16 or float32, not ", x.scalar_type());
  }
}

// A product as a Linear module's forward returns it (cpu.modules' products, one call from Python): x [..., K] in
// bf16 or float32; y [..., outputs] = x times the weight plus the bias, rounded to x's dtype.
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                     const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& bias, int64_t outputs) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "few_rows: linear takes bf16 or float32 x [..., K]");
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
  at::Tensor y = linear(rows, w, factors, table);
  TORCH_CHECK(y.size(1) >= outputs, "few_rows: linear's weight has ", y.size(1), " outputs, not ", outputs);
  if (y.size(1) != outputs) y = y.narrow(1, 0, outputs).contiguous();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == outputs && bias->is_contiguous()),
              "few_rows: linear's bias must be float32 [outputs]");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  if (x.scalar_type() == at::kFloat) {
    if (b)
      for (int64_t r = 0; r < y.size(0); r++) add_rounded<float>(yp + r * outputs, b, outputs, yp + r * outputs);
    return y.view(shape);
  }
  for (int64_t r = 0; r < y.size(0); r++) add_rounded<c10::BFloat16>(yp + r * outputs, b, outputs, yp + r * outputs);
  return as_model_dtype<c10::BFloat16>(y).view(shape);
}

}  // namespace
