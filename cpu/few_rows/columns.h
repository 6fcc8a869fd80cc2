// Products in column tiles: integer weight codes times activations rounded to integers, as exact integer sums.
#pragma once

namespace {

// Each input row is rounded per block b of 32 along k to q * d_b, d_b = max|x| / L, q = round(x / d_b), ties to even
// (quantize.round_activations, the same formula for quantize.py's reference forward): L = 127 for int4 (8 bits, as
// llama.cpp's Q8_0), L = 32767 for int8 and the MX formats whose elements are integer multiples (16 bits, where 8 cost
// them +0.4-0.7% perplexity). A block of 32 weight codes times its 32 q is then one exact integer sum, whatever
// instructions add it up.
// Tiles: the weights laid out at load so that 16 consecutive output columns are the 16 lanes of a vector. Per block of
// 32 along k, lane c of a 32-bit word holds column c's codes for 4 (8-bit q) or 2 (16-bit q) consecutive k, and one
// instruction (vpdpbusd, vpdpwssd with AVX512_VNNI; vpmaddubsw or vpmaddwd on AVX2) multiplies them by those q of the
// row, broadcast: every column's sum in its own lane, no horizontal sum, the codes unpacked once for all the rows of
// a pass. The only floating-point steps are per block and per group, in k order, the same for every row and every
// number of rows, so a verify's row is a decode's bit for bit, and the scalar references give the same bits as the
// vector code. A tile is read once from memory for all the rows of a call, a prompt's too.

template <class Q>
constexpr int32_t LEVELS = sizeof(Q) == 1 ? 127 : 32767;

// The rounded rows, block-major: a pass of rows finds each block's q, d and group sums side by side (one pointer
// for all of them, each row at a constant offset). Q: int8_t or int16_t.
template <class Q>
struct Rounded {
  int64_t M;
  std::vector<Q> q;               // [K / 32, M, 32]
  std::vector<float> d;           // [K / 32, M]
  std::vector<float> group_sums;  // [K / group, M]: over the group's blocks in order, d_b * sum of q_b (fused)
  const Q* codes(int64_t b, int64_t m) const { return q.data() + (b * M + m) * BLOCK; }
  float scale(int64_t b, int64_t m) const { return d[b * M + m]; }
  float group_sum(int64_t g, int64_t m) const { return group_sums[g * M + m]; }
};
typedef Rounded<int8_t> RoundedRows;

// Block b of a row (32 floats at x) to its q, d and sum; the plain code.
template <class Q>
inline void round_block_reference(const float* x, Q* q, float& d, int32_t& sum) {
  float amax = 0.f;
  for (int j = 0; j < BLOCK; j++) amax = std::max(amax, std::fabs(x[j]));  // a NaN input is passed over
  d = amax / LEVELS<Q>;
  sum = 0;
  for (int j = 0; j < BLOCK; j++) {
    const float v = d > 0 ? std::nearbyint(x[j] / d) : 0.f;  // ties to even, as torch.round
    q[j] = std::isfinite(v) ? Q(int32_t(v)) : 0;
    sum += q[j];
  }
}

template <class Q>
inline void round_block(const float* x, Q* q, float& d, int32_t& sum) {
  constexpr int drop = 32 - 8 * sizeof(Q);  // Q(int32_t(v)): the low bits, sign-extended
#if FR_AVX512F && FR_AVX512BW
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  // max(|x|, amax): a NaN lane keeps amax, as std::max(amax, NaN) does; max is exact in any order
  const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
  d = _mm512_reduce_max_ps(m) / LEVELS<Q>;
  const __m512 dv = _mm512_set1_ps(d);
  const __mmask16 any = d > 0 ? 0xffff : 0;
  const auto codes = [&](__m512 v) {  // x / d correctly rounded (as the scalar division), then to even; not finite: 0
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(r, r), _mm512_setzero_ps(), _CMP_EQ_OQ);
    return _mm512_srai_epi32(_mm512_slli_epi32(_mm512_maskz_cvtps_epi32(finite & any, r), drop), drop);
  };
  const __m512i q0 = codes(x0), q1 = codes(x1);
  if constexpr (sizeof(Q) == 1) {
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(q1));
  } else {
    _mm256_storeu_si256((__m256i*)q, _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256((__m256i*)(q + 16), _mm512_cvtepi32_epi16(q1));
  }
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif FR_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
  __m256 m = zero;
  for (int h = 0; h < 4; h++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * h)), m);
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  d = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1))) / LEVELS<Q>;
  const __m256 dv = _mm256_set1_ps(d);
  const __m256 any = d > 0 ? _mm256_castsi256_ps(_mm256_set1_epi32(-1)) : zero;
  __m256i total = _mm256_setzero_si256();
  for (int h = 0; h < 4; h++) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * h), dv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 keep = _mm256_and_ps(any, _mm256_cmp_ps(_mm256_sub_ps(r, r), zero, _CMP_EQ_OQ));
    const __m256i v = _mm256_srai_epi32(_mm256_slli_epi32(_mm256_cvtps_epi32(_mm256_and_ps(r, keep)), drop), drop);
    total = _mm256_add_epi32(total, v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    if constexpr (sizeof(Q) == 1) _mm_storel_epi64((__m128i*)(q + 8 * h), _mm_packs_epi16(words, words));
    else _mm_storeu_si128((__m128i*)(q + 8 * h), words);
  }
  const __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  const __m128i t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32(t2, 1)));
#else
  round_block_reference(x, q, d, sum);
#endif
}

// x: rows [M, K], float32 or bf16 (a bf16 model's rows, taken as they are: exact in float32). shift: log2 of the group
// length whose sums the rows need (int4's offsets); 0: none.
template <class Q>
Rounded<Q> round_rows(const at::Tensor& x, int64_t M, int64_t K, int64_t shift) {
  const int64_t blocks = K / BLOCK;
  const int blocks_shift = shift ? int(shift) - 5 : 0;  // log2 of a group's blocks (a division held ~18% of the samples here)
  Rounded<Q> r{M, std::vector<Q>(M * K), std::vector<float>(M * blocks),
               std::vector<float>(shift ? M * (K >> shift) : 0)};
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* floats = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* halves = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  // Over every core from 300 rows x blocks (a verify's 8 rows of 1536 inputs: 384, ~4 us on one core; a decode's widest
  // row, 8960 inputs: 280, left on one), a group's blocks on one thread, in order; threads write apart, block-major.
  const int64_t units = blocks >> blocks_shift;
  at::parallel_for(0, units, std::max<int64_t>(1, 300 / (M << blocks_shift)), [&](int64_t begin, int64_t end) {
    float block[BLOCK];
    for (int64_t b = begin << blocks_shift; b < end << blocks_shift; b++)
      for (int64_t m = 0; m < M; m++) {
        int32_t sum;
        if (bf16)
          for (int j = 0; j < BLOCK; j++) block[j] = bf16_value(halves[m * K + b * BLOCK + j]);
        round_block(bf16 ? block : floats + m * K + b * BLOCK, r.q.data() + (b * M + m) * BLOCK, r.d[b * M + m], sum);
        if (shift) {
          float& group_sum = r.group_sums[(b >> blocks_shift) * M + m];  // blocks of a group in order
          group_sum = std::fma(r.d[b * M + m], float(sum), group_sum);
        }
      }
  });
  return r;
}

