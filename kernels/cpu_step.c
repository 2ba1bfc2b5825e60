/* The whole forward of a Llama-family target for a few tokens, float32 on CPU, in one call: one OpenMP region
 * runs every layer, the matrix products split by panels of output rows across threads, everything else (norms,
 * RoPE, KV writes, attention, SiLU) between barriers, so a small step pays no per-op dispatch (docs/kernels.md).
 * Built at first use by kernels/cpu_step.py for this CPU; PyTorch's path stays the reference and the fallback.
 *
 * Semantics match verify_server.model_runner.ModelRunner.forward: row m of the batch is the token at position pos[m]
 * of the session whose block table is row m of `tables`; position p of it lives at pool row
 * table[p / block_size] * block_size + p % block_size. Its key and value are written there, then it attends over
 * positions [0, pos[m]] of its session.
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h> /* __m256 / __m512 and their max instructions (vmax) */
#endif

/* Vector width and the register blocking of the matrix products. Every weight matrix is packed once
 * (kernels/cpu_step.py) into panels of NR = NV * VL output features, each panel K rows of NR floats
 * (P[p][k][j] = W[p NR + j][k], the last panel padded with zeros). A block of MR batch rows by one panel keeps
 * MR x NV accumulators in registers: no horizontal sums, and the weights stream from one contiguous panel. The
 * accumulators, the NV weight vectors and one broadcast must fit in the registers: AVX2 6 x 2, AVX-512 up to 8 rows
 * where two blocks take the batch and 6 where more are needed (MR, MR_MANY). Each can be set with -D (SLED_VBYTES, NV,
 * MR, MR_MANY) to compare builds; the tests build several. The measurements: docs/kernels.md. */
#if defined(__AVX512F__)
#define SLED_DEFAULT_VBYTES 64
#else
#define SLED_DEFAULT_VBYTES 32
#endif
#ifndef SLED_VBYTES
#define SLED_VBYTES SLED_DEFAULT_VBYTES
#endif
#ifndef NV
#define NV 2
#endif
#ifndef MR
#if SLED_VBYTES * NV >= 128
#define MR 8
#else
#define MR 6
#endif
#endif
#ifndef MR_MANY /* see gemv: the most rows a block where more than two blocks are needed */
#define MR_MANY (MR < 6 ? MR : 6)
#endif
#ifndef SLED_KC_SPLIT_FROM /* see gemv: with SLED_KC, the fewest rows that one block would take, taken as two */
#define SLED_KC_SPLIT_FROM 0
#endif
#ifndef SLED_KC_BLOCKS /* see gemv: the most row blocks a chunked panel keeps sums for */
#define SLED_KC_BLOCKS 6
#endif
#ifndef SLED_KC /* see gemv: k rows a chunk where a panel's row blocks take it chunk by chunk; 0: whole panels */
#define SLED_KC 0
#endif
#ifndef SLED_PREFETCH_SPREAD
#define SLED_PREFETCH_SPREAD 1 /* see gemv; 0 prefetches the next panel in the first block only */
#endif
#ifndef SLED_BALANCED_BLOCKS
#define SLED_BALANCED_BLOCKS 1 /* see gemv; 0 fills each block (MR or MR_MANY rows) and leaves the rest to the last */
#endif
#ifndef SLED_PREFETCH_MIN_ROWS /* see gemv: the fewest batch rows for which the next panel is prefetched */
#if SLED_VBYTES * NV >= 128
#define SLED_PREFETCH_MIN_ROWS 8
#else
#define SLED_PREFETCH_MIN_ROWS 3
#endif
#endif
#if SLED_KC < 0
#error "SLED_KC must be 0 (whole panels) or a positive number of k rows"
#endif
#if MR < 1 || MR > 8 || NV < 1 || MR_MANY < 1 || MR_MANY > MR
#error "MR (batch rows per block) must be 1 to 8, MR_MANY 1 to MR and NV positive"
#endif
typedef float vf __attribute__((vector_size(SLED_VBYTES)));
typedef float vfu __attribute__((vector_size(SLED_VBYTES), aligned(4), may_alias));
#define VL (SLED_VBYTES / 4)
#define NR (NV * VL)

/* The panel width the weights must be packed to (kernels/cpu_step.py asks). */
int64_t sled_panel_width(void) { return NR; }

static inline vf vload(const float *p) { return *(const vfu *)p; }

