// Few-row products on CPU: y[m, n] = sum_k x[m, k] * w[n, k] for the rows of a decode, draft or verify step
// (1 to 33 tokens a row, any number of rows), with w stored as bf16 or fp32 (times per-channel or per-block factors),
// as integer codes in column tiles (int4 against activations rounded to 8 bits; int8 and the MX elements that are
// integer multiples against 16 bits) or as packed MX 6-bit codes (a table of their values, times an E8M0 scale per
// block of 32); those rows' attention over the KV cache; and a whole step of a Llama-family model, every layer and
// the LM head, in one call (llama_step). Built at first use by the CPU backend (cpu/kernels.py), as one translation
// unit of the headers in few_rows/:
//
//   lanes.h      16 floats as native vectors, conversions, the horizontal sum, exp, bf16 rounding
//   tiles.h      the product skeleton: passes of input rows over tiles of weight rows, on every core
//   dense.h      fp32 and bf16 weights (bf16 in pairs)         columns.h  integer codes in column tiles
//   fp6.h        MX 6-bit codes as packed, bf16 values         linear.h   every format behind one call
//   attention.h  a step's rows over the KV cache               step.h     a Llama-family step in one call
//
// Why by hand: a step is bound by reading the weights, and every row must get the same arithmetic whatever the
// number of rows (a verify then computes the logits a decode would). Float weights: each tile converts one weight row
// to float once, in registers, and multiplies it into every input row; a row's sum runs in 16 lanes over k in order
// (bf16: a pair of elements a lane at a time, see Pairs), then in a fixed tree (sum_lanes). Integer codes: exact
// integer sums per block of 32, 16 output columns in the lanes of a vector (columns.h). GCC/Clang vector extensions,
// compiled with -march=native; the conversions, the pairs and the integer dot products use AVX-512 (BF16, VNNI, VBMI)
// or AVX2 intrinsics where present. Each routine with intrinsics has a scalar reference beside it
// (<routine>_reference: the same lanes, sums and trees in plain C++), which runs elsewhere and in the build with
// -DFEW_ROWS_PORTABLE that the tests compare with the build for this CPU bit for bit.
// What the design choices measured: docs/performance.md, "few_rows.cpp's design".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "few_rows/lanes.h"
#include "few_rows/tiles.h"
#include "few_rows/dense.h"
#include "few_rows/columns.h"
#include "few_rows/fp6.h"
#include "few_rows/linear.h"
#include "few_rows/attention.h"
#include "few_rows/step.h"


TORCH_LIBRARY(few_rows, m) {
  // No defaults: Inductor's C++ wrapper leaves out trailing arguments that equal their defaults, and the dispatcher
  // call it makes then reads past the ones it was given (torch 2.13: a segfault in the first step).
  m.def("product(Tensor x, Tensor weight, Tensor? factors, Tensor? table) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor positions) -> Tensor");
  m.def("llama_step(Tensor tokens, Tensor positions, Tensor embeddings, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] weights, Tensor?[] factors, Tensor?[] tables, Tensor?[] biases, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int n_heads, int n_kv_heads, float eps, int mlp_call, Tensor(c!)? mlp_rows, "
        "Tensor(d!)? mlp_gate_up, Tensor(e!)? mlp_out, Tensor(f!)? mlp_hidden) -> Tensor");
  m.def("attention_block(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor qkv, Tensor? qkv_factors, "
        "Tensor? qkv_table, Tensor? qkv_bias, Tensor wo, Tensor? wo_factors, Tensor? wo_table, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int n_heads, int n_kv_heads, Tensor? norm, float eps) -> Tensor");
  m.def("attention_queries(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor qkv, Tensor? qkv_factors, "
        "Tensor? qkv_table, Tensor? qkv_bias, Tensor(a!) k_cache, Tensor(b!) v_cache, int n_heads, int n_kv_heads, "
        "Tensor? norm, float eps) -> Tensor");
  m.def("attention_output(Tensor x, Tensor y, Tensor wo, Tensor? wo_factors, Tensor? wo_table, int n_heads, "
        "bool residual) -> Tensor");
  m.def("mlp_block(Tensor x, Tensor gate_up, Tensor? gate_up_factors, Tensor? gate_up_table, Tensor down, "
        "Tensor? down_factors, Tensor? down_table, Tensor? norm, float eps) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? factors, Tensor? table, Tensor? bias, int outputs) -> Tensor");
  m.def("packed_fp6_is_fast() -> bool", [] { return kFastFp6; });
  m.def("fp6_tiles_are_fast() -> bool", [] { return Fp6Codes::VECTOR; });
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("int4_codes(Tensor tiles) -> Tensor");
  m.def("stream_read(Tensor buffer) -> int");
}

TORCH_LIBRARY_IMPL(few_rows, CPU, m) {
  m.impl("product", &product_op);
  m.impl("attention", &attention);
  m.impl("llama_step", &llama_step);
  m.impl("attention_block", &attention_block_op);
  m.impl("attention_queries", &attention_queries_op);
  m.impl("attention_output", &attention_output_op);
  m.impl("mlp_block", &mlp_block_op);
  m.impl("linear", &linear_op);
  m.impl("rms_norm", &rms_norm);
  m.impl("int4_codes", &int4_codes);
  m.impl("stream_read", &stream_read);
}

