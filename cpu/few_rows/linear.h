// Every weight format's product behind one call.
#pragma once

namespace {

// x [M, K] @ w.T; w [N, K] (bf16, fp32, int8 times factors), uint8 [N, K / 2] (int4 codes, see Int4Weight), or
// with a table, uint8 [N, K * 3 / 4] (MX 6-bit codes, factors their E8M0 scales). bf16_inputs: x holds bf16 values
// (a bf16 model's), which int8 codes then multiply in pairs (kInt8Pairs).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                  const std::optional<at::Tensor>& table, bool bf16_inputs) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "few_rows: weight must be contiguous [N, K]");
  if (table) {
    TORCH_CHECK(w.scalar_type() == at::kByte && factors, "few_rows: a table goes with uint8 codes and their scales");
    return fp6(x, w, *factors, *table);
  }
  if (w.scalar_type() == at::kByte) return int4(x, w, factors);
  check_rows(x, w.size(1));
  switch (w.scalar_type()) {
    case at::kBFloat16: return pairs<uint16_t>(x, w, factors);
    case at::kFloat: return dense<float>(x, w, factors);
    case at::kChar: return bf16_inputs && kInt8Pairs ? pairs<int8_t>(x, w, factors) : dense<int8_t>(x, w, factors);
    default: TORCH_CHECK(false, "few_rows: weight dtype must be bfloat16, float32, int8 or uint8 (int4), not ", w.scalar_type());
  }
}

// The op: x float32, or bf16 (its values then bf16_inputs).
at::Tensor product_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                      const std::optional<at::Tensor>& table) {
  const bool bf16_inputs = x.scalar_type() == at::kBFloat16;
  return linear(bf16_inputs ? x.to(at::kFloat) : x, w, factors, table, bf16_inputs);
}

}  // namespace
