/* minillm's CPU products with quantized weights: int8 codes (one scale per output row) and
   Q4_1-style int4 (per block of 32 inputs a scale d and a minimum m, both fp16:
   w = d q + m, q in 0..15; codes packed two a byte, input 2i in the low nibble).

   Y[r, j] = sum_i W[j, i] X[r, i]. The weights stay as their codes: decoding them to floats
   would cost more instructions than reading them from memory. Instead each row of X is
   rounded to int8 per block of 32 inputs (scale dx = absmax / 127), as llama.cpp rounds
   activations for its quantized products, and a block's dot product is an integer one,
   byte products summed in int32 lanes (AVX2: maddubs then madd, 32 bytes; AVX-512 VNNI:
   one vpdpbusd, 64), which one multiply-add by the block's scales d * dx turns into
   floats. Q4_1's minimum adds m * (sum of the block's rounded x), so that the result is the
   exact weights times one rounded x, as for int8 (with the sum of x itself, the rounding
   error would scale with the codes 0..15, not with the weights around 0). Each row of X is
   computed alone, so its result does not depend on what it is batched with; up to four
   rows share each weight load. Without AVX2 the same integer sums run as plain C loops. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 1
#endif
#if defined(SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 4 /* q4 takes four blocks an instruction (vpdpbusd), then pairs */
#else
#define WIDE 2
#endif
#define BLOCK 32
#define ROWS 4
#define INLINE static inline __attribute__((always_inline))

typedef struct { /* a row of X rounded to int8: codes, per block a scale dx and the sum */
  int8_t *q;
  float *dx, *sum;
} qrow;

/* Where q4's rounded x keeps input k of block b. Blocks go in groups of g = WIDE (then 2,
   then 1 for what is left): a group's g * 16 even inputs (16 of each block) before its odd
   ones, the order in which one load of the group's codes unpacks into its low nibbles,
   then its high ones. */
INLINE long q4_slot(long b, int k, long nb) {
  const long quads = WIDE == 4 ? nb / 4 * 4 : 0, pairs = quads + (nb - quads) / 2 * 2;
  const long g = b < quads ? 4 : b < pairs ? 2 : 1;
  const long t = (b - (b < quads ? 0 : b < pairs ? quads : pairs)) % g; /* place in group */
  return (b - t) * BLOCK + (k % 2) * g * 16 + t * 16 + k / 2;
}

/* `split`: q4's order (`q4_slot`); otherwise the inputs' own order */
static void round_row(const float *restrict x, qrow r, long in, int split) {
  const long nb = in / BLOCK;
  for (long b = 0; b < nb; b++) {
    const float *v = x + b * BLOCK;
    float amax = 0.0f;
    for (int k = 0; k < BLOCK; k++) amax = fmaxf(amax, fabsf(v[k]));
    float dx = amax / 127.0f, inv = dx > 0.0f ? 1.0f / dx : 0.0f;
    int32_t sum = 0;
    for (int k = 0; k < BLOCK; k++) {
      int8_t q = (int8_t)lrintf(v[k] * inv);
      r.q[split ? q4_slot(b, k, nb) : b * BLOCK + k] = q, sum += q;
    }
    r.dx[b] = dx, r.sum[b] = dx * (float)sum; /* of the rounded x: W times one rounded x */
  }
}

static float half_to_float(uint16_t h) { /* finite fp16, exactly: place the bits, rescale */
  uint32_t bits = (uint32_t)(h & 0x7fff) << 13;
  float f;
  memcpy(&f, &bits, 4);
  f *= 0x1p112f;
  return h & 0x8000 ? -f : f;
}

