/* minillm's CPU row ops for a decode step: RMSNorm and rotary embedding, each one pass in C
   where PyTorch runs seven or eight small ops, each with its own dispatch and temporary.
   At one token a step those ops cost more than their arithmetic (chapter 05 measures it). */

#include <math.h>

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
