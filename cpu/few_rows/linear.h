// Every weight format behind two calls: layout (at load: the file's tensors laid out for this CPU) and linear (the
// product, any number of rows).
#pragma once

namespace {

// quantize.py's Format.code: what a format is, as its record declares it (tests/test_cpu.py holds the two equal).
enum FormatCode : int64_t { PLAIN = 0, INT8 = 1, INT4 = 2, MX = 3, INT4K = 4 };

// How layout() laid a weight out for this CPU; linear() takes it back.
enum Layout : int64_t {
  DENSE = 0,       // bf16 or float32 [N, K], times per-row or per-block float factors, or none
  BF16_TILES = 1,  // bf16 column tiles [N / 16, K / 32, 512] (Bf16Codes)
  INT8_TILES = 2,  // int8 column tiles [N / 16, K / 32, 512], float factors [N / 16, 16] or [N / 16, K / 32, 16]
  INT4_TILES = 3,  // int4 column tiles [N / 16, K / 32, 256], bf16 factors [N / 16, K / g, 2, 16] (Int4Tiles)
  FP6_TILES = 4,   // MX 6-bit column tiles [N / 16, K / 32, 384], E8M0 factors [N / 16, K / 32, 16], int16 table [65]
  FP6_TABLE = 5,   // MX 6-bit codes as the file packs them [N, K * 3 / 4], E8M0 scales [N, K / 32], bf16 table [64]
  INT4K_TILES = 6,  // int4 column tiles as INT4_TILES, factors uint8 [N / 16, ceil(K / 256), 320] (Int4kFactors)
};

// How this build multiplies each layout, by Layout (what a backend report and --verbose say).
std::vector<std::string> paths() {
  const bool vnni = FR_AVX512VNNI && FR_AVX512BW, avx2 = FR_AVX2 && FR_FMA;
  const Amx amx = amx_state().mode;  // (amx.h) integer tiles of 2+ rows
  const std::string tiles = amx == Amx::HARDWARE ? "; 2+ rows on AMX tiles" : amx == Amx::EMULATED ? "; 2+ rows on "
                            "emulated AMX tiles" : "";
  return {FR_AVX512F ? "dense rows, 16-lane vectors (AVX512F)" : "dense rows, 8-lane vectors",
          FR_AVX512BF16 ? "bf16 tiles, vdpbf16ps (AVX512_BF16)" : avx2 ? "bf16 tiles, fused multiply-adds (AVX2)"
                                                               : "bf16 tiles, plain code",
          vnni ? "int8 tiles, vpdpwssd (AVX512_VNNI)" + tiles : avx2 ? "int8 tiles, vpmaddwd (AVX2)" : "int8 tiles, plain code",
          vnni ? "int4 tiles, vpdpbusd (AVX512_VNNI)" + tiles : avx2 ? "int4 tiles, vpmaddubsw (AVX2)" : "int4 tiles, plain code",
          Fp6Codes::VECTOR ? "6-bit tiles as packed, vpdpwssd (AVX512_VBMI, AVX512_VNNI)" + tiles : "6-bit tiles, plain code",
          kFastFp6 ? "6-bit codes through a bf16 table (AVX512_VBMI, AVX512_BF16)" : "6-bit codes, plain code",
          vnni ? "int4k tiles, vpdpbusd (AVX512_VNNI)" + tiles : avx2 ? "int4k tiles, vpmaddubsw (AVX2)" : "int4k tiles, plain code"};
}

// ---------------------------------------------------------------- layouts, made once at load

// Rows of zeros after t's own, up to whole tiles of 16 outputs.
at::Tensor whole_tiles(const at::Tensor& t) {
  const int64_t n = t.size(0), padded = (n + TILE - 1) / TILE * TILE;
  if (n == padded) return t;
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[0] = padded - n;
  return at::cat({t, at::zeros(shape, t.options())});
}

// Column tiles of 16-bit input pairs (Int8Codes, Bf16Codes) from weights [N, K] (int8 codes or bf16): tile T's block b
// holds 16 pairs of k, element 2c + j of pair p the weight of column 16 T + c at k = 32 b + 2 p + j. A few rows at a
// time, into one tensor: the layout of a 150k-row head is never held twice over.
at::Tensor pair_tiles(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + TILE - 1) / TILE;
  at::Tensor out = at::empty({tiles, K / BLOCK, 2 * TILE * TILE}, weight.options());
  for (int64_t n = 0; n < N; n += 1024) {
    const at::Tensor part = whole_tiles(weight.narrow(0, n, std::min<int64_t>(1024, N - n)));
    out.narrow(0, n / TILE, part.size(0) / TILE)
        .copy_(part.view({-1, TILE, K / BLOCK, TILE, 2}).permute({0, 2, 3, 1, 4}).reshape({-1, K / BLOCK, 2 * TILE * TILE}));
  }
  return out;
}