#ifdef SIMD
INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE __m256 dot(__m256i u8, __m256i s8) { /* 32 byte products, summed in 8 lanes */
  __m256i pairs = _mm256_maddubs_epi16(u8, s8);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

INLINE void int8_rows(const int8_t *restrict W, const float *restrict S, const qrow *X,
                      float *restrict Y, long out, long in, const int n) {
  const long nb = in / BLOCK;
  for (long j = 0; j < out; j++) {
    const int8_t *w = W + j * in;
#ifdef SIMD
    __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                        _mm256_setzero_ps()};
    for (long b = 0; b < nb; b++) {
      __m256i q = _mm256_loadu_si256((const __m256i *)(w + b * BLOCK));
      __m256i u = _mm256_sign_epi8(q, q); /* |q| as unsigned bytes; its sign moves onto x */
      for (int r = 0; r < n; r++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(X[r].q + b * BLOCK));
        __m256 d = _mm256_broadcast_ss(X[r].dx + b);
        acc[r] = _mm256_fmadd_ps(dot(u, _mm256_sign_epi8(x, q)), d, acc[r]);
      }
    }
    for (int r = 0; r < n; r++) Y[r * out + j] = hsum(acc[r]) * S[j];
#else
    for (int r = 0; r < n; r++) {
      float acc = 0.0f;
      for (long b = 0; b < nb; b++) {
        int32_t t = 0;
        for (int k = 0; k < BLOCK; k++) t += w[b * BLOCK + k] * X[r].q[b * BLOCK + k];
        acc += (float)t * X[r].dx[b];
      }
      Y[r * out + j] = acc * S[j];
    }
#endif
  }
}

INLINE void q4_rows(const uint8_t *restrict W, const uint16_t *restrict D,
                    const uint16_t *restrict M, const qrow *X, float *restrict Y, long out,
                    long in, const int n) {
  const long nb = in / BLOCK;
  for (long j = 0; j < out; j++) {
    const uint8_t *w = W + j * (in / 2);
    const uint16_t *d = D + j * nb, *m = M + j * nb;
    float tail[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f}; /* what the scalar last block adds */
    long b = 0;
#ifdef SIMD
    /* per block: d * dx * (codes . rounded x) in the int32 lanes, m * (sum of rounded x) */
    __m256 acc[ROWS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                        _mm256_setzero_ps()};
    __m128 mins[ROWS] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
#if WIDE == 4
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 wide[ROWS] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
    for (; b + 4 <= nb; b += 4) { /* four blocks' 64 bytes; int32 lanes 4t..4t+3: block b + t */
      __m512i p = _mm512_loadu_si512(w + b * 16);
      __m512i lo = _mm512_and_si512(p, low4), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
      __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + b)));
      __m128 m4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(m + b)));
      for (int r = 0; r < n; r++) {
        const int8_t *x = X[r].q + b * BLOCK;
        __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
        sums = _mm512_dpbusd_epi32(sums, hi, _mm512_loadu_si512(x + 2 * BLOCK));
        __m128 s4 = _mm_mul_ps(d4, _mm_loadu_ps(X[r].dx + b));
        __m512 scale = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(s4));
        wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, wide[r]);
        mins[r] = _mm_fmadd_ps(m4, _mm_loadu_ps(X[r].sum + b), mins[r]);
      }
    }
    for (int r = 0; r < n; r++) {
      __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide[r]), 1));
      acc[r] = _mm256_add_ps(_mm512_castps512_ps256(wide[r]), upper);
    }
