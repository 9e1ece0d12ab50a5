/* minillm's CPU matrix-vector product, for decode steps of a few rows.

   Y[m, j] = sum_i W[j, i] * X[m, i] (+ B[j]), W row-major [out, in] (nn.Linear's layout).
   Each weight row is one contiguous stream, read once for up to four rows of X, which stay
   in cache. `omp simd` lets the compiler keep each sum in SIMD lanes, one lane vector per
   row of X, all fed by one weight load. */

static void four_rows(const float *restrict W, const float *restrict X, const float *restrict B,
                      float *restrict Y, long n, long out, long in) {
  /* n (1..4) rows of X; missing rows point at row 0 and are not stored */
  const float *x0 = X, *x1 = X + (n > 1) * in, *x2 = X + (n > 2) * 2 * in,
              *x3 = X + (n > 3) * 3 * in;
  for (long j = 0; j < out; j++) {
    const float *w = W + j * in;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (n == 1) {
      float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
      for (long i = 0; i < in; i++) s0 += w[i] * x0[i];
      s[0] = s0;
    } else if (n == 2) {
      float s0 = 0.0f, s1 = 0.0f;
#pragma omp simd reduction(+ : s0, s1)
      for (long i = 0; i < in; i++) {
        s0 += w[i] * x0[i];
        s1 += w[i] * x1[i];
      }
      s[0] = s0, s[1] = s1;
    } else {
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (long i = 0; i < in; i++) {
        s0 += w[i] * x0[i];
        s1 += w[i] * x1[i];
        s2 += w[i] * x2[i];
        s3 += w[i] * x3[i];
      }
      s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
    }
    for (long m = 0; m < n; m++) Y[m * out + j] = B ? s[m] + B[j] : s[m];
  }
}

void matvec_f32(const float *restrict W, const float *restrict X, const float *restrict B,
                float *restrict Y, long M, long out, long in) {
  for (long m = 0; m < M; m += 4)  /* four rows of X a pass over W */
    four_rows(W, X + m * in, B, Y + m * out, M - m < 4 ? M - m : 4, out, in);
}