// Per-block factors [N, K / 32] (float32, or E8M0 bytes) as the tiles read them: [N / 16, K / 32, 16].
at::Tensor block_tiles(const at::Tensor& factors) {
  return whole_tiles(factors).view({-1, TILE, factors.size(1)}).transpose(1, 2).contiguous();
}

// Codes packed as mx.pack packs them ([N, K * bits / 8]: 8 bits as they are; 4: element 2i in the low nibble; 6: 4 in
// 3 bytes, little-endian) -> [N, K], one a byte.
at::Tensor unpack(const at::Tensor& packed, int64_t bits) {
  if (bits == 8) return packed;
  const int64_t N = packed.size(0), K = packed.size(1) * 8 / bits;
  at::Tensor codes = at::empty({N, K}, packed.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t k = 0; k < K; k++) {
        const uint8_t* row = p + n * (K * bits / 8);
        if (bits == 4) {
          c[n * K + k] = k % 2 ? row[k / 2] >> 4 : row[k / 2] & 15;
        } else {
          const uint8_t* q = row + k / 4 * 3;
          c[n * K + k] = ((q[0] | q[1] << 8 | q[2] << 16) >> (6 * (k % 4))) & 63;
        }
      }
  });
  return codes;
}

// Int4Tiles' codes from the file's [N, K / 2] (two a byte): tile T's block b holds 4 quarters of 64 bytes, byte 4c + j
// of quarter t the codes of column 16T + c at k = 32b + 8t + j (low nibble) and 32b + 8t + 4 + j (high nibble).
at::Tensor int4_code_tiles(const at::Tensor& packed) {
  const at::Tensor codes = unpack(packed, 4);
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N % TILE == 0, "few_rows: int4 needs out_features a multiple of 16, not ", N);
  const at::Tensor quads = codes.view({N / TILE, TILE, K / BLOCK, 4, 2, 4}).permute({0, 2, 3, 1, 5, 4});
  return (quads.select(-1, 0) | quads.select(-1, 1).__lshift__(4)).reshape({N / TILE, K / BLOCK, 256}).contiguous();
}

// int4's bf16 (scale, zero) [K / g, N, 2] as GroupFactors reads them: [N / 16, K / g, 2, 16], per tile and group the
// 16 columns' scales, then their zeros.
at::Tensor int4_factor_tiles(const at::Tensor& scales_and_zeros) {
  const int64_t N = scales_and_zeros.size(1);
  return scales_and_zeros.view({-1, N / TILE, TILE, 2}).permute({1, 0, 3, 2}).contiguous();
}

// int4k's factors [N, S, 20] (per row and 256 inputs: d, dmin as bf16 bytes, 8 scale codes, 8 minimum codes) as
// Int4kFactors reads them: [N / 16, S, 320], per tile and super-block the 16 columns' d, their dmin, then per block
// the 16 scale codes and the 16 minimum codes.
at::Tensor int4k_factor_tiles(const at::Tensor& factors) {
  const int64_t N = factors.size(0), S = factors.size(1);
  const at::Tensor t = factors.contiguous().view({N / TILE, TILE, S, 20}).permute({0, 2, 1, 3});  // [T, S, 16, 20]
  const at::Tensor pairs = t.narrow(3, 0, 4).reshape({N / TILE, S, TILE, 2, 2}).permute({0, 1, 3, 2, 4});
  const at::Tensor codes = t.narrow(3, 4, 16).reshape({N / TILE, S, TILE, 2, 8}).permute({0, 1, 4, 3, 2});
  return at::cat({pairs.reshape({N / TILE, S, 64}), codes.reshape({N / TILE, S, 256})}, 2).contiguous();
}

