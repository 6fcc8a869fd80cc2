// Products with int4 weights: integer dot products against activations rounded to 8 bits.
#pragma once

namespace {

// int4 products take 8-bit activations, as llama.cpp's 4-bit formats do: a block of 32 codes times 32 rounded
// activations is then an exact integer dot product (vpdpbusd with AVX512_VNNI, else vpmaddubsw and vpmaddwd), one
// or two instructions per 32 multiplies where converting the codes to float took one per 8.
// Each input row is rounded per block b of 32 along k to q * d_b, d_b = max|x| / 127, q = round(x / d_b)
// (quantize.round_activations, the same formula for quantize.py's reference forward). With the weights
// w = code * scale + offset per group g: y = sum_b scale_g d_b dot_b + sum_g offset_g sum_(b in g) d_b sum(q_b).
struct RoundedRows {
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> d;           // [M, K / 32]
  std::vector<float> group_sums;  // [M, K / group]: sum over the group's blocks of d_b * sum(q_b)
};

RoundedRows round_rows(const float* x, int64_t M, int64_t K, int64_t shift) {
  const int64_t blocks = K / 32, per_group = (int64_t(1) << shift) / 32;
  RoundedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * (K >> shift))};
  for (int64_t b = 0; b < M * blocks; b++) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      const float q = d > 0 ? std::nearbyint(xb[j] / d) : 0.f;  // ties to even, as torch.round
      const int8_t code = std::isfinite(q) ? int8_t(q) : 0;
      r.q[b * 32 + j] = code;
      sum += code;
    }
    r.d[b] = d;
    float& group_sum = r.group_sums[b / per_group];  // blocks of a group in order
    group_sum = std::fma(d, float(sum), group_sum);
  }
  return r;
}

// Int4Linear's runtime layout, as cpu.modules.int4_layout defines and writes it: codes [N, K / 2], each 64 of a row
// in 32 bytes that one mask and one shift unpack into two blocks of 32 in order; float32 (scale, offset) factors
// [N, K / group, 2]. `code` reads it back (tests/test_cpu.py round-trips every code through it).
struct Int4Weight {
  const uint8_t* codes;
  const float* factors;
  int64_t K, shift;  // in_features; log2 of the group length
  const uint8_t* row(int64_t n) const { return codes + n * (K / 2); }
  const float* groups(int64_t n) const { return factors + 2 * n * (K >> shift); }
  // Code i of a row, for the plain code.
  static int code(const uint8_t* row, int64_t K, int64_t i) {
    const int64_t chunk = i / 64 * 64, span = std::min<int64_t>(64, K - chunk), j = i - chunk;
    const uint8_t byte = row[chunk / 2 + j % (span / 2)];
    return j < span / 2 ? byte & 15 : byte >> 4;
  }
};

// Output (m, n) in plain code, tile_int4's scalar reference: lane l of a block adds the integer dot product of its
// codes 4l .. 4l + 3 times the block's scale (weight row n's group scale times input row m's block factor); the
// offsets run group by group in their own chain; the lanes' tree and the offsets' sum at the end.
inline float int4_output_reference(const Int4Weight& weight, const RoundedRows& a, int64_t m, int64_t n) {
  const int64_t K = weight.K, shift = weight.shift, G = K >> shift;
  const uint8_t* w = weight.row(n);
  const float* g = weight.groups(n);
  f32x8 lanes = {};
  float offset = 0.f;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t group = k >> shift;
    if (!(k & ((int64_t(1) << shift) - 1))) offset = std::fma(g[2 * group + 1], a.group_sums[m * G + group], offset);
    const float scale = g[2 * group] * a.d[m * (K / 32) + k / 32];
    for (int l = 0; l < 8; l++) {
      int dot = 0;
      for (int j = 4 * l; j < 4 * l + 4; j++) dot += Int4Weight::code(w, K, k + j) * a.q[m * K + k + j];
      lanes[l] = std::fma(float(dot), scale, lanes[l]);
    }
  }
  return sum8_reference(lanes) + offset;
}