/* One float in every lane, read straight from memory (vbroadcastss m32). Not `(vf){0} + s`: without -ffast-math the
 * compiler must keep the addition of +0, a scalar add and a shuffle on the ports the FMAs need. */
static inline vf splat(const float *s) {
#if SLED_VBYTES == 16
    return (vf){*s, *s, *s, *s};
#elif SLED_VBYTES == 32
    return (vf){*s, *s, *s, *s, *s, *s, *s, *s};
#elif SLED_VBYTES == 64
    return (vf){*s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s};
#else
#error "SLED_VBYTES must be 16, 32 or 64"
#endif
}

static inline float hsum(vf v) {
#if defined(__AVX512F__) && SLED_VBYTES == 64  /* not for a narrower width forced with -D on an AVX-512 CPU */
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.f;
    for (int i = 0; i < VL; ++i) s += v[i];
    return s;
#endif
}

/* e^x for VL lanes, inputs clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor
 * polynomial, 2^n put into the exponent bits; within 1e-7 relative of exp (sled_exp, tested). Softmax and SiLU
 * call it per element: scalar expf cost a step several ms at 9 or more rows (one call per row, head and key). */
typedef int32_t vi __attribute__((vector_size(SLED_VBYTES)));
static inline vf vselect(vi mask, vf a, vf b) {  /* a where mask, else b */
    vi ai, bi;
    __builtin_memcpy(&ai, &a, sizeof a);
    __builtin_memcpy(&bi, &b, sizeof b);
    vi r = (ai & mask) | (bi & ~mask);
    vf out;
    __builtin_memcpy(&out, &r, sizeof out);
    return out;
}
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    x = vselect(x < lo, lo, x);
    x = vselect(x > hi, hi, x);
    /* n = round(x / ln2), as floor(x / ln2 + 0.5) over a positive range, since conversion truncates */
    vi ni = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, vi) - 128;
    vf n = __builtin_convertvector(ni, vf);
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln2 in two parts: n * 0.693359375 is exact */
    vf p = (vf){0} + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi bits = (ni + 127) << 23;
    vf scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* e^x of n floats in place */
static void exp_inplace(float *v, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf x;
        __builtin_memcpy(&x, v + i, sizeof x);
        x = vexp(x);
        __builtin_memcpy(v + i, &x, sizeof x);
    }
    if (i < n) {
        vf x = (vf){0};
        __builtin_memcpy(&x, v + i, (size_t)(n - i) * sizeof(float));
        x = vexp(x);
        __builtin_memcpy(v + i, &x, (size_t)(n - i) * sizeof(float));
    }
}

void sled_exp(float *v, int64_t n) { exp_inplace(v, n); }

static inline vf vmax(vf a, vf b) {
#if defined(__AVX512F__) && SLED_VBYTES == 64
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__) && SLED_VBYTES == 32
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return vselect(a > b, a, b);
#endif
}

/* Per row of a row-major [rows, n] float32 matrix (the target's logits): whether every value is finite, and
 * the index of its largest value, the first where several are equal (torch.argmax's choice); -1 for a row that
 * is not finite. The verifier needs both for every row, greedy or not; through PyTorch they were three passes
 * (amax and amin for the check, argmax, which is not vectorized on CPU: 1.0 of 1.2 ms for 80 rows of 49,152).
 * Here one vectorized pass takes the lanes' maxima and sums x * 0 (NaN exactly where some x is NaN or an
 * infinity), four vectors at a time against the adds' latency; then a scan finds the first index of the maximum,
 * a vector at a time, mostly from cache. Rows split over threads. */
