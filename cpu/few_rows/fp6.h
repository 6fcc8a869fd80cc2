// Products with MX 6-bit weights as the file packs them (Fp6Table).
#pragma once

namespace {

// MX 6-bit elements (E2M3, E3M2) read as the file packs them: 4 codes in 3 bytes, little-endian (code j of 8 at
// bits 6j of 6 bytes), with one E8M0 scale byte per block of 32. A block's 32 codes become bf16 values through a
// 64-entry table (exact: 2 or 3 mantissa bits) and multiply the inputs rounded to bf16 in pairs, as bf16 weights
// do in column tiles, into 16 lane sums of their own; the block's scale (a power of two) then multiplies them into the
// row's 16 lanes (a fused multiply-add), block after block: 6.25 bits read per weight, where the codes expanded to
// int8 at load read 8 and a factor per 32. With AVX512_VBMI and AVX512_BF16 (a byte permute and a bit-field select
// unpack 64 codes, a 64-word permute looks them up); elsewhere plain code with the same sums, slow: there
// layout() expands the codes to bf16 at load instead (kFastFp6).
#if FR_AVX512VBMI && FR_AVX512BF16
constexpr bool kFastFp6 = true;
#else
constexpr bool kFastFp6 = false;
#endif

struct Fp6Table {
  const uint8_t* codes;   // [N, K * 3 / 4]
  const uint8_t* scales;  // [N, K / 32], E8M0
  const uint16_t* table;  // [64] bf16 values of the codes
  const float* scale_values = e8m0_values();

  static const float* e8m0_values() {  // 2^(e - 127); 255: NaN
    static const std::vector<float> values = [] {
      std::vector<float> v(256);
      for (int e = 0; e < 255; e++) v[e] = std::ldexp(1.f, e - 127);
      v[255] = NAN;
      return v;
    }();
    return values.data();
  }
};

// The codes of 1 or 2 blocks (24 packed bytes each) at p as bf16 values, in order: unpack_fp6's scalar reference.
inline void unpack_fp6_reference(const uint8_t* p, int blocks, const uint16_t* table, uint16_t* values) {
  for (int j = 0; j < 32 * blocks; j += 4) {
    const uint32_t word = p[j / 4 * 3] | p[j / 4 * 3 + 1] << 8 | p[j / 4 * 3 + 2] << 16;
    for (int i = 0; i < 4; i++) values[j + i] = table[(word >> (6 * i)) & 63];
  }
}

#if FR_AVX512VBMI && FR_AVX512BF16
// 32 or 64 codes from 24 or 48 packed bytes at p (bytes past them are not read) as bf16 values, 32 to a vector.
inline void unpack_fp6(const uint8_t* p, __mmask64 bytes, __m512i table_low, __m512i table_high, __m512i& w0, __m512i& w1) {
  // Bytes 6q .. 6q + 5 to qword q, then byte j of each qword from its bits 6j .. 6j + 7: code j, with two bits of
  // the next above it, which the 64-word permute ignores (it reads 6 bits of each index).
  const __m512i spread = _mm512_set_epi8(
      0, 0, 47, 46, 45, 44, 43, 42, 0, 0, 41, 40, 39, 38, 37, 36, 0, 0, 35, 34, 33, 32, 31, 30, 0, 0, 29, 28, 27, 26,
      25, 24, 0, 0, 23, 22, 21, 20, 19, 18, 0, 0, 17, 16, 15, 14, 13, 12, 0, 0, 11, 10, 9, 8, 7, 6, 0, 0, 5, 4, 3, 2,
      1, 0);
  const __m512i fields = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x2a241e18120c0600LL),
                                                      _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(bytes, p)));
  w0 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(fields)), table_high);
  w1 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(fields, 1)), table_high);
}
#endif

// The 16 lane sums of one block's products, values [32] (bf16) times x (pair_inputs): lane i adds the products of
// elements 2i + 1, then 2i, as vdpbf16ps does.
inline f32x16 block_pairs_reference(const uint16_t* values, const float* x) {
  f32x16 high, low;
  pair_halves_reference(values, high, low);
  f32x16 t = load(x) * high;
  t += load(x + L) * low;  // exact products: fused into a multiply-add or not, one rounding
  return t;
}