// C weight rows n0.. times R rounded rows m0..: one 8-lane float sum per output over the blocks in order (lane l of
// a block: the integer dot product of its codes 4l .. 4l + 3), then a fixed tree, plus the offsets' sum, which runs
// group by group in its own scalar chain alongside the blocks (so that the chain overlaps them); every output the
// same arithmetic whatever R and C. Two blocks a step from one 32-byte load (a mask and a shift per 32 codes).
template <int R, int C>
__attribute__((noinline)) void tile_int4(const Int4Weight& weight, const RoundedRows& a, int64_t N, int64_t m0,
                                         int64_t n0, float* y) {
#if FR_AVX2 && FR_FMA
  const int64_t K = weight.K, shift = weight.shift, G = K >> shift;
  const uint8_t* w[C];
  const float* g[C];
  for (int c = 0; c < C; c++) w[c] = weight.row(n0 + c), g[c] = weight.groups(n0 + c);
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[R][C];
  float offsets[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), offsets[r][c] = 0.f;
  // At a group's first block, its term of every output's offset sum. std::fma, as in round_rows: left to the
  // compiler, a multiply-add was fused in one build and not in the other (AVX2 vs Zen 4's AVX-512 build: outputs
  // 1 ulp apart).
  const auto add_offsets = [&](int64_t k) {
    if (k & ((int64_t(1) << shift) - 1)) return;
    const int64_t group = k >> shift;
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++)
        offsets[r][c] = std::fma(g[c][2 * group + 1], a.group_sums[(m0 + r) * G + group], offsets[r][c]);
  };
  // Block k (32 codes in order) of weight row c times each row's block, into the rows' sums.
  const auto add_block = [&](const __m256i* codes, int64_t k) {
    const int64_t b = k >> 5, group = k >> shift;
    add_offsets(k);
    for (int r = 0; r < R; r++) {
      const __m256i xq = _mm256_loadu_si256((const __m256i*)(a.q.data() + (m0 + r) * K + k));
      const float d = a.d[(m0 + r) * (K / 32) + b];
      for (int c = 0; c < C; c++) {
#if FR_AVX512VNNI && FR_AVX512VL
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes[c], xq);
#else
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[c], xq), _mm256_set1_epi16(1));
#endif
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(g[c][2 * group] * d), acc[r][c]);
      }
    }
  };
#if FR_ZNVER1
  // One row on a Zen 1 class core (256-bit AVX2 run as two 128-bit halves; -march=native defines __znver1__)
  // in 128-bit halves: the same lanes, sums and tree, so the same bits, without the 256-bit broadcast of each
  // block's scale that costs two operations there (at 2 rows the halves were slower).
  if constexpr (R == 1) {
    const __m128i ones = _mm_set1_epi16(1), low4 = _mm_set1_epi8(15);
    __m128 lo_acc[C], hi_acc[C];  // lanes 0-3 and 4-7 of acc[0][c]
    for (int c = 0; c < C; c++) lo_acc[c] = hi_acc[c] = _mm_setzero_ps();
    const int8_t* q = a.q.data() + m0 * K;
    const float* d = a.d.data() + m0 * (K / 32);
    const auto add_halves = [&](const __m128i* lo, const __m128i* hi, int64_t k) {  // codes 0-15, 16-31
      add_offsets(k);
      const __m128i xlo = _mm_loadu_si128((const __m128i*)(q + k));
      const __m128i xhi = _mm_loadu_si128((const __m128i*)(q + k + 16));
      for (int c = 0; c < C; c++) {
        const __m128 scale = _mm_set1_ps(g[c][2 * (k >> shift)] * d[k >> 5]);
        const __m128i dot_lo = _mm_madd_epi16(_mm_maddubs_epi16(lo[c], xlo), ones);
        const __m128i dot_hi = _mm_madd_epi16(_mm_maddubs_epi16(hi[c], xhi), ones);
        lo_acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_lo), scale, lo_acc[c]);
        hi_acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_hi), scale, hi_acc[c]);
      }
    };
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m128i lo[C], hi[C], lo2[C], hi2[C];
      for (int c = 0; c < C; c++) {
        const __m128i p0 = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        const __m128i p1 = _mm_loadu_si128((const __m128i*)(w[c] + k / 2 + 16));
        lo[c] = _mm_and_si128(p0, low4), hi[c] = _mm_and_si128(p1, low4);
        lo2[c] = _mm_and_si128(_mm_srli_epi16(p0, 4), low4), hi2[c] = _mm_and_si128(_mm_srli_epi16(p1, 4), low4);
        __builtin_prefetch(w[c] + k / 2 + PREFETCH_BYTES);
      }
      add_halves(lo, hi, k);
      add_halves(lo2, hi2, k + 32);
    }
    if (k < K) {
      __m128i lo[C], hi[C];
      for (int c = 0; c < C; c++) {
        const __m128i p = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        lo[c] = _mm_and_si128(p, low4), hi[c] = _mm_and_si128(_mm_srli_epi16(p, 4), low4);
      }
      add_halves(lo, hi, k);
    }
    for (int c = 0; c < C; c++) acc[0][c] = _mm256_set_m128(hi_acc[c], lo_acc[c]);
  } else