// Fp6Codes' tiles from codes [N, K] (0..63): tile T's block b holds 8 quads of 48 bytes, each 64 codes packed as the
// file packs them, code 32h + 2c + j of quad t being column 16T + c's at k = 32b + 4t + 2h + j.
at::Tensor fp6_tiles(const at::Tensor& codes) {
  const int64_t N = codes.size(0), blocks = codes.size(1) / BLOCK, tiles = (N + TILE - 1) / TILE;
  at::Tensor out = at::empty({tiles, blocks, 384}, codes.options());
  for (int64_t n = 0; n < N; n += 1024) {
    const at::Tensor part = whole_tiles(codes.narrow(0, n, std::min<int64_t>(1024, N - n)));
    const at::Tensor quads = part.view({-1, TILE, blocks, 8, 2, 2}).permute({0, 2, 3, 4, 1, 5}).reshape({-1, 4})
                                 .to(at::kInt);
    const at::Tensor word = quads.select(1, 0) | quads.select(1, 1).__lshift__(6) |
                            quads.select(1, 2).__lshift__(12) | quads.select(1, 3).__lshift__(18);
    out.narrow(0, n / TILE, part.size(0) / TILE)
        .copy_(at::stack({word & 255, word.__rshift__(8) & 255, word.__rshift__(16) & 255}, 1).view({-1, blocks, 384}));
  }
  return out;
}

// table[codes] for codes [N, K] (uint8), a few rows at a time (int64 indices of a whole head would take GBs).
at::Tensor lookup(const at::Tensor& table, const at::Tensor& codes) {
  at::Tensor out = at::empty(codes.sizes(), table.options());
  for (int64_t n = 0; n < codes.size(0); n += 1024) {
    const int64_t rows = std::min<int64_t>(1024, codes.size(0) - n);
    out.narrow(0, n, rows).copy_(table.index({codes.narrow(0, n, rows).to(at::kLong)}));
  }
  return out;
}

// 2^(e - 127) of E8M0 codes as float32; 255: NaN.
at::Tensor scale_values(const at::Tensor& e8m0) {
  const at::Tensor e = e8m0.to(at::kInt);
  return at::ldexp(at::ones(e.sizes(), at::kFloat), e - 127).masked_fill(e == 255, NAN);
}

// The file's tensors (quantize.py's modules: weight, and factors = scales / scales_and_zeros / none) in the layout this
// CPU multiplies fastest, or in `wanted` (-1: this CPU's choice; the tests ask for each one a format has). MX: `values`
// are the values of the element codes (float32 [2^bits], mx.py's), `multiple` the power of two that makes them integers
// of at most 127 (0: none). -> (layout, weight, factors, table).
std::tuple<int64_t, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> layout(
    int64_t format, const at::Tensor& weight, const std::optional<at::Tensor>& factors,
    const std::optional<at::Tensor>& values, int64_t bits, int64_t multiple, int64_t wanted) {
  const at::NoGradGuard no_grad;
  const at::Tensor w = weight.contiguous();
  const auto choose = [&](int64_t best) { return wanted < 0 ? best : wanted; };
  switch (format) {
    case PLAIN:
      TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
                  "few_rows: plain weights are bf16 or float32, not ", w.scalar_type());
      TORCH_CHECK(w.size(1) % L == 0, "few_rows: in_features ", w.size(1), " is not a multiple of ", L);
      if (choose(w.scalar_type() == at::kBFloat16 && w.size(1) % BLOCK == 0 ? BF16_TILES : DENSE) == BF16_TILES) {
        TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) % BLOCK == 0, "few_rows: bf16 tiles take bf16 "
                    "weights, in_features a multiple of 32");
        return {BF16_TILES, pair_tiles(w), {}, {}};
      }
      return {DENSE, w, {}, {}};
    case INT8:
      return {INT8_TILES, pair_tiles(w), whole_tiles(factors->to(at::kFloat)).view({-1, TILE}), {}};
    case INT4:  // (the file's bf16 scales and zeros, which a model cast to float32 holds exactly)
      return {INT4_TILES, int4_code_tiles(w), int4_factor_tiles(factors->to(at::kBFloat16)), {}};
    case INT4K:
      TORCH_CHECK(factors->scalar_type() == at::kByte && factors->dim() == 3 && factors->size(2) == 20,
                  "few_rows: int4k factors are uint8 [N, ceil(K / 256), 20]");
      return {INT4K_TILES, int4_code_tiles(w), int4k_factor_tiles(*factors), {}};
    case MX: {
      TORCH_CHECK(values && values->numel() == (int64_t(1) << bits), "few_rows: MX needs the values of its codes");
      const at::Tensor scales = factors->contiguous();
      const int64_t lay = choose(multiple && bits == 6 && Fp6Codes::VECTOR ? FP6_TILES
                                 : multiple                                 ? INT8_TILES
                                 : bits == 6 && kFastFp6                    ? FP6_TABLE
                                                                            : DENSE);
      // (elements that are integer multiples multiply inputs rounded to 16 bits, as their reference does: in tiles)
      TORCH_CHECK(multiple ? lay == INT8_TILES || (lay == FP6_TILES && bits == 6)
                           : lay == DENSE || (lay == FP6_TABLE && bits == 6),
                  "few_rows: no layout ", lay, " for these MX codes");
      if (lay == FP6_TILES) {  // as packed, looked up as integers
        const at::Tensor table = at::cat({(*values * multiple).round(),
                                          at::full({1}, double(__builtin_ctzll(multiple)), values->options())});
        return {FP6_TILES, fp6_tiles(unpack(w, 6)), block_tiles(scales), table.to(at::kShort)};
      }
      if (lay == FP6_TABLE) return {FP6_TABLE, w, scales, values->to(at::kBFloat16)};
      const at::Tensor codes = unpack(w, bits);
      if (lay == INT8_TILES)  // the codes' values times the multiple as int8, the block's scale over the multiple
        return {INT8_TILES, pair_tiles(lookup((*values * multiple).round().to(at::kChar), codes)),
                block_tiles(scale_values(scales) / multiple), {}};
      return {DENSE, lookup(values->to(at::kBFloat16), codes), scale_values(scales), {}};  // exact in bf16
    }
    default:
      TORCH_CHECK(false, "few_rows: unknown format code ", format);
  }
}

