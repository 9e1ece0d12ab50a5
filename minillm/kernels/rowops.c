/* minillm's CPU row ops for a decode step: RMSNorm, rotary embedding and the attention over
   a contiguous KV cache, each one pass in C where PyTorch runs several small ops, each with
   its own dispatch and temporary. At one token a step those ops cost more than their
   arithmetic (chapter 05 measures it). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Y[r] = W * (X[r] / sqrt(mean(X[r]^2) + eps)), in the order minillm's rms_norm computes it */
void rms_norm_f32(const float *restrict X, const float *restrict W, float *restrict Y, long rows,
                  long dim, float eps) {
  for (long r = 0; r < rows; r++) {
    const float *x = X + r * dim;
    float *y = Y + r * dim, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < dim; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (long i = 0; i < dim; i++) y[i] = W[i] * (x[i] * inv);
  }
}

/* Y [B, H, T, d] (contiguous) = X rotated: channel pairs (i, i + d/2) of X [B, H, T, d]
   (strides sb, sh, st; channels contiguous) turned by the angles whose cos and sin tables
   C, S [B, T, d] hold, as minillm's apply_rope: x * cos + rotate_half(x) * sin. */
void rope_f32(const float *restrict X, const float *restrict C, const float *restrict S,
              float *restrict Y, long B, long H, long T, long d, long sb, long sh, long st) {
  const long h = d / 2;
  for (long b = 0; b < B; b++)
    for (long n = 0; n < H; n++)
      for (long t = 0; t < T; t++) {
        const float *x = X + b * sb + n * sh + t * st, *c = C + (b * T + t) * d,
                    *s = S + (b * T + t) * d;
        float *y = Y + ((b * H + n) * T + t) * d;
#pragma omp simd
        for (long i = 0; i < h; i++) {
          y[i] = x[i] * c[i] - x[i + h] * s[i];
          y[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
        }
      }
}

/* e^x for x <= 0, to about 2e-7 relative, in plain arithmetic so that loops of it vectorize:
   x = k ln 2 + r with |r| <= ln 2 / 2, e^r from its Taylor series to r^7, 2^k built in the
   float's exponent bits. Below -87 (e^x under float's smallest normal) it returns 0. */
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float k = rintf(x * 1.44269504f);
  const float r = x - k * 0.693145752f - k * 1.42860677e-6f; /* ln 2 in two parts */
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = ((int32_t)k + 127) << 23;
  float two_k;
  memcpy(&two_k, &bits, 4);
  return x <= -87.0f ? 0.0f : p * two_k;
}

/* The attention of one kv head's `group` queries qh [group, d] over n cached slots whose K
   and V rows sit at K + slot[s] * stride (slot NULL: s itself): the scores of every query
   from one read of each K row, a softmax per query, then one read of each V row for the
   weighted sums oh [group, d]. w: group * n floats of scratch. */
static void attend_group(const float *restrict qh, float *restrict oh, long group, long d,
                         const float *restrict K, const float *restrict V,
                         const int64_t *restrict slot, long n, long stride, float scale,
                         float *restrict w) {
  for (long s = 0; s < n; s++) {
    const float *kr = K + (slot ? slot[s] : s) * stride;
    for (long g = 0; g < group; g++) {
      float t = 0.0f;
#pragma omp simd reduction(+ : t)
      for (long i = 0; i < d; i++) t += qh[g * d + i] * kr[i];
      w[g * n + s] = t * scale;
    }
  }
  for (long g = 0; g < group; g++) { /* softmax of each query's scores */
    float *wg = w + g * n, top = wg[0], sum = 0.0f;
    for (long s = 1; s < n; s++) top = wg[s] > top ? wg[s] : top;
#pragma omp simd reduction(+ : sum)
    for (long s = 0; s < n; s++) sum += (wg[s] = exp_neg(wg[s] - top));
    const float inv = 1.0f / sum;
#pragma omp simd
    for (long s = 0; s < n; s++) wg[s] *= inv;
    memset(oh + g * d, 0, sizeof(float) * d);
  }
  for (long s = 0; s < n; s++) {
    const float *vr = V + (slot ? slot[s] : s) * stride;
    for (long g = 0; g < group; g++) {
      const float ws = w[g * n + s];
#pragma omp simd
      for (long i = 0; i < d; i++) oh[g * d + i] += ws * vr[i];
    }
  }
}