#endif
  {
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m256i first[C], second[C];
      for (int c = 0; c < C; c++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(w[c] + k / 2));
        first[c] = _mm256_and_si256(packed, low);
        second[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        __builtin_prefetch(w[c] + k / 2 + PREFETCH_BYTES);
      }
      add_block(first, k);
      add_block(second, k + 32);
    }
    if (k < K) {  // a lone last block
      __m256i codes[C];
      for (int c = 0; c < C; c++) {
        const __m128i packed = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        codes[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
      }
      add_block(codes, k);
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) y[(m0 + r) * N + n0 + c] = sum8((f32x8)acc[r][c]) + offsets[r][c];
#else
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) y[(m0 + r) * N + n0 + c] = int4_output_reference(weight, a, m0 + r, n0 + c);
#endif
}

template <int C>
void rows_int4(const Int4Weight& weight, const RoundedRows& a, int64_t M, int64_t N, int64_t n0, float* y) {
  for (int64_t m = 0; m < M; m += 4) {
    switch (M - m < 4 ? M - m : 4) {
      case 1: tile_int4<1, C>(weight, a, N, m, n0, y); break;
      case 2: tile_int4<2, C>(weight, a, N, m, n0, y); break;
      case 3: tile_int4<3, C>(weight, a, N, m, n0, y); break;
      default: tile_int4<4, C>(weight, a, N, m, n0, y); break;
    }
  }
}

// The codes [N, K] as Int4Weight reads them from the layout, for the test that round-trips cpu.modules.int4_layout.
at::Tensor int4_codes(const at::Tensor& nibbles) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() && nibbles.dim() == 2,
              "few_rows: int4 codes are uint8 [N, K / 2]");
  const int64_t N = nibbles.size(0), K = 2 * nibbles.size(1);
  at::Tensor codes = at::empty({N, K}, nibbles.options());
  for (int64_t n = 0; n < N; n++)
    for (int64_t i = 0; i < K; i++)
      codes.data_ptr<uint8_t>()[n * K + i] = Int4Weight::code(nibbles.data_ptr<uint8_t>() + n * (K / 2), K, i);
  return codes;
}

at::Tensor int4(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& groups) {
  const int64_t N = w.size(0), K = 2 * w.size(1);
  check_rows(x, K);
  TORCH_CHECK(groups && groups->scalar_type() == at::kFloat && groups->is_contiguous() && groups->dim() == 3 &&
                  groups->size(0) == N && groups->size(2) == 2,
              "few_rows: int4 codes need float32 [N, K / group, 2] (scale, offset) factors");
  const int64_t shift = block_shift(K, groups->size(1), "int4 groups");
  TORCH_CHECK(shift >= 5, "few_rows: int4 groups must hold at least 32 elements");
  const int64_t M = x.size(0);
  const RoundedRows a = round_rows(x.data_ptr<float>(), M, K, shift);
  at::Tensor y = at::empty({M, N}, x.options());
  const Int4Weight weight{w.data_ptr<uint8_t>(), groups->data_ptr<float>(), K, shift};
  float* yp = y.data_ptr<float>();
  const int64_t pairs = N / 2;
  at::parallel_for(0, pairs + N % 2, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      if (t < pairs) rows_int4<2>(weight, a, M, N, 2 * t, yp);
      else rows_int4<1>(weight, a, M, N, N - 1, yp);
    }
  });
  return y;
}

}  // namespace