inline f32x16 block_pairs(const uint16_t* values, const PairInput* x) {
#if FR_AVX512BF16
  f32x16 t;
  t.part[0] = (native)_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(values),
                                       (__m512bh)_mm512_loadu_si512(x));
  return t;
#else
  return block_pairs_reference(values, x);
#endif
}

template <int R>
__attribute__((noinline)) void tile(const Fp6Table& weight, const PairInput* x, int64_t K, int64_t N, int64_t n0,
                                    int64_t n1, float* y) {
#if FR_AVX512VBMI && FR_AVX512BF16
  const __m512i table_low = _mm512_loadu_si512(weight.table), table_high = _mm512_loadu_si512(weight.table + 32);
#endif
  for (int64_t n = n0; n < n1; n++) {
    f32x16 acc[R];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < L / W; h++) acc[r].part[h] = native{};
    const uint8_t* row = weight.codes + n * (K / 4 * 3);
    const uint8_t* scales = weight.scales + n * (K / 32);
    // Each block's lane sums times its scale, a power of two: exact, so fused into a multiply-add or not, the sum
    // is rounded once. Two blocks a step; a last odd one alone.
#if FR_AVX512VBMI && FR_AVX512BF16
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const uint8_t* p = row + k / 4 * 3;
      __builtin_prefetch(p + PREFETCH_BYTES);
      __m512i w0, w1;
      unpack_fp6(p, 0xffffffffffffULL, table_low, table_high, w0, w1);
      const __m512 s0 = _mm512_set1_ps(weight.scale_values[scales[k / 32]]);
      const __m512 s1 = _mm512_set1_ps(weight.scale_values[scales[k / 32 + 1]]);
      for (int r = 0; r < R; r++) {
        const PairInput* xr = x + r * K + k;
        __m512 a = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xr)),
                                   s0, (__m512)acc[r].part[0]);
        a = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xr + 32)),
                            s1, a);
        acc[r].part[0] = (native)a;
      }
    }
    if (k < K) {
      __m512i w0, w1;
      unpack_fp6(row + k / 4 * 3, 0xffffffULL, table_low, table_high, w0, w1);
      const __m512 s0 = _mm512_set1_ps(weight.scale_values[scales[k / 32]]);
      for (int r = 0; r < R; r++)
        acc[r].part[0] = (native)_mm512_fmadd_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + r * K + k)), s0,
            (__m512)acc[r].part[0]);
    }
#else
    for (int64_t k = 0; k < K; k += 64) {
      const uint8_t* p = row + k / 4 * 3;
      const int blocks = K - k >= 64 ? 2 : 1;
      uint16_t values[64];
      unpack_fp6_reference(p, blocks, weight.table, values);
      for (int b = 0; b < blocks; b++) {
        const float s = weight.scale_values[scales[k / 32 + b]];
        for (int r = 0; r < R; r++) {
          const f32x16 t = block_pairs(values + 32 * b, x + r * K + k + 32 * b);
          for (int h = 0; h < L / W; h++) acc[r].part[h] = t.part[h] * s + acc[r].part[h];
        }
      }
    }
#endif
    for (int r = 0; r < R; r++) y[r * N + n] = sum_lanes(acc[r]);
  }
}

at::Tensor fp6(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& table) {
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  check_rows(x, K);
  TORCH_CHECK(K % 32 == 0 && w.size(1) * 4 == K * 3, "few_rows: 6-bit codes of ", K, " inputs take ", K / 4 * 3,
              " bytes per row (and inputs a multiple of 32), not ", w.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / 32,
              "few_rows: 6-bit codes need uint8 E8M0 scales [N, K / 32]");
  TORCH_CHECK(table.scalar_type() == at::kBFloat16 && table.is_contiguous() && table.numel() == 64,
              "few_rows: 6-bit codes need their 64 values as bfloat16");
  const Fp6Table weight{w.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(table.data_ptr())};
  const at::Tensor inputs = pair_inputs(x.data_ptr<float>(), M, K);
  return product(weight, reinterpret_cast<const PairInput*>(inputs.data_ptr()), M, K, N);
}

}  // namespace