// ---------------------------------------------------------------- the product

// Tokens a row up to which a DENSE or BF16_TILES weight's product runs the few-row kernel (a step: decode, a draft's
// catch-up, a verify of at most backend.LONGEST_VERIFY, with room to spare); a prompt's rows take PyTorch's GEMM. Every
// other layout computes every row by the same kernel, however many.
constexpr int64_t STEP_TOKENS = 33;

// A prompt's rows [M, K] times bf16 tiles by PyTorch's GEMM (oneDNN's: AMX or AVX512_BF16 where the CPU has them; what
// it measured: docs/performance.md), the weight read back out of its tiles 512 columns at a time into a buffer. bf16 rows with AVX512_BF16: the product in bf16 with the bias, as F.linear computes it
// (-> [M, outputs] bf16); otherwise in float32 (-> [M, N] float32, the bias left to linear()).
at::Tensor bf16_prompt(const at::Tensor& rows, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       int64_t outputs) {
  constexpr int64_t CHUNK = 32;  // tiles a GEMM: 512 columns
  const int64_t tiles = w.size(0), blocks = w.size(1), K = blocks * BLOCK, M = rows.size(0);
  const bool in_bf16 = FR_AVX512BF16 && rows.scalar_type() == at::kBFloat16;
  const int64_t N = in_bf16 ? outputs : tiles * TILE;
  const at::Tensor x = in_bf16 ? rows : rows.to(at::kFloat);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor buffer = at::empty({CHUNK * TILE, K}, w.options());
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(w.data_ptr());  // a pair of k, one column
  uint32_t* columns = reinterpret_cast<uint32_t*>(buffer.data_ptr());
  for (int64_t t0 = 0; t0 < tiles; t0 += CHUNK) {
    const int64_t count = std::min(CHUNK, tiles - t0), n0 = t0 * TILE, n = std::min(count * TILE, N - n0);
    if (n <= 0) break;
    at::parallel_for(0, count * blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++) {  // tile t0 + i / blocks, block i % blocks: a 16 x 16 transpose of pairs
        const int64_t t = i / blocks, b = i % blocks;
        const uint32_t* from = pairs + ((t0 + t) * blocks + b) * TILE * TILE;
        for (int c = 0; c < TILE; c++)
          for (int p = 0; p < TILE; p++) columns[(t * TILE + c) * (K / 2) + b * TILE + p] = from[p * TILE + c];
      }
    });
    const at::Tensor weight = buffer.narrow(0, 0, n);
    const at::Tensor part = in_bf16 ? (bias ? at::addmm(bias->narrow(0, n0, n).to(at::kBFloat16), x, weight.t())
                                            : at::mm(x, weight.t()))
                                    : at::mm(x, weight.to(at::kFloat).t());
    y.narrow(1, n0, n).copy_(part);
  }
  return y;
}