// The most rows a pass over a tile: their sums and the unpacked codes fill the vector registers.
#if FR_AVX512VNNI && FR_AVX512BW
constexpr int TILE_ROWS = 8;
#elif FR_AVX2
constexpr int TILE_ROWS = 4;
#else
constexpr int TILE_ROWS = 8;
#endif

// run(tile, m0, r) for every tile and every pass of at most `most` rows: each tile once from memory, its passes one
// after another (the tile stays in cache between them), the tiles split over every core. Rows are split evenly
// between passes.
template <class Run>
void over_tiles(int64_t tiles, int64_t M, int64_t tile_bytes, const Run& run, int most = TILE_ROWS) {
  const int64_t passes = (M + most - 1) / most;
  at::parallel_for(0, tiles, std::max<int64_t>(1, 65536 / tile_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++)
      for (int64_t p = 0, m = 0, r; p < passes; p++, m += r) {
        r = (M - m) / (passes - p);
        run(t, m, int(r));
      }
  });
}

#if FR_AVX512VNNI && FR_AVX512BW
// acc + the products of w and the 4 bytes at p broadcast, the broadcast a memory operand of the instruction (GCC
// otherwise loads it into a register first: one more operation for every multiply).
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const void* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}
inline __m512i dpwssd_broadcast(__m512i acc, __m512i w, const void* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}
#endif

inline int32_t four_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// int4 tiles (linear.h's int4_code_tiles writes them): codes [N / 16, K / 32, 256], per tile and block 4 quarters of 64
// bytes; in quarter t, byte 4c + j holds column c's code of k = 8t + j in its low nibble and of k = 8t + 4 + j in its
// high one (one mask, and one shift and mask, give two vectors of codes). Each group of blocks has a scale and an
// offset per column, read by the format's factors (GroupFactors: int4, Int4kFactors: int4k): w = code * scale + offset.
// Per column and row: y = sum over groups g of (sum over g's blocks b of float(dot_b) * (scale_g * d_b)) +
// offset_g * group_sum_g, fused multiply-adds in that order, where dot_b = sum of code * q, an exact integer.
struct Int4Tiles {
  static constexpr int BYTES = 256;  // a block of a tile
  const uint8_t* codes;
  int64_t K, shift;  // in_features; log2 of the group length
  const uint8_t* block(int64_t tile, int64_t b) const { return codes + (tile * (K / BLOCK) + b) * BYTES; }
  // Column c's code of k = 32 b + i, for the plain code and the test that reads the layout back.
  static int code(const uint8_t* block, int c, int i) {
    const uint8_t byte = block[64 * (i / 8) + 4 * c + i % 4];
    return i % 8 < 4 ? byte & 15 : byte >> 4;
  }
};

#if FR_AVX512F
inline __m512 bf16_vector(const uint16_t* p) {  // 16 bf16 as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif
#if FR_AVX2
inline __m256 bf16_half(const uint16_t* p) {  // 8 bf16 as float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif

// The factors are a stream of their own beside the codes': prefetched as many blocks ahead as the codes are.
constexpr int64_t FACTORS_AHEAD = PREFETCH_BYTES / Int4Tiles::BYTES;

// int4's factors, as its file has them: bf16 [N / 16, K / group, 2, 16], per tile and group the 16 columns' scales,
// then their zeros: w = (code - 8) * scale + zero, so offset = zero - 8 scale (fused).
struct GroupFactors {
  const uint16_t* f;
  int64_t groups;
  int blocks_shift;  // log2 of a group's blocks: a shift a block, not a 64-bit division
  const uint16_t* at(int64_t tile, int64_t g) const { return f + (tile * groups + g) * 2 * TILE; }
  // Where block b's factors lie, for the prefetch (b past the tile's last block: the next tile's, which follows)
  const void* of_block(int64_t tile, int64_t b, int64_t blocks) const {
    return f + ((tile * blocks + b) >> blocks_shift) * 2 * TILE;
  }
  float scale(int64_t tile, int64_t g, int c) const { return bf16_value(at(tile, g)[c]); }
  float offset(int64_t tile, int64_t g, int c) const {
    return std::fma(-8.f, scale(tile, g, c), bf16_value(at(tile, g)[TILE + c]));
  }
#if FR_AVX512F
  __m512 scales(int64_t tile, int64_t g) const { return bf16_vector(at(tile, g)); }
  __m512 offsets(int64_t tile, int64_t g, __m512 scale) const {
    return _mm512_fmadd_ps(_mm512_set1_ps(-8.f), scale, bf16_vector(at(tile, g) + TILE));
  }
#endif
#if FR_AVX2 && FR_FMA
  __m256 scales(int64_t tile, int64_t g, int h) const { return bf16_half(at(tile, g) + 8 * h); }
  __m256 offsets(int64_t tile, int64_t g, int h, __m256 scale) const {
    return _mm256_fmadd_ps(_mm256_set1_ps(-8.f), scale, bf16_half(at(tile, g) + TILE + 8 * h));
  }
#endif
};

// int4k's factors (linear.h's int4k_layout): [N / 16, ceil(K / 256), 320] bytes, per tile and 256 inputs the 16
// columns' d (bf16), their dmin (bf16), then per block of 32 (a group) the 16 scales (uint8) and the 16 minimums
// (int8): scale = d * scale code, offset = dmin * minimum code, both exact in float32.
struct Int4kFactors {
  static constexpr int BYTES = 320, PER = 8;  // per tile and super-block; blocks a super-block
  const uint8_t* f;
  int64_t supers;
  const uint8_t* at(int64_t tile, int64_t g) const { return f + (tile * supers + g / PER) * BYTES; }
  // (40 bytes a block on average: a prefetch's address, exact where K is a multiple of 256)
  const void* of_block(int64_t tile, int64_t b, int64_t) const { return f + (tile * supers * PER + b) * (BYTES / PER); }
  const uint8_t* codes(int64_t tile, int64_t g) const { return at(tile, g) + 64 + 32 * (g % PER); }
  float scale(int64_t tile, int64_t g, int c) const {
    uint16_t d;
    std::memcpy(&d, at(tile, g) + 2 * c, 2);
    return bf16_value(d) * float(codes(tile, g)[c]);
  }
  float offset(int64_t tile, int64_t g, int c) const {
    uint16_t dmin;
    std::memcpy(&dmin, at(tile, g) + 32 + 2 * c, 2);
    return bf16_value(dmin) * float(int8_t(codes(tile, g)[TILE + c]));
  }
#if FR_AVX512F
  __m512 scales(int64_t tile, int64_t g) const {
    const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)codes(tile, g))));
    return _mm512_mul_ps(bf16_vector((const uint16_t*)at(tile, g)), code);
  }
  __m512 offsets(int64_t tile, int64_t g, __m512) const {
    const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes(tile, g) + TILE))));
    return _mm512_mul_ps(bf16_vector((const uint16_t*)(at(tile, g) + 32)), code);
  }