/* One decode step's attention for a layer of a contiguous cache, K and V [B, Hkv, L, d]:
   write each row's new k, v [B, Hkv, d] at its position p (pos[b]), then attend its Hq
   queries q [B, Hq, d] over slots 0..min(p, kv_len - 1), as minillm's masked SDPA does.
   Grouped-query: a kv head's Hq / Hkv queries are scored together, so its K and V rows are
   read once, not once a query head. out [B, Hq, d]. Returns 0, -1 when the scratch memory
   cannot be allocated, -2 when a position is not a slot of the cache. */
int decode_attention_f32(float *restrict K, float *restrict V, const float *restrict q,
                         const float *restrict k, const float *restrict v,
                         const int64_t *restrict pos, float *restrict out, long B, long Hq,
                         long Hkv, long L, long d, long kv_len, float scale) {
  const long group = Hq / Hkv;
  float *w = malloc(sizeof(float) * group * (kv_len > 0 ? kv_len : 1));
  if (w == NULL) return -1;
  for (long b = 0; b < B; b++) {
    const long p = pos[b];
    if (p < 0 || p >= L) {
      free(w);
      return -2;
    }
    const long n = p + 1 < kv_len ? p + 1 : kv_len;
    for (long h = 0; h < Hkv; h++) {
      float *Kh = K + (b * Hkv + h) * L * d, *Vh = V + (b * Hkv + h) * L * d;
      memcpy(Kh + p * d, k + (b * Hkv + h) * d, sizeof(float) * d);
      memcpy(Vh + p * d, v + (b * Hkv + h) * d, sizeof(float) * d);
      attend_group(q + (b * Hq + h * group) * d, out + (b * Hq + h * group) * d, group, d, Kh,
                   Vh, NULL, n, d, scale, w);
    }
  }
  free(w);
  return 0;
}

/* The same for decode rows of a paged pool, K and V [blocks, bs, Hkv, d] (K/V already
   written): row r's query heads q [R, Hq, d] attend its first lens[r] tokens, token s in
   block tables[r, s / bs] at offset s % bs (tables [R, width]). out [R, Hq, d]. Returns 0,
   -1 when the scratch memory cannot be allocated, -2 when a length needs more blocks than
   its table holds or a block is not in the pool. */
int paged_attention_f32(const float *restrict K, const float *restrict V,
                        const float *restrict q, const int64_t *restrict tables,
                        const int64_t *restrict lens, float *restrict out, long R, long Hq,
                        long Hkv, long blocks, long bs, long width, long d, float scale) {
  const long group = Hq / Hkv;
  long longest = 1;
  for (long r = 0; r < R; r++) longest = lens[r] > longest ? lens[r] : longest;
  float *w = malloc(sizeof(float) * group * longest);
  int64_t *slot = malloc(sizeof(int64_t) * longest);
  int status = w == NULL || slot == NULL ? -1 : 0;
  for (long r = 0; r < R && status == 0; r++) {
    const long n = lens[r];
    if (n < 1 || n > width * bs) status = -2;
    for (long s = 0; s < n && status == 0; s++) {
      const int64_t block = tables[r * width + s / bs];
      if (block < 0 || block >= blocks) status = -2;
      slot[s] = block * bs + s % bs; /* the slot's row of Hkv heads */
    }
    for (long h = 0; h < Hkv && status == 0; h++)
      attend_group(q + (r * Hq + h * group) * d, out + (r * Hq + h * group) * d, group, d,
                   K + h * d, V + h * d, slot, n, Hkv * d, scale, w);
  }
  free(w), free(slot);
  return status;
}