// rows [M, K] (float32; the tiles take bf16 too) times a weight laid out by layout() -> [M, N] float32 (N: whole
// tiles). `prompt`: the rows hold more than STEP_TOKENS tokens a batch row.
at::Tensor product_rows(const at::Tensor& rows, int64_t lay, const at::Tensor& w, const std::optional<at::Tensor>& f,
                        const std::optional<at::Tensor>& table, bool prompt) {
  switch (lay) {
    case BF16_TILES: return prompt ? bf16_prompt(rows, w, {}, w.size(0) * TILE) : bf16_tiles(rows, w);
    case INT8_TILES: return wide_tiles(rows, w, *f, {});
    case INT4_TILES: return int4_tiles(rows, w, *f);
    case INT4K_TILES: return int4k_tiles(rows, w, *f);
    case FP6_TILES: return wide_tiles(rows, w, *f, table);
    case FP6_TABLE: {  // 16 rows a call: the rounded inputs of a prompt stay in cache
      if (rows.size(0) <= 16) return fp6(rows, w, *f, *table);
      std::vector<at::Tensor> parts;
      for (const at::Tensor& part : rows.split(16)) parts.push_back(fp6(part.contiguous(), w, *f, *table));
      return at::cat(parts);
    }
    case DENSE:
      check_rows(rows, w.size(1));
      if (prompt) {  // PyTorch's GEMM, the weight as the reference decodes it (in float32: fast on every CPU)
        at::Tensor weight = w.to(at::kFloat);
        if (f) weight = f->numel() == w.size(0) ? weight * f->unsqueeze(1) : weight * f->repeat_interleave(w.size(1) / f->size(1), 1);
        return at::linear(rows, weight);
      }
      if (w.scalar_type() == at::kFloat) return dense<float>(rows, w, f);
      return dense<uint16_t>(rows, w, f);
    default:
      TORCH_CHECK(false, "few_rows: unknown layout ", lay);
  }
}

// The product as a Linear's forward returns it: x [..., K] (bf16 or float32) times the weight in its layout, plus the
// bias (float32, or none), -> [..., outputs] in x's dtype, each output rounded once. Every row alike, whatever their
// number: a verify's rows are a decode's.
at::Tensor linear(const at::Tensor& x, int64_t lay, const at::Tensor& w, const std::optional<at::Tensor>& f,
                  const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& bias, int64_t outputs) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "few_rows: linear takes bf16 or float32 inputs, not ", x.scalar_type());
  // (tiles take a bf16 model's rows as they are; rows and 6-bit codes as packed float32)
  const bool as_they_are = lay != DENSE && lay != FP6_TABLE;
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(as_they_are ? x.scalar_type() : at::kFloat).contiguous();
  const bool prompt = x.dim() >= 2 && x.size(-2) > STEP_TOKENS;
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == outputs && bias->is_contiguous()),
              "few_rows: linear's bias must be float32 [outputs]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = outputs;
  if (prompt && lay == BF16_TILES && FR_AVX512BF16 && x.scalar_type() == at::kBFloat16)  // finished in bf16, bias and all
    return bf16_prompt(rows, w, bias, outputs).view(shape);
  const at::Tensor y = product_rows(rows, lay, w, f, table, prompt);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(outputs <= N, "few_rows: linear's weight has ", N, " outputs, not ", outputs);
  const float* yp = y.data_ptr<float>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    float* op = out.data_ptr<float>();
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < outputs; n++) op[m * outputs + n] = b ? yp[m * N + n] + b[n] : yp[m * N + n];
  } else {
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < outputs; n++) op[m * outputs + n] = round_to_bf16(b ? yp[m * N + n] + b[n] : yp[m * N + n]);
  }
  return out;
}

}  // namespace