void sled_row_argmax(const float *x, int64_t rows, int64_t n, int64_t *index, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        vf b0 = (vf){0} - INFINITY, b1 = b0, b2 = b0, b3 = b0;
        vf z0 = (vf){0}, z1 = z0, z2 = z0, z3 = z0;
        int64_t i = 0;
        for (; i + 4 * VL <= n; i += 4 * VL) {
            vf v0 = vload(row + i), v1 = vload(row + i + VL), v2 = vload(row + i + 2 * VL), v3 = vload(row + i + 3 * VL);
            b0 = vmax(b0, v0), b1 = vmax(b1, v1), b2 = vmax(b2, v2), b3 = vmax(b3, v3);
            z0 += v0 * 0.0f, z1 += v1 * 0.0f, z2 += v2 * 0.0f, z3 += v3 * 0.0f;
        }
        for (; i + VL <= n; i += VL) {
            vf v = vload(row + i);
            b0 = vmax(b0, v);
            z0 += v * 0.0f;
        }
        vf best = vmax(vmax(b0, b1), vmax(b2, b3)), zero = (z0 + z1) + (z2 + z3);
        float m = -INFINITY;
        int nonfinite = 0;
        for (int l = 0; l < VL; ++l) {
            nonfinite |= zero[l] != 0.0f;  /* NaN: some lane saw a NaN or an infinity */
            if (best[l] > m) m = best[l];
        }
        for (; i < n; ++i) {
            float v = row[i];
            nonfinite |= !isfinite(v);
            if (v > m) m = v;
        }
        int64_t at = -1, j = 0;
        if (!nonfinite) {
            const vf mv = (vf){0} + m;
            for (; j + VL <= n; j += VL) {  /* a vector at a time to the first holding m, then its lane */
                vi hit = vload(row + j) == mv;
                int any = 0;
                for (int l = 0; l < VL; ++l) any |= hit[l];
                if (any) break;
            }
            for (; j < n; ++j) {
                if (row[j] == m) {
                    at = j;
                    break;
                }
            }
        }
        index[r] = at;
    }
}

struct sled_layer {
    const float *ln1, *ln2;            /* [hidden] */
    /* weights packed in panels (see above) of the row-major matrices named; a bias or NULL */
    const float *wqkv, *bqkv;          /* [nq + 2 nkv, hidden] (q, k, v stacked) */
    const float *wo, *bo;              /* [hidden, nq] */
    const float *wgu, *bgu;            /* [2 inter, hidden] (gate, up stacked) */
    const float *wd, *bd;              /* [hidden, inter] */
    float *k_cache, *v_cache;          /* [kv_heads, pool_rows, head_dim], this layer */
    const float *qn, *kn;              /* [head_dim] RMSNorm of each q and k head before RoPE (Qwen3), or NULL */
    const float *pn1, *pn2;            /* [hidden] norms of the attention's and the MLP's outputs (Gemma), or NULL */
    const float *cos, *sin_signed;     /* [max_seq, head_dim] this layer's RoPE tables */
    int64_t window;                    /* sliding window: each query sees its last `window` positions (0: all) */
};

struct sled_model {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, max_seq;
    int64_t block_size, head_stride;   /* positions a block; the pool's stride in floats per kv head */
    int64_t gelu;                      /* the MLP's activation: 0 SiLU, 1 GELU's tanh approximation (Gemma) */
    float eps, scale;
    const float *norm, *lm_head, *lm_bias; /* final norm [hidden], logits projection [vocab, hidden] packed */
    const struct sled_layer *layers;
};

/* The value v, as the compiler must take it: in a vector register (an empty asm that may have changed it there), so
 * that no later use folds a load from memory in its place. See SLED_BLOCK. Where the vector is not one register of
 * the target (a layout wider than its vectors, which the tests build), nothing. */
#if (SLED_VBYTES == 16 && defined(__SSE__)) || (SLED_VBYTES == 32 && defined(__AVX__)) ||                      \
    (SLED_VBYTES == 64 && defined(__AVX512F__))
#define SLED_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define SLED_IN_REGISTER(v) ((void)0)
#endif

/* c = x[0:mb, :] times one panel: c[m][v] holds outputs v VL .. v VL + VL - 1 of the panel for batch row m.
 * Each step over k also prefetches the bytes pf + k * pfstep .. + pfstep, a line each: gemv passes its share of the
 * next panel, or a step of 0 for none. With `more`, the sums go on from c (the panel's earlier k rows, a chunk
 * before: the same additions in the same order as in one pass). */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, int mb, const float *p,
                                                         int64_t K, vf c[MR][NV], const char *pf, int64_t pfstep,
                                                         int more) {
    vf acc[MR][NV];  /* local, so they live in registers; c is written once at the end */
    for (int m = 0; m < MR; ++m)
        for (int v = 0; v < NV; ++v) acc[m][v] = more && m < mb ? c[m][v] : (vf){0};
    for (int64_t k = 0; k < K; ++k) {
        vf w[NV];
        for (int64_t o = 0; o < pfstep; o += 64) __builtin_prefetch(pf + k * pfstep + o, 0, 1);
        for (int v = 0; v < NV; ++v) {
            w[v] = vload(p + k * NR + v * VL);
            SLED_IN_REGISTER(w[v]);
        }
        for (int m = 0; m < MR; ++m) {
            if (m >= mb) break;
            vf b = splat(x + m * ldx + k);
            for (int v = 0; v < NV; ++v) acc[m][v] += w[v] * b;
        }
    }
    for (int m = 0; m < mb; ++m)
        for (int v = 0; v < NV; ++v) c[m][v] = acc[m][v];
}