#endif
#if FR_AVX2 && FR_FMA
  __m256 scales(int64_t tile, int64_t g, int h) const {
    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes(tile, g) + 8 * h))));
    return _mm256_mul_ps(bf16_half((const uint16_t*)(at(tile, g) + 16 * h)), code);
  }
  __m256 offsets(int64_t tile, int64_t g, int h, __m256) const {
    const __m256 code = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(codes(tile, g) + TILE + 8 * h))));
    return _mm256_mul_ps(bf16_half((const uint16_t*)(at(tile, g) + 32 + 16 * h)), code);
  }
#endif
};

// Output column c of a tile for row m, in plain code: tile_int4's scalar reference.
template <class Factors>
inline float int4_output_reference(const Int4Tiles& w, const Factors& fs, const RoundedRows& a, int64_t m,
                                   int64_t tile, int c) {
  const int64_t blocks = w.K / BLOCK, G = w.K >> w.shift, per_group = blocks / G;
  float acc = 0.f;
  for (int64_t g = 0; g < G; g++) {
    const float scale = fs.scale(tile, g, c), offset = fs.offset(tile, g, c);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
      int32_t dot = 0;
      for (int i = 0; i < BLOCK; i++) dot += Int4Tiles::code(w.block(tile, b), c, i) * a.codes(b, m)[i];
      acc = std::fma(float(dot), scale * a.scale(b, m), acc);
    }
    acc = std::fma(offset, a.group_sum(g, m), acc);
  }
  return acc;
}

// Rows m0 .. m0 + R - 1 times one tile into y [M, N] columns 16 tile ..: per block the integer sums of every row, then
// the float steps above. AVX512_VNNI: a vpdpbusd per quarter, nibble half and row; R = 1 keeps 4 sums in flight
// (one chain of vpdpbusd waited on itself), more rows interleave theirs. AVX2: vpmaddubsw pairs (at most
// 2 * 15 * 127), 8 of a block added in 16 bits (at most 30480), one vpmaddwd to 32; the tile in two halves of 8
// columns.
template <int R, class Factors>
__attribute__((noinline)) void tile_int4(const Int4Tiles& w, const Factors& fs, const RoundedRows& a, int64_t N,
                                         int64_t m0, int64_t tile, float* y) {
  const int64_t blocks = w.K / BLOCK, G = w.K >> w.shift, per_group = blocks / G, M = a.M;
  float* out = y + m0 * N + tile * TILE;  // row r's 16 outputs at out + r * N
#if FR_AVX512VNNI && FR_AVX512BW
  constexpr int C = R == 1 ? 4 : R <= 3 ? 2 : 1;  // integer sums in flight a row
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const uint8_t* p = w.block(tile, 0);
  for (int64_t g = 0; g < G; g++) {
    const __m512 scale = fs.scales(tile, g);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; b++, p += Int4Tiles::BYTES) {
      const int8_t* q = a.codes(b, m0);  // row r's 32 at q + 32 r
      const float* d = &a.d[b * M + m0];
      __builtin_prefetch(fs.of_block(tile, b + FACTORS_AHEAD, blocks));
      __m512i dots[R][C];
      for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) dots[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int t = 0; t < 4; t++) {
        __builtin_prefetch(p + 64 * t + PREFETCH_BYTES);
        const __m512i v = _mm512_loadu_si512(p + 64 * t);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; r++) {
          const int8_t* x = q + BLOCK * r + 8 * t;
          dots[r][(2 * t) % C] = dpbusd_broadcast(dots[r][(2 * t) % C], lo, x);
          dots[r][(2 * t + 1) % C] = dpbusd_broadcast(dots[r][(2 * t + 1) % C], hi, x + 4);
        }
      }
      for (int r = 0; r < R; r++) {
        __m512i dot = dots[r][0];
        for (int c = 1; c < C; c++) dot = _mm512_add_epi32(dot, dots[r][c]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d[r])), acc[r]);
      }
    }
    const __m512 offset = fs.offsets(tile, g, scale);
    const float* gs = &a.group_sums[g * M + m0];
    for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(gs[r]), acc[r]);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N, acc[r]);
#elif FR_AVX2 && FR_FMA
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint8_t* p = w.block(tile, 0);
  for (int64_t g = 0; g < G; g++) {
    const __m256 scales[2] = {fs.scales(tile, g, 0), fs.scales(tile, g, 1)};
    for (int64_t b = g * per_group; b < (g + 1) * per_group; b++, p += Int4Tiles::BYTES) {
      const int8_t* q = a.codes(b, m0);
      const float* d = &a.d[b * M + m0];
      for (int t = 0; t < 4; t++) __builtin_prefetch(p + 64 * t + PREFETCH_BYTES);
      __builtin_prefetch(fs.of_block(tile, b + FACTORS_AHEAD, blocks));
      for (int h = 0; h < 2; h++) {
        __m256i pairs[R];
        for (int r = 0; r < R; r++) pairs[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * t + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; r++) {
            const int8_t* x = q + BLOCK * r + 8 * t;
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(x))));
            pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(x + 4))));
          }
        }
        for (int r = 0; r < R; r++) {
          const __m256i dot = _mm256_madd_epi16(pairs[r], ones);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scales[h], _mm256_set1_ps(d[r])), acc[r][h]);
        }
      }
    }
    const float* gs = &a.group_sums[g * M + m0];
    for (int h = 0; h < 2; h++) {
      const __m256 offset = fs.offsets(tile, g, h, scales[h]);
      for (int r = 0; r < R; r++) acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(gs[r]), acc[r][h]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + 8 * h, acc[r][h]);
#else
  for (int r = 0; r < R; r++)
    for (int c = 0; c < TILE; c++) out[r * N + c] = int4_output_reference(w, fs, a, m0 + r, tile, c);
#endif
}

template <int R = 1, class Factors>
inline void tile_int4_of(int r, const Int4Tiles& w, const Factors& fs, const RoundedRows& a, int64_t N, int64_t m0,
                         int64_t tile, float* y) {
  if constexpr (R < TILE_ROWS) {
    if (r > R) return tile_int4_of<R + 1>(r, w, fs, a, N, m0, tile, y);
  }
  tile_int4<R>(w, fs, a, N, m0, tile, y);
}