#endif
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (; b + 2 <= nb; b += 2) { /* two blocks' 32 bytes; int32 lanes 0-3: block b, 4-7: b + 1 */
      __m256i p = _mm256_loadu_si256((const __m256i *)(w + b * 16));
      __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
      int32_t d2, m2;
      memcpy(&d2, d + b, 4), memcpy(&m2, m + b, 4);
      __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d2)), mm = _mm_cvtph_ps(_mm_cvtsi32_si128(m2));
      for (int r = 0; r < n; r++) {
        const int8_t *x = X[r].q + b * BLOCK;
        __m256i even = _mm256_loadu_si256((const __m256i *)x);
        __m256i odd = _mm256_loadu_si256((const __m256i *)(x + BLOCK));
        /* int16 lanes: at most 4 x 15 x 127, no saturation */
        __m256i pairs =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
        __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        __m128 s2 = _mm_mul_ps(dd, _mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)(X[r].dx + b)));
        __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s2), halves);
        acc[r] = _mm256_fmadd_ps(sums, scale, acc[r]);
        __m128 sums2 = _mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)(X[r].sum + b));
        mins[r] = _mm_fmadd_ps(mm, sums2, mins[r]);
      }
    }
    if (b < nb) { /* the last block, alone: 16 low nibbles, then 16 high ones */
      __m128i p = _mm_loadu_si128((const __m128i *)(w + b * 16)), low16 = _mm_set1_epi8(15);
      __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), low16),
                                   _mm_and_si128(p, low16));
      const float db = half_to_float(d[b]), mb = half_to_float(m[b]);
      for (int r = 0; r < n; r++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(X[r].q + b * BLOCK));
        tail[r] = hsum(_mm256_mul_ps(dot(u, x), _mm256_set1_ps(db * X[r].dx[b])));
        tail[r] += mb * X[r].sum[b];
      }
    }
    for (int r = 0; r < n; r++) {
      __m128 mn = _mm_add_ps(mins[r], _mm_movehl_ps(mins[r], mins[r]));
      mn = _mm_add_ss(mn, _mm_movehdup_ps(mn));
      Y[r * out + j] = hsum(acc[r]) + _mm_cvtss_f32(mn) + tail[r];
    }
#else
    (void)tail, (void)b;
    for (int r = 0; r < n; r++) {
      float acc = 0.0f;
      for (long c = 0; c < nb; c++) {
        const uint8_t *p = w + c * 16;
        const int8_t *x = X[r].q;
        int32_t t = 0;
        for (int k = 0; k < 16; k++)
          t += (p[k] & 15) * x[q4_slot(c, 2 * k, nb)] + (p[k] >> 4) * x[q4_slot(c, 2 * k + 1, nb)];
        acc += (float)t * half_to_float(d[c]) * X[r].dx[c] + half_to_float(m[c]) * X[r].sum[c];
      }
      Y[r * out + j] = acc;
    }
#endif
  }
}

/* Up to four rows of X at a time: rounded to int8 into `rows`, then one pass over W. n is
   a constant in each call, so the compiler unrolls the loops over rows. */
#define EACH_PASS(split, body)                                                               \
  for (long m0 = 0; m0 < M; m0 += ROWS) {                                                    \
    const long n = M - m0 < ROWS ? M - m0 : ROWS;                                            \
    for (long r = 0; r < n; r++) round_row(X + (m0 + r) * in, rows[r], in, split);          \
    float *y = Y + m0 * out;                                                                 \
    if (n == 1) body(1);                                                                     \
    else if (n == 2) body(2);                                                                \
    else if (n == 3) body(3);                                                                \
    else body(4);                                                                            \
  }

static int scratch(qrow *rows, long in) { /* codes, scales and sums for ROWS rows */
  const long nb = in / BLOCK;
  char *buf = malloc(ROWS * in + sizeof(float) * ROWS * 2 * nb);
  if (buf == NULL) return -1;
  float *f = (float *)(buf + ROWS * in);
  for (int r = 0; r < ROWS; r++)
    rows[r] = (qrow){(int8_t *)buf + r * in, f + r * nb, f + (ROWS + r) * nb};
  return 0;
}

/* Both return 0, or -1 when the scratch memory cannot be allocated. in: a multiple of 32. */
int matvec_int8(const int8_t *W, const float *S, const float *X, float *Y, long M, long out,
                long in) {
  qrow rows[ROWS];
  if (scratch(rows, in) != 0) return -1;
#define INT8(k) int8_rows(W, S, rows, y, out, in, k)
  EACH_PASS(0, INT8)
  free(rows[0].q);
  return 0;
}

int matvec_q4(const uint8_t *W, const uint16_t *D, const uint16_t *Mn, const float *X, float *Y,
              long M, long out, long in) {
  qrow rows[ROWS];
  if (scratch(rows, in) != 0) return -1;
#define Q4(k) q4_rows(W, D, Mn, rows, y, out, in, k)
  EACH_PASS(1, Q4)
  free(rows[0].q);
  return 0;
}