/* One function per row count, each compiled on its own: inlined into gemv, GCC folded a weight load into every FMA
 * and the loop ran load-bound. Apart, each loop is NV loads, MR broadcasts and MR x NV FMAs; SLED_IN_REGISTER keeps
 * the weight vectors in registers in the 2- to 4-row loops too. */
#define SLED_BLOCK(R)                                                                                           \
    static __attribute__((noinline)) void block_##R(const float *x, int64_t ldx, const float *p, int64_t K,    \
                                                    vf c[MR][NV], const char *pf, int64_t pfstep, int more) {  \
        block(x, ldx, R, p, K, c, pf, pfstep, more);                                                          \
    }
SLED_BLOCK(1)
#if MR >= 2
SLED_BLOCK(2)
#endif
#if MR >= 3
SLED_BLOCK(3)
#endif
#if MR >= 4
SLED_BLOCK(4)
#endif
#if MR >= 5
SLED_BLOCK(5)
#endif
#if MR >= 6
SLED_BLOCK(6)
#endif
#if MR >= 7
SLED_BLOCK(7)
#endif
#if MR >= 8
SLED_BLOCK(8)
#endif

/* One block of mb rows over kc k rows of a panel (pk), each row count its own loop. */
static inline __attribute__((always_inline)) void run_block(int mb, const float *xm, int64_t ldx, const float *pk,
                                                             int64_t kc, vf c[MR][NV], const char *pf, int64_t pfstep,
                                                             int more) {
    switch (mb) {
    case 1: block_1(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#if MR >= 2
    case 2: block_2(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 3
    case 3: block_3(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 4
    case 4: block_4(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 5
    case 5: block_5(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 6
    case 6: block_6(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 7
    case 7: block_7(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
#if MR >= 8
    case 8: block_8(xm, ldx, pk, kc, c, pf, pfstep, more); break;
#endif
    }
}

/* y[m0 .. m0 + mb, n0 .. n0 + nn] from a block's sums, plus the bias. */
static inline __attribute__((always_inline)) void store_block(vf c[MR][NV], int mb, int64_t m0, int64_t n0,
                                                               int64_t nn, const float *b, float *y, int64_t ldy,
                                                               int accumulate) {
    for (int m = 0; m < mb; ++m) {
        float out[NR];
        __builtin_memcpy(out, c[m], sizeof out);
        float *ym = y + (m0 + m) * ldy + n0;
        for (int64_t j = 0; j < nn; ++j) {
            float v = out[j] + (b ? b[n0 + j] : 0.f);
            ym[j] = accumulate ? ym[j] + v : v;
        }
    }
}

/* y[m, n] = (accumulate ? y[m, n] : 0) + b[n] + sum_k x[m, k] w[n, k] for w packed in panels (p), the panels split
 * across threads; each thread runs its panel over every block of batch rows while the panel is in cache.
 * - From SLED_PREFETCH_MIN_ROWS rows the thread's next panel is prefetched meanwhile, each block its share, spread
 *   over its steps (SLED_PREFETCH_SPREAD; 0: the first block asks for it all, which stalls on its own misses).
 * - The rows run as ceil(M / MR) blocks (ceil(M / MR_MANY) past two) of nearly equal height (SLED_BALANCED_BLOCKS;
 *   0: full blocks and the rest in the last), so each block's share of the prefetch is equal.
 * - With SLED_KC, a panel of 2 to SLED_KC_BLOCKS blocks is taken SLED_KC k rows at a time by every block, its sums
 *   kept between chunks (the same additions in the same order), so the later blocks read the chunk from L1, not L2;
 *   with SLED_KC_SPLIT_FROM a batch of that many rows or more that one block would take is taken as two.
 * kernels/cpu_step.py chooses these per CPU (host_defines); why: docs/kernels.md. */
static void gemv(const float *x, int64_t ldx, int64_t M, const float *p, const float *b, float *y, int64_t ldy,
                 int64_t N, int64_t K, int accumulate) {
    int64_t npanels = (N + NR - 1) / NR;
    /* the same row blocks for every panel */
    int64_t nb = M <= 2 * MR ? (M + MR - 1) / MR : (M + MR_MANY - 1) / MR_MANY;
    if (SLED_KC > 0 && SLED_KC_SPLIT_FROM > 0 && nb == 1 && M >= SLED_KC_SPLIT_FROM) nb = 2;  /* see above */
    int64_t base = nb ? M / nb : 0, extra = nb ? M % nb : 0;  /* M = 0: no logits */
#if !SLED_BALANCED_BLOCKS
    base = M <= 2 * MR ? MR : MR_MANY, extra = 0;
#endif
    /* Whole panels keep a loop of their own, apart from the chunked one below. */
    if (!(SLED_KC > 0 && nb >= 2 && nb <= SLED_KC_BLOCKS)) {  /* whole panels */
#pragma omp for schedule(static)
        for (int64_t q = 0; q < npanels; ++q) {
            const float *pq = p + q * K * NR;
            int64_t n0 = q * NR, nn = N - n0 < NR ? N - n0 : NR;
            for (int64_t i = 0, m0 = 0, h; i < nb; ++i, m0 += h) {
                h = base + (i < extra);
                if (h > M - m0) h = M - m0;  /* the last of MR-row blocks */
                int mb = (int)h;
                vf c[MR][NV];
                const char *pf = NULL;
                int64_t pfstep = 0;  /* no prefetch */
                if (M >= SLED_PREFETCH_MIN_ROWS && q + 1 < npanels) {
                    const char *next = (const char *)(pq + K * NR);
                    pfstep = NR * (int64_t)sizeof(float);
#if SLED_PREFETCH_SPREAD
                    /* block i of nb: its share of the next panel's K rows, a share of a row a step */
                    pf = next + i * K / nb * NR * (int64_t)sizeof(float);
                    pfstep /= nb;
#else
                    if (m0 == 0) pf = next;  /* the first block prefetches it all */
                    else pfstep = 0;
#endif
                }
                run_block(mb, x + m0 * ldx, ldx, pq, K, c, pf, pfstep, 0);
                store_block(c, mb, m0, n0, nn, b, y, ldy, accumulate);
            }
        }
        return;
    }
    /* chunked: each chunk of SLED_KC k rows by every block in turn, the blocks' sums kept between chunks */
    const int64_t row = NR * (int64_t)sizeof(float);
#pragma omp for schedule(static)
    for (int64_t q = 0; q < npanels; ++q) {
        const float *pq = p + q * K * NR;
        const char *next = q + 1 < npanels ? (const char *)(pq + K * NR) : NULL;
        int64_t n0 = q * NR, nn = N - n0 < NR ? N - n0 : NR;
        vf sums[SLED_KC_BLOCKS][MR][NV];
        for (int64_t k0 = 0; k0 < K; k0 += SLED_KC) {
            int64_t kc = K - k0 < SLED_KC ? K - k0 : SLED_KC;
            /* what this chunk's blocks prefetch: the panel's next chunk, or the next panel's first */
            const char *after = k0 + kc < K ? (const char *)(pq + (k0 + kc) * NR) : next;
            int64_t after_rows = k0 + kc < K ? (K - k0 - kc < SLED_KC ? K - k0 - kc : SLED_KC)
                                             : (K < SLED_KC ? K : SLED_KC);
            for (int64_t i = 0, m0 = 0, h; i < nb; ++i, m0 += h) {
                h = base + (i < extra);
                if (h > M - m0) h = M - m0;  /* the last of MR-row blocks */
                int mb = (int)h;
                const char *pf = NULL;
                int64_t pfstep = 0;  /* no prefetch */
                if (M >= SLED_PREFETCH_MIN_ROWS && after) {
#if SLED_PREFETCH_SPREAD
                    /* block i of nb: its share of those rows, evenly over its steps */
                    pf = after + i * after_rows / nb * row;
                    pfstep = row * after_rows / kc / nb;
#else
                    if (m0 == 0) pf = after, pfstep = row * after_rows / kc;  /* the first block prefetches it all */
#endif
                }
                run_block(mb, x + m0 * ldx + k0, ldx, pq + k0 * NR, kc, sums[i], pf, pfstep, k0 > 0);
                if (k0 + kc == K) store_block(sums[i], mb, m0, n0, nn, b, y, ldy, accumulate);
            }
        }
    }
}

/* out = x / rms(x) * weight over n values (out may be x). */
static inline void norm_row(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

/* out[m] = x[m] / rms(x[m]) * weight, for the rows listed (or all M rows when rows is NULL). */
static void rms_norm(const float *x, int64_t M, const int64_t *rows, const float *weight, float *out, int64_t H,
                     float eps) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) norm_row(x + (rows ? rows[m] : m) * H, weight, out + m * H, H, eps);
}

static void rope(float *v, const float *cos, const float *sin_signed, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; ++i) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] + b * sin_signed[i];
        v[i + half] = b * cos[i + half] + a * sin_signed[i + half];
    }
}

#if SLED_VBYTES == 32
/* Lanes of a then b picked by index (0-7 from a, 8-15 from b): Clang's and GCC 12's __builtin_shufflevector, or
 * GCC's older __builtin_shuffle with the indices as a vector (GCC 11, e.g. Ubuntu 22.04; SLED_GCC_SHUFFLE=1
 * forces it, which the tests build). */
#if !defined(SLED_GCC_SHUFFLE) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SLED_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef SLED_SHUF
#define SLED_SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
/* The sums of 8 vectors of 8 floats, as one vector: three rounds of pairing lanes (shuffles and adds) instead of a
 * horizontal sum each (7 dependent scalar adds and their shuffles). */
static inline vf hsum8(const vf a[8]) {
    vf b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = SLED_SHUF(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               SLED_SHUF(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        c[i] = SLED_SHUF(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SLED_SHUF(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SLED_SHUF(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) + SLED_SHUF(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

/* scores = q K^T * scale over ctx consecutive keys of one head.
 * With 8-float vectors the scores come 8 keys at a time (hsum8): a horizontal sum per key was most of the
 * attention's time (perf, 16 tokens over 200 cached, AVX2 EPYC: the scalar adds and shuffles of hsum and the
 * score's store about half of the forward outside the matrix products). */
static inline __attribute__((always_inline)) void score_run(const float *q, const float *K, int64_t ctx, int64_t hd,
                                                             float scale, float *scores) {
    int64_t j = 0;
#if SLED_VBYTES == 32
    if (hd % VL == 0) {
        for (; j + VL <= ctx; j += VL) {
            vf a[VL];
            for (int t = 0; t < VL; ++t) {
                const float *kj = K + (j + t) * hd;
                a[t] = vload(q) * vload(kj);
                for (int64_t d = VL; d < hd; d += VL) a[t] += vload(q + d) * vload(kj + d);
            }
            vf r = hsum8(a) * scale;
            __builtin_memcpy(scores + j, &r, sizeof r);
        }
    }
#endif
    for (; j < ctx; ++j) {
        const float *kj = K + j * hd;
        float s = 0.f;
        int64_t d = 0;
        if (hd >= VL) {
            vf a = vload(q) * vload(kj);
            for (d = VL; d + VL <= hd; d += VL) a += vload(q + d) * vload(kj + d);
            s = hsum(a);
        }
        for (; d < hd; ++d) s += q[d] * kj[d];
        scores[j] = s * scale;
    }
}

/* o = softmax(q K^T * scale) V over positions lo .. ctx - 1 of a session, whose keys and values sit in blocks of bs
 * rows: block b of it at rows tab[b] * bs of K and V (one head's rows of the pool); scores: ctx floats of scratch,
 * read from lo. */
static inline __attribute__((always_inline)) void attend(const float *q, const float *K, const float *V,
                                                          const int64_t *tab, int64_t bs, int64_t lo, int64_t ctx,
                                                          int64_t hd, float scale, float *scores, float *o) {
    for (int64_t b = lo / bs, j0 = b * bs; j0 < ctx; ++b, j0 += bs) {
        int64_t a = j0 < lo ? lo - j0 : 0, n = ctx - j0 < bs ? ctx - j0 : bs;
        score_run(q, K + (tab[b] * bs + a) * hd, n - a, hd, scale, scores + j0 + a);
    }
    tab += lo / bs;  /* from here on, the blocks from lo's, the scores from lo, ctx counted from the first block */
    scores += lo / bs * bs;
    int64_t skip = lo % bs;
    ctx -= lo / bs * bs;
    int64_t j;
    /* the largest score, then e^(s - max) and their sum, a vector at a time */
    float mx = -INFINITY, *s = scores + skip;
    int64_t len = ctx - skip;
    j = 0;
    if (len >= VL) {
        vf m = vload(s);
        for (j = VL; j + VL <= len; j += VL) m = vmax(m, vload(s + j));
        for (int l = 0; l < VL; ++l) mx = m[l] > mx ? m[l] : mx;
    }
    for (; j < len; ++j) mx = s[j] > mx ? s[j] : mx;
    for (j = 0; j < len; ++j) s[j] -= mx;
    exp_inplace(s, len);
    float sum = 0.f;
    j = 0;
    if (len >= VL) {
        vf acc = vload(s);
        for (j = VL; j + VL <= len; j += VL) acc += vload(s + j);
        sum = hsum(acc);
    }
    for (; j < len; ++j) sum += s[j];
    float inv = 1.0f / sum;
    if (hd % VL == 0 && hd <= 128) {  /* the output row in registers: 8 vectors of 16 or 16 of 8 at 128 */
        vf acc[128 / VL];
        for (int c = 0; c < 128 / VL; ++c) acc[c] = (vf){0};
        for (int64_t b = 0, j0 = 0; j0 < ctx; ++b, j0 += bs) {
            const float *Vb = V + tab[b] * bs * hd;
            for (int64_t j = j0 ? 0 : skip, n = ctx - j0 < bs ? ctx - j0 : bs; j < n; ++j) {
                float p = scores[j0 + j] * inv;
                for (int64_t c = 0; c < hd / VL; ++c) acc[c] += p * vload(Vb + j * hd + c * VL);
            }
        }
        for (int64_t c = 0; c < hd / VL; ++c) __builtin_memcpy(o + c * VL, &acc[c], sizeof acc[c]);
    } else {
        for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
        for (int64_t b = 0, j0 = 0; j0 < ctx; ++b, j0 += bs) {
            const float *Vb = V + tab[b] * bs * hd;
            for (int64_t j = j0 ? 0 : skip, n = ctx - j0 < bs ? ctx - j0 : bs; j < n; ++j) {
                float p = scores[j0 + j] * inv;
                for (int64_t d = 0; d < hd; ++d) o[d] += p * Vb[j * hd + d];
            }
        }
    }
}

/* h += x W^T + b, or with a norm of the output (Gemma's post-attention and post-MLP norms) h += norm(x W^T + b),
 * the product then made in post [M, H] first. */
static void residual(const float *x, int64_t K, int64_t M, const float *w, const float *b, const float *norm,
                     float *post, float *h, int64_t H, float eps) {
    if (!norm) {
        gemv(x, K, M, w, b, h, H, H, K, 1);
        return;
    }
    gemv(x, K, M, w, b, post, H, H, K, 0);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        norm_row(post + m * H, norm, post + m * H, H, eps);
        for (int64_t i = 0; i < H; ++i) h[m * H + i] += post[m * H + i];
    }
}

/* tables: [M, width] the block table of each row's session. Returns 0, or -1 when a row's position or a block it
 * reads is out of range (checked before anything is written). */
int sled_forward(const struct sled_model *md, int64_t M, float *h, const int64_t *pos, const int64_t *tables,
                 int64_t width, int64_t num_blocks, int64_t num_logit_rows, const int64_t *logit_rows, float *logits,
                 float *scratch, int nthreads) {
    const int64_t H = md->hidden, nh = md->num_heads, nkv = md->num_kv_heads, hd = md->head_dim;
    const int64_t I = md->inter, nq = nh * hd, nk = nkv * hd, nqkv = nq + 2 * nk, groups = nh / nkv;
    const int64_t bs = md->block_size;
    for (int64_t m = 0; m < M; ++m) {
        if (pos[m] < 0 || pos[m] >= md->max_seq || pos[m] / bs >= width) return -1;
        for (int64_t b = 0; b <= pos[m] / bs; ++b)
            if (tables[m * width + b] < 0 || tables[m * width + b] >= num_blocks) return -1;
    }
    for (int64_t m = 0; m < num_logit_rows; ++m)
        if (logit_rows[m] < 0 || logit_rows[m] >= M) return -1;
    /* scratch: xn [M, max(H, I)], qkv [M, nqkv], attn [M, nq], gu [M, 2I], post [M, H], scores [nthreads, max_seq] */
    float *xn = scratch;
    float *qkv = xn + M * (H > I ? H : I);
    float *attn = qkv + M * nqkv;
    float *gu = attn + M * nq;
    float *post = gu + M * 2 * I;
    float *scores_all = post + M * H;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        float *scores = scores_all + (int64_t)omp_get_thread_num() * md->max_seq;
#else
        float *scores = scores_all;
#endif
        for (int64_t l = 0; l < md->num_layers; ++l) {
            const struct sled_layer *L = &md->layers[l];
            rms_norm(h, M, NULL, L->ln1, xn, H, md->eps);
            gemv(xn, H, M, L->wqkv, L->bqkv, qkv, nqkv, nqkv, H, 0);
            /* the q and k heads' norms where the family has them, RoPE, then k and v into the cache */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M * (nh + nkv); ++t) {
                int64_t m = t / (nh + nkv), head = t % (nh + nkv);
                const float *c = L->cos + pos[m] * hd, *s = L->sin_signed + pos[m] * hd;
                float *v = qkv + m * nqkv + head * hd;  /* q heads, then k heads */
                const float *head_weight = head < nh ? L->qn : L->kn;
                if (head_weight) norm_row(v, head_weight, v, hd, md->eps);
                rope(v, c, s, hd);
                if (head >= nh) {
                    int64_t kh = head - nh;
                    int64_t row = tables[m * width + pos[m] / bs] * bs + pos[m] % bs;
                    int64_t at = kh * md->head_stride + row * hd;
                    const float *vv = qkv + m * nqkv + nq + nk + kh * hd;
                    for (int64_t d = 0; d < hd; ++d) {
                        L->k_cache[at + d] = v[d];
                        L->v_cache[at + d] = vv[d];
                    }
                }
            }
            /* attention: each (row, head) over positions [0, pos] of the row's session */
#pragma omp for schedule(static)
            for (int64_t t = 0; t < M * nh; ++t) {
                int64_t m = t / nh, head = t % nh, kh = head / groups, ctx = pos[m] + 1;
                int64_t lo = L->window > 0 && ctx > L->window ? ctx - L->window : 0;
                const float *q = qkv + m * nqkv + head * hd;
                const float *K = L->k_cache + kh * md->head_stride, *V = L->v_cache + kh * md->head_stride;
                const int64_t *tab = tables + m * width;
                float *o = attn + m * nq + head * hd;
                switch (hd) {  /* the common head sizes with their vector count known, so it stays in registers */
                case 64: attend(q, K, V, tab, bs, lo, ctx, 64, md->scale, scores, o); break;
                case 128: attend(q, K, V, tab, bs, lo, ctx, 128, md->scale, scores, o); break;
                default: attend(q, K, V, tab, bs, lo, ctx, hd, md->scale, scores, o); break;
                }
            }
            residual(attn, nq, M, L->wo, L->bo, L->pn1, post, h, H, md->eps);
            rms_norm(h, M, NULL, L->ln2, xn, H, md->eps);
            gemv(xn, H, M, L->wgu, L->bgu, gu, 2 * I, 2 * I, H, 0);
            /* act(gate) * up, act(g) = g * sigmoid(a g'): SiLU, or GELU's tanh approximation, where
             * 0.5 (1 + tanh(y)) = sigmoid(2 y) with y = sqrt(2 / pi) (g + 0.044715 g^3) */
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; ++m) {
                const float *g = gu + m * 2 * I, *u = g + I;
                float *out = xn + m * I;
                if (md->gelu)
                    for (int64_t i = 0; i < I; ++i)
                        out[i] = -1.5957691216057308f * (g[i] + 0.044715f * g[i] * g[i] * g[i]);
                else
                    for (int64_t i = 0; i < I; ++i) out[i] = -g[i];
                exp_inplace(out, I);
                for (int64_t i = 0; i < I; ++i) out[i] = g[i] / (1.0f + out[i]) * u[i];
            }
            residual(xn, I, M, L->wd, L->bd, L->pn2, post, h, H, md->eps);
        }
        rms_norm(h, num_logit_rows, logit_rows, md->norm, xn, H, md->eps);
        gemv(xn, H, num_logit_rows, md->lm_head, md->lm_bias, logits, md->vocab, md->vocab, H, 0);
    }
    return 0;
}