#if FR_AVX512VNNI && FR_AVX512BW
// tile_int4 for R rows (2 .. 16) on AMX tiles (amx.h): per block the codes unpacked to B (quarter t's low nibbles are
// row 2t, its high ones row 2t + 1), the rows' integer sums by one tile product, then tile_int4's float steps.
template <class Tiles, class Factors>
__attribute__((noinline)) void tile_int4_amx(int R, const Int4Tiles& w, const Factors& fs, const RoundedRows& a,
                                             int64_t N, int64_t m0, int64_t tile, float* y) {
  const int64_t blocks = w.K / BLOCK, G = w.K >> w.shift, per_group = blocks / G, M = a.M;
  float* out = y + m0 * N + tile * TILE;
  alignas(64) uint8_t codes[8 * 4 * TILE];
  alignas(64) int32_t dots[TILE_PASS_ROWS * TILE];
  __m512 acc[TILE_PASS_ROWS];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(15);
  Tiles::configure(R);
  const uint8_t* p = w.block(tile, 0);
  for (int64_t g = 0; g < G; g++) {
    const __m512 scale = fs.scales(tile, g);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; b++, p += Int4Tiles::BYTES) {
      __builtin_prefetch(fs.of_block(tile, b + FACTORS_AHEAD, blocks));
      for (int t = 0; t < 4; t++) {
        __builtin_prefetch(p + 64 * t + PREFETCH_BYTES);
        const __m512i v = _mm512_loadu_si512(p + 64 * t);
        _mm512_store_si512(codes + 128 * t, _mm512_and_si512(v, low));
        _mm512_store_si512(codes + 128 * t + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
      Tiles::dot_su(R, a.codes(b, m0), codes, dots);
      const float* d = &a.d[b * M + m0];
      for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots + TILE * r)),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(d[r])), acc[r]);
    }
    const __m512 offset = fs.offsets(tile, g, scale);
    const float* gs = &a.group_sums[g * M + m0];
    for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(gs[r]), acc[r]);
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N, acc[r]);
}
#endif

// x [M, K] (float32 or bf16) times int4 tiles [N / 16, K / 32, 256] and their factors: each tile once from memory,
// its passes of rows one after another (the tile stays in cache between them), the tiles split over every core. M may
// be a prompt's thousands of rows: the weights are read once all the same.
template <class Factors>
at::Tensor int4_product(const at::Tensor& x, const at::Tensor& w, const Factors& fs, int64_t shift) {
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) * BLOCK, M = x.size(0);
  const RoundedRows a = round_rows<int8_t>(x, M, K, shift);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Int4Tiles weight{w.data_ptr<uint8_t>(), K, shift};
  float* yp = y.data_ptr<float>();
  const bool tiled = on_tiles(M, [&](auto tiles_of) {
#if FR_AVX512VNNI && FR_AVX512BW
    over_tiles(tiles, M, K / 2 * TILE, [&](int64_t t, int64_t m, int r) {
      tile_int4_amx<decltype(tiles_of)>(r, weight, fs, a, N, m, t, yp);
    }, TILE_PASS_ROWS);
#endif
  });
  if (!tiled)
    over_tiles(tiles, M, K / 2 * TILE, [&](int64_t t, int64_t m, int r) { tile_int4_of(r, weight, fs, a, N, m, t, yp); });
  return y;
}

void check_int4_tiles(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == Int4Tiles::BYTES && w.is_contiguous(),
              "few_rows: int4 tiles are uint8 [N / 16, K / 32, 256]");
  check_rows(x, w.size(1) * BLOCK, true);
}

// int4: bf16 factors [N / 16, K / group, 2, 16] (GroupFactors).
at::Tensor int4_tiles(const at::Tensor& x, const at::Tensor& w, const at::Tensor& factors) {
  check_int4_tiles(x, w);
  TORCH_CHECK(factors.scalar_type() == at::kBFloat16 && factors.is_contiguous() && factors.dim() == 4 &&
                  factors.size(0) == w.size(0) && factors.size(2) == 2 && factors.size(3) == TILE,
              "few_rows: int4 tiles need bf16 factors [N / 16, K / group, 2, 16]");
  const int64_t shift = block_shift(w.size(1) * BLOCK, factors.size(1), "int4 groups");
  TORCH_CHECK(shift >= 5, "few_rows: int4 groups must hold at least 32 elements");
  const GroupFactors fs{reinterpret_cast<const uint16_t*>(factors.data_ptr()), factors.size(1), int(shift) - 5};
  return int4_product(x, w, fs, shift);
}

// int4k: factors [N / 16, ceil(K / 256), 320] bytes (Int4kFactors), a group a block.
at::Tensor int4k_tiles(const at::Tensor& x, const at::Tensor& w, const at::Tensor& factors) {
  check_int4_tiles(x, w);
  TORCH_CHECK(factors.scalar_type() == at::kByte && factors.is_contiguous() && factors.dim() == 3 &&
                  factors.size(0) == w.size(0) && factors.size(1) == (w.size(1) + Int4kFactors::PER - 1) / Int4kFactors::PER &&
                  factors.size(2) == Int4kFactors::BYTES,
              "few_rows: int4k tiles need factors uint8 [N / 16, ceil(K / 256), 320]");
  return int4_product(x, w, Int4kFactors{factors.data_ptr<uint8_t>(), factors.size(1)}, 5);
}

// The codes [N, K] as Int4Tiles reads them, for the test that round-trips int4_code_tiles.
at::Tensor int4_codes(const at::Tensor& tiles) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 3 &&
                  tiles.size(2) == Int4Tiles::BYTES, "few_rows: int4 tiles are uint8 [N / 16, K / 32, 256]");
  const int64_t N = tiles.size(0) * TILE, K = tiles.size(1) * BLOCK;
  const Int4Tiles w{tiles.data_ptr<uint8_t>(), K, 5};
  at::Tensor codes = at::empty({N, K}, tiles.options());
  uint8_t* out = codes.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; n++)
    for (int64_t i = 0; i < K; i++) out[n * K + i] = Int4Tiles::code(w.block(n / TILE, i / BLOCK), int(n % TILE), int(i % BLOCK));
  return codes;
}

}  // namespace

namespace {

// Products with 16-bit activations (int8 codes, MX elements that are integer multiples): the codes as int16 pairs,
// lane c of a 32-bit word holding column c's codes for 2 consecutive k, times those 2 q of the row (vpdpwssd with
// AVX512_VNNI, vpmaddwd on AVX2): |sum| <= 32 * 127 * 32767 < 2^31, exact. Per column and row: y = sum over blocks b
// in order of float(dot_b) * (factor_b * d_b) (MX: the block's scale over the codes' multiple) as fused
// multiply-adds, or (int8) of float(dot_b) * d_b, times the column's scale at the end.

// int8 tiles (linear.h's pair_tiles): codes [N / 16, K / 32, 512], per tile and block 16 pairs of k of 32 bytes, byte
// 2c + j of pair p column c's code at k = 2p + j.
struct Int8Codes {
  static constexpr int BYTES = 512;
  static constexpr bool VECTOR = (FR_AVX2 && FR_FMA) || (FR_AVX512VNNI && FR_AVX512BW);
  const int8_t* codes;
  int64_t K;
  const int8_t* block(int64_t tile, int64_t b) const { return codes + (tile * (K / BLOCK) + b) * BYTES; }
  int value(const int8_t* block, int c, int i) const { return block[32 * (i / 2) + 2 * c + i % 2]; }
};

// MX 6-bit tiles (linear.h's fp6_tiles): codes [N / 16, K / 32, 384], per tile and block 8 quads of k of 48 bytes,
// each 64 codes packed as the file packs them (4 in 3 bytes, little-endian), code 32h + 2c + j of quad t being
// column c's at k = 4t + 2h + j; table: int16 [65], the 64 codes' values times 2^table[64], exact integers (E2M3: times
// 8). One maskz load, a byte permute and a bit-field select unpack a quad (AVX512_VBMI), a 64-word permute looks its
// codes up; elsewhere plain code (layout() then lays out int8 tiles instead).
struct Fp6Codes {
  static constexpr int BYTES = 384;
  static constexpr bool VECTOR = FR_AVX512VBMI && FR_AVX512VNNI && FR_AVX512BW;
  const uint8_t* codes;
  const int16_t* table;
  int64_t K;
  const uint8_t* block(int64_t tile, int64_t b) const { return codes + (tile * (K / BLOCK) + b) * BYTES; }
  int value(const uint8_t* block, int c, int i) const {
    const int n = 32 * (i % 4 / 2) + 2 * c + i % 2, g = n / 4;
    const uint8_t* p = block + 48 * (i / 4) + 3 * g;
    const uint32_t word = p[0] | p[1] << 8 | p[2] << 16;
    return table[(word >> (6 * (n % 4))) & 63];
  }
};

// The factors: one per column (int8's scale, applied to the finished sum), float per block and column (MX codes as
// int8: the block's scale over the multiple), or E8M0 per block and column times 1 / multiple (MX 6-bit tiles).
struct ChannelScales {
  const float* scales;  // [N / 16, 16]
  static constexpr bool PER_BLOCK = false;
};
struct BlockFactors {
  const float* factors;  // [N / 16, K / 32, 16]
  int64_t blocks;
  static constexpr bool PER_BLOCK = true;
  float at(int64_t tile, int64_t b, int c) const { return factors[(tile * blocks + b) * TILE + c]; }
  const void* of_block(int64_t tile, int64_t b, int64_t) const { return factors + (tile * blocks + b) * TILE; }
};
struct E8M0Factors {
  const uint8_t* scales;  // [N / 16, K / 32, 16]
  int64_t blocks;
  float inverse;  // 1 / the codes' multiple, a power of two
  static constexpr bool PER_BLOCK = true;
  const void* of_block(int64_t tile, int64_t b, int64_t) const { return scales + (tile * blocks + b) * TILE; }
  float at(int64_t tile, int64_t b, int c) const {  // 2^(e - 127), 255: NaN
    const uint8_t e = scales[(tile * blocks + b) * TILE + c];
    return (e == 255 ? NAN : std::ldexp(1.f, e - 127)) * inverse;
  }
};

// Output column c of a tile for row m, in plain code: tile_wide's scalar reference.
template <class Codes, class Factors>
inline float wide_output_reference(const Codes& w, const Factors& f, const Rounded<int16_t>& a, int64_t m,
                                   int64_t tile, int c) {
  float acc = 0.f;
  for (int64_t b = 0; b < w.K / BLOCK; b++) {
    int32_t dot = 0;
    for (int i = 0; i < BLOCK; i++) dot += w.value(w.block(tile, b), c, i) * a.codes(b, m)[i];
    if constexpr (Factors::PER_BLOCK) acc = std::fma(float(dot), f.at(tile, b, c) * a.scale(b, m), acc);
    else acc = std::fma(float(dot), a.scale(b, m), acc);
  }
  if constexpr (Factors::PER_BLOCK) return acc;
  else return acc * f.scales[tile * TILE + c];
}

#if FR_AVX512VNNI && FR_AVX512BW
// Pairs 2t and 2t + 1 of a block (k = 4t .. 4t + 3) as int16 words, lane c the column's two codes.
inline void unpack(const Int8Codes&, const int8_t* block, int t, __m512i& p0, __m512i& p1) {
  p0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(block + 64 * t)));
  p1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(block + 64 * t + 32)));
}
#if FR_AVX512VBMI
inline void unpack(const Fp6Codes& w, const uint8_t* block, int t, __m512i& p0, __m512i& p1) {
  // Bytes 6q .. 6q + 5 to qword q, then byte j of each qword from its bits 6j .. 6j + 7: code j, with two bits of
  // the next above it, which the 64-word permute ignores (it reads 6 bits of each index).
  const __m512i spread = _mm512_set_epi8(
      0, 0, 47, 46, 45, 44, 43, 42, 0, 0, 41, 40, 39, 38, 37, 36, 0, 0, 35, 34, 33, 32, 31, 30, 0, 0, 29, 28, 27, 26,
      25, 24, 0, 0, 23, 22, 21, 20, 19, 18, 0, 0, 17, 16, 15, 14, 13, 12, 0, 0, 11, 10, 9, 8, 7, 6, 0, 0, 5, 4, 3, 2,
      1, 0);
  const __m512i table_low = _mm512_loadu_si512(w.table), table_high = _mm512_loadu_si512(w.table + 32);
  const __m512i fields = _mm512_multishift_epi64_epi8(
      _mm512_set1_epi64(0x2a241e18120c0600LL),
      _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(0xffffffffffffULL, block + 48 * t)));
  p0 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(fields)), table_high);
  p1 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(fields, 1)), table_high);
}
#endif

inline __m512 block_vector(const BlockFactors& f, int64_t tile, int64_t b) {
  return _mm512_loadu_ps(f.factors + (tile * f.blocks + b) * TILE);
}
inline __m512 block_vector(const E8M0Factors& f, int64_t tile, int64_t b) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(f.scales + (tile * f.blocks + b) * TILE)));
  __m512i bits = _mm512_slli_epi32(e, 23);  // 2^(e - 127) for e in 1 .. 254
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7fc00000));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(f.inverse));
}
inline __m512 block_vector(const ChannelScales&, int64_t, int64_t) { return _mm512_setzero_ps(); }
#endif

#if FR_AVX2 && !(FR_AVX512VNNI && FR_AVX512BW)
inline __m256 block_half(const BlockFactors& f, int64_t tile, int64_t b, int h) {
  return _mm256_loadu_ps(f.factors + (tile * f.blocks + b) * TILE + 8 * h);
}
inline __m256 block_half(const ChannelScales&, int64_t, int64_t, int) { return _mm256_setzero_ps(); }
#endif

template <int R, class Codes, class Factors>
__attribute__((noinline)) void tile_wide(const Codes& w, const Factors& f, const Rounded<int16_t>& a, int64_t N,
                                         int64_t m0, int64_t tile, float* y) {
  const int64_t blocks = w.K / BLOCK, M = a.M;
  float* out = y + m0 * N + tile * TILE;  // row r's 16 outputs at out + r * N
  if constexpr (!Codes::VECTOR) {
    for (int r = 0; r < R; r++)
      for (int c = 0; c < TILE; c++) out[r * N + c] = wide_output_reference(w, f, a, m0 + r, tile, c);
  } else {
#if FR_AVX512VNNI && FR_AVX512BW
    constexpr int C = R == 1 ? 4 : R <= 3 ? 2 : 1;  // integer sums in flight a row
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    auto p = w.block(tile, 0);
    for (int64_t b = 0; b < blocks; b++, p += Codes::BYTES) {
      const int16_t* q = a.codes(b, m0);  // row r's 32 at q + 32 r
      const float* d = &a.d[b * M + m0];
      __m512i dots[R][C];
      for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) dots[r][c] = _mm512_setzero_si512();
      for (int l = 0; l < Codes::BYTES; l += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + l + PREFETCH_BYTES);
      if constexpr (Factors::PER_BLOCK) __builtin_prefetch(f.of_block(tile, b + PREFETCH_BYTES / Codes::BYTES, blocks));
#pragma GCC unroll 8
      for (int t = 0; t < 8; t++) {
        __m512i p0, p1;
        unpack(w, p, t, p0, p1);
        for (int r = 0; r < R; r++) {
          const int16_t* x = q + BLOCK * r + 4 * t;
          dots[r][(2 * t) % C] = dpwssd_broadcast(dots[r][(2 * t) % C], p0, x);
          dots[r][(2 * t + 1) % C] = dpwssd_broadcast(dots[r][(2 * t + 1) % C], p1, x + 2);
        }
      }
      const __m512 factor = block_vector(f, tile, b);
      for (int r = 0; r < R; r++) {
        __m512i dot = dots[r][0];
        for (int c = 1; c < C; c++) dot = _mm512_add_epi32(dot, dots[r][c]);
        const __m512 scale = Factors::PER_BLOCK ? _mm512_mul_ps(factor, _mm512_set1_ps(d[r])) : _mm512_set1_ps(d[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      }
    }
    for (int r = 0; r < R; r++) {
      if constexpr (!Factors::PER_BLOCK) acc[r] = _mm512_mul_ps(acc[r], _mm512_loadu_ps(f.scales + tile * TILE));
      _mm512_storeu_ps(out + r * N, acc[r]);
    }
#elif FR_AVX2 && FR_FMA
    static_assert(std::is_same_v<Codes, Int8Codes>, "AVX2 multiplies int8 tiles only");
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int8_t* p = w.block(tile, 0);
    for (int64_t b = 0; b < blocks; b++, p += Codes::BYTES) {
      const int16_t* q = a.codes(b, m0);
      const float* d = &a.d[b * M + m0];
      for (int l = 0; l < Codes::BYTES; l += 64) __builtin_prefetch(p + l + PREFETCH_BYTES);
      if constexpr (Factors::PER_BLOCK) __builtin_prefetch(f.of_block(tile, b + PREFETCH_BYTES / Codes::BYTES, blocks));
      for (int h = 0; h < 2; h++) {
        __m256i dots[R];
        for (int r = 0; r < R; r++) dots[r] = _mm256_setzero_si256();
        for (int pair = 0; pair < 16; pair++) {
          const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 32 * pair + 16 * h)));
          for (int r = 0; r < R; r++)
            dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(v, _mm256_set1_epi32(four_bytes(q + BLOCK * r + 2 * pair))));
        }
        const __m256 factor = block_half(f, tile, b, h);
        for (int r = 0; r < R; r++) {
          const __m256 scale = Factors::PER_BLOCK ? _mm256_mul_ps(factor, _mm256_set1_ps(d[r])) : _mm256_set1_ps(d[r]);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r][h]);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) {
        if constexpr (!Factors::PER_BLOCK) acc[r][h] = _mm256_mul_ps(acc[r][h], _mm256_loadu_ps(f.scales + tile * TILE + 8 * h));
        _mm256_storeu_ps(out + r * N + 8 * h, acc[r][h]);
      }
#endif
  }
}

template <int R = 1, class Codes, class Factors>
inline void tile_wide_of(int r, const Codes& w, const Factors& f, const Rounded<int16_t>& a, int64_t N, int64_t m0,
                         int64_t tile, float* y) {
  if constexpr (R < TILE_ROWS) {
    if (r > R) return tile_wide_of<R + 1>(r, w, f, a, N, m0, tile, y);
  }
  tile_wide<R>(w, f, a, N, m0, tile, y);
}

#if FR_AVX512VNNI && FR_AVX512BW
// The 16-bit rounded rows as AMX multiplies them: q = 256 hi + lo, lo unsigned, hi signed, as q's layout.
struct SplitRows {
  std::vector<uint8_t> lo;
  std::vector<int8_t> hi;
  explicit SplitRows(const std::vector<int16_t>& q) : lo(q.size()), hi(q.size()) {
    for (size_t i = 0; i < q.size(); i++) lo[i] = uint8_t(q[i] & 255), hi[i] = int8_t(q[i] >> 8);
  }
};

// tile_wide for R rows (2 .. 16) on AMX tiles (amx.h): per block the codes as B (quad t: the int16 pairs of
// k = 4t .. 4t + 1 and 4t + 2 .. 4t + 3 narrowed to bytes and interleaved by column), the rows' integer sums by two
// tile products, 256 hi + lo, then tile_wide's float steps.
template <class Tiles, class Codes, class Factors>
__attribute__((noinline)) void tile_wide_amx(int R, const Codes& w, const Factors& f, const Rounded<int16_t>& a,
                                             const SplitRows& split, int64_t N, int64_t m0, int64_t tile, float* y) {
  const int64_t blocks = w.K / BLOCK, M = a.M;
  float* out = y + m0 * N + tile * TILE;
  alignas(64) int8_t codes[8 * 4 * TILE];
  alignas(64) int32_t lo[TILE_PASS_ROWS * TILE], hi[TILE_PASS_ROWS * TILE];
  __m512 acc[TILE_PASS_ROWS];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  alignas(64) int16_t order[2 * TILE];  // word 2c of a row of B: column c's first pair, word 2c + 1 its second
  for (int c = 0; c < TILE; c++) order[2 * c] = int16_t(c), order[2 * c + 1] = int16_t(2 * TILE + c);
  const __m512i quads = _mm512_load_si512(order);
  Tiles::configure(R);
  auto p = w.block(tile, 0);
  for (int64_t b = 0; b < blocks; b++, p += Codes::BYTES) {
    for (int l = 0; l < Codes::BYTES; l += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + l + PREFETCH_BYTES);
    if constexpr (Factors::PER_BLOCK) __builtin_prefetch(f.of_block(tile, b + PREFETCH_BYTES / Codes::BYTES, blocks));
    for (int t = 0; t < 8; t++) {
      __m512i p0, p1;
      unpack(w, p, t, p0, p1);
      _mm512_store_si512(codes + 64 * t, _mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(p0)),
                                                                   quads,
                                                                   _mm512_castsi256_si512(_mm512_cvtepi16_epi8(p1))));
    }
    const int64_t at = (b * M + m0) * BLOCK;
    Tiles::dot_wide(R, split.lo.data() + at, split.hi.data() + at, codes, lo, hi);
    const float* d = &a.d[b * M + m0];
    const __m512 factor = block_vector(f, tile, b);
    for (int r = 0; r < R; r++) {
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi + TILE * r), 8),
                                           _mm512_load_si512(lo + TILE * r));
      const __m512 scale = Factors::PER_BLOCK ? _mm512_mul_ps(factor, _mm512_set1_ps(d[r])) : _mm512_set1_ps(d[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    if constexpr (!Factors::PER_BLOCK) acc[r] = _mm512_mul_ps(acc[r], _mm512_loadu_ps(f.scales + tile * TILE));
    _mm512_storeu_ps(out + r * N, acc[r]);
  }
}
#endif

template <class Codes, class Factors>
at::Tensor wide(const at::Tensor& x, const Codes& w, const Factors& f, int64_t tiles) {
  const int64_t M = x.size(0), N = tiles * TILE;
  const Rounded<int16_t> a = round_rows<int16_t>(x, M, w.K, 0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const bool tiled = Codes::VECTOR && on_tiles(M, [&](auto tiles_of) {
#if FR_AVX512VNNI && FR_AVX512BW
    if constexpr (Codes::VECTOR) {
      const SplitRows split(a.q);
      over_tiles(tiles, M, w.K / BLOCK * Codes::BYTES, [&](int64_t t, int64_t m, int r) {
        tile_wide_amx<decltype(tiles_of)>(r, w, f, a, split, N, m, t, yp);
      }, TILE_PASS_ROWS);
    }
#endif
  });
  if (!tiled)
    over_tiles(tiles, M, w.K / BLOCK * Codes::BYTES, [&](int64_t t, int64_t m, int r) { tile_wide_of(r, w, f, a, N, m, t, yp); });
  return y;
}

// x [M, K] times int8 tiles [N / 16, K / 32, 512] with float32 factors [N / 16, 16] (a scale per column) or
// [N / 16, K / 32, 16] (per block and column); or MX 6-bit tiles [N / 16, K / 32, 384] with their int16 table [65] and
// E8M0 scales [N / 16, K / 32, 16].
at::Tensor wide_tiles(const at::Tensor& x, const at::Tensor& w, const at::Tensor& factors,
                      const std::optional<at::Tensor>& table) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous(), "few_rows: tiles are [N / 16, K / 32, bytes]");
  const int64_t tiles = w.size(0), blocks = w.size(1), K = blocks * BLOCK;
  check_rows(x, K, true);
  TORCH_CHECK(factors.is_contiguous(), "few_rows: factors must be contiguous");
  const bool per_block = factors.dim() == 3;
  TORCH_CHECK(per_block ? factors.size(0) == tiles && factors.size(1) == blocks && factors.size(2) == TILE
                        : factors.dim() == 2 && factors.size(0) == tiles && factors.size(1) == TILE,
              "few_rows: tile factors are [N / 16, K / 32, 16] or [N / 16, 16]");
  if (table) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.size(2) == Fp6Codes::BYTES && table->scalar_type() == at::kShort &&
                    table->is_contiguous() && table->numel() == 65 && per_block && factors.scalar_type() == at::kByte,
                "few_rows: MX 6-bit tiles are uint8 [N / 16, K / 32, 384] with an int16 table [65] and E8M0 scales");
    const int16_t* t = table->data_ptr<int16_t>();
    return wide(x, Fp6Codes{w.data_ptr<uint8_t>(), t, K},
                E8M0Factors{factors.data_ptr<uint8_t>(), blocks, std::ldexp(1.f, -t[64])}, tiles);
  }
  TORCH_CHECK(w.scalar_type() == at::kChar && w.size(2) == Int8Codes::BYTES && factors.scalar_type() == at::kFloat,
              "few_rows: int8 tiles are int8 [N / 16, K / 32, 512] with float32 factors");
  const Int8Codes codes{w.data_ptr<int8_t>(), K};
  if (per_block) return wide(x, codes, BlockFactors{factors.data_ptr<float>(), blocks}, tiles);
  return wide(x, codes, ChannelScales{factors.data_ptr<float>()}, tiles);
}

}  // namespace

namespace {

// bf16 weights in column tiles (linear.h's pair_tiles): [N / 16, K / 32, 512] bf16, per tile and block 16 pairs of k
// of 64 bytes, word 2c + j of pair p column c's weight at k = 2p + j. Each input row rounded to bf16 (a bf16 model's
// already is); lane c of a vector adds the exact products of its column's weights at k = 2p + 1, then 2p, times the
// row's inputs there, broadcast, each with one rounding (vdpbf16ps with AVX512_BF16; two fused multiply-adds
// elsewhere), in two chains, of the even and the odd pairs, added at the end. The weights' bytes are read once for
// every row of a call; the inputs are 4-byte broadcasts, read once a tile (by weight rows, a row read every input
// of the pass: 8 verify rows of the down projection's 8,960 spilled L1 at every weight row).
struct Bf16Codes {
  static constexpr int BYTES = 1024;
  const uint16_t* codes;
  int64_t K;
  const uint16_t* block(int64_t tile, int64_t b) const { return codes + (tile * (K / BLOCK) + b) * (BYTES / 2); }
};

// The rows [M, K] rounded to bf16, nearest, ties to even, block-major [K / 32, M, 32] (a pass's rows of a block side by
// side). With AVX512_BF16 32 at a time, flushing denormals to zero, as vdpbf16ps does.
std::vector<uint16_t> bf16_blocks(const float* x, int64_t M, int64_t K) {
  std::vector<uint16_t> out(M * K);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < K / BLOCK; b++) {
      const float* in = x + m * K + b * BLOCK;
      uint16_t* to = out.data() + (b * M + m) * BLOCK;
#if FR_AVX512BF16
      _mm512_storeu_si512(to, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + L), _mm512_loadu_ps(in)));
#else
      for (int j = 0; j < BLOCK; j++) to[j] = round_to_bf16(in[j]);
#endif
    }
  return out;
}

// Output column c of a tile for row m, in plain code: tile_bf16's scalar reference.
inline float bf16_output_reference(const Bf16Codes& w, const uint16_t* x, int64_t M, int64_t m, int64_t tile, int c) {
  float chain[2] = {0.f, 0.f};
  for (int64_t b = 0; b < w.K / BLOCK; b++) {
    const uint16_t* block = w.block(tile, b);
    const uint16_t* in = x + (b * M + m) * BLOCK;
    for (int p = 0; p < 16; p++) {
      float& acc = chain[p % 2];
      acc = std::fma(bf16_value(block[32 * p + 2 * c + 1]), bf16_value(in[2 * p + 1]), acc);  // exact products
      acc = std::fma(bf16_value(block[32 * p + 2 * c]), bf16_value(in[2 * p]), acc);
    }
  }
  return chain[0] + chain[1];
}

#if FR_AVX512BF16
inline __m512 dpbf16_broadcast(__m512 acc, __m512i w, const void* p) {  // p's 2 inputs broadcast from memory
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}
#endif

template <int R>
__attribute__((noinline)) void tile_bf16(const Bf16Codes& w, const uint16_t* x, int64_t M, int64_t N, int64_t m0,
                                         int64_t tile, float* y) {
  float* out = y + m0 * N + tile * TILE;  // row r's 16 outputs at out + r * N
  const int64_t blocks = w.K / BLOCK;
#if FR_AVX512BF16
  // 2+ rows prefetch into L2 only: into L1, their loads waited on the multiplies; a decode is faster with L1
  // (both measured on Zen 4: docs/performance.md)
  constexpr int locality = R == 1 ? 3 : 2;
  __m512 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* p = w.block(tile, 0);
  for (int64_t b = 0; b < blocks; b++, p += Bf16Codes::BYTES / 2) {
    const uint16_t* in = x + (b * M + m0) * BLOCK;  // row r's 32 at in + 32 r
#pragma GCC unroll 8
    for (int pair = 0; pair < 16; pair += 2) {  // the even pair's chain, then the odd one's (constant indices: in
      __builtin_prefetch(reinterpret_cast<const char*>(p + 32 * pair) + PREFETCH_BYTES, 0, locality);  // registers)
      __builtin_prefetch(reinterpret_cast<const char*>(p + 32 * pair + 32) + PREFETCH_BYTES, 0, locality);
      const __m512i v0 = _mm512_loadu_si512(p + 32 * pair), v1 = _mm512_loadu_si512(p + 32 * pair + 32);
      for (int r = 0; r < R; r++) {
        acc[r][0] = dpbf16_broadcast(acc[r][0], v0, in + BLOCK * r + 2 * pair);
        acc[r][1] = dpbf16_broadcast(acc[r][1], v1, in + BLOCK * r + 2 * pair + 2);
      }
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * N, _mm512_add_ps(acc[r][0], acc[r][1]));
#elif FR_AVX2 && FR_FMA
  __m256 acc[R][2][2];  // [row][half][chain]
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) acc[r][h][0] = acc[r][h][1] = _mm256_setzero_ps();
  const uint16_t* p = w.block(tile, 0);
  const __m256i high = _mm256_set1_epi32(int(0xffff0000));
  for (int64_t b = 0; b < blocks; b++, p += Bf16Codes::BYTES / 2) {
    const uint16_t* in = x + (b * M + m0) * BLOCK;
#pragma GCC unroll 16
    for (int pair = 0; pair < 16; pair++) {
      __builtin_prefetch(reinterpret_cast<const char*>(p + 32 * pair) + PREFETCH_BYTES);
      __m256 odd[2], even[2];
      for (int h = 0; h < 2; h++) {
        const __m256i words = _mm256_loadu_si256((const __m256i*)(p + 32 * pair + 16 * h));
        odd[h] = _mm256_castsi256_ps(_mm256_and_si256(words, high));
        even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      }
      for (int r = 0; r < R; r++) {
        const __m256 x_odd = _mm256_set1_ps(bf16_value(in[BLOCK * r + 2 * pair + 1]));
        const __m256 x_even = _mm256_set1_ps(bf16_value(in[BLOCK * r + 2 * pair]));
        for (int h = 0; h < 2; h++) {
          __m256& a = acc[r][h][pair % 2];
          a = _mm256_fmadd_ps(even[h], x_even, _mm256_fmadd_ps(odd[h], x_odd, a));
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * N + 8 * h, _mm256_add_ps(acc[r][h][0], acc[r][h][1]));
#else
  for (int r = 0; r < R; r++)
    for (int c = 0; c < TILE; c++) out[r * N + c] = bf16_output_reference(w, x, M, m0 + r, tile, c);
#endif
}

// The most rows a bf16 pass with AVX512_BF16: 9-12 rows in one pass beat two (a second pass over the tile cost up to
// half a decode step), more spill its sums (17 in one pass lost to two at 13-16 rows; Zen 4: docs/performance.md).
#if FR_AVX512BF16
constexpr int BF16_TILE_ROWS = 12;
#else
constexpr int BF16_TILE_ROWS = TILE_ROWS;
#endif

template <int R = 1>
inline void tile_bf16_of(int r, const Bf16Codes& w, const uint16_t* x, int64_t M, int64_t N, int64_t m0, int64_t tile,
                         float* y) {
  if constexpr (R < BF16_TILE_ROWS) {
    if (r > R) return tile_bf16_of<R + 1>(r, w, x, M, N, m0, tile, y);
  }
  tile_bf16<R>(w, x, M, N, m0, tile, y);
}

// x [M, K] (float32, or bf16 as a bf16 model's rows are: taken as they are) times bf16 tiles [N / 16, K / 32, 512].
at::Tensor bf16_tiles(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.size(2) == Bf16Codes::BYTES / 2 && w.is_contiguous(),
              "few_rows: bf16 tiles are [N / 16, K / 32, 512]");
  const int64_t tiles = w.size(0), N = tiles * TILE, K = w.size(1) * BLOCK, M = x.size(0);
  std::vector<uint16_t> blocks;
  const uint16_t* rows;
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K, "few_rows: x must be bf16 [M, ", K, "]");
    rows = reinterpret_cast<const uint16_t*>(x.data_ptr());
    if (M > 1) {  // block-major (for one row, the row itself)
      blocks.resize(M * K);
      for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / BLOCK; b++)
          std::memcpy(&blocks[(b * M + m) * BLOCK], rows + m * K + b * BLOCK, BLOCK * sizeof(uint16_t));
      rows = blocks.data();
    }
  } else {
    check_rows(x, K);
    blocks = bf16_blocks(x.data_ptr<float>(), M, K);
    rows = blocks.data();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const Bf16Codes weight{reinterpret_cast<const uint16_t*>(w.data_ptr()), K};
  float* yp = y.data_ptr<float>();
  over_tiles(tiles, M, K * 2 * TILE, [&](int64_t t, int64_t m, int r) { tile_bf16_of(r, weight, rows, M, N, m, t, yp); },
             BF16_TILE_ROWS);
  return y;
}

}  // namespace
