/*
 * Shared helpers of the m40llm C tests: assertions with counters, a seeded RNG, an independent
 * FP16 converter, a float64 reference attention, and a host-side model of a KV cache that the
 * tests drive in lockstep with the library.
 *
 * Nothing here calls library internals: only the public header.
 */
#ifndef M40LLM_TEST_UTIL_H
#define M40LLM_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "m40llm.h"

/* ---- Assertions ------------------------------------------------------------------------------ */

extern long t_passed;
extern long t_failed;
extern long t_skipped;

/* Names what is being tested; printed with every failure until the next call. */
void t_set_case(const char *fmt, ...);

/* Counts a pass or a failure; on failure prints file:line, the message and the current case
 * (t_check_status also m40llm_last_error_message()). Returns ok, so callers can bail out:
 * if (!T_OK(...)) return; */
int t_check(int ok, const char *file, int line, const char *fmt, ...);
int t_check_status(int got, int want, const char *file, int line, const char *expr);
int t_check_errmsg(const char *want_substring, const char *file, int line);
int t_check_failure(int got, int want, const char *substr, const char *file, int line,
                    const char *expr);

#define T_CHECK(cond) t_check(!!(cond), __FILE__, __LINE__, "%s", #cond)
#define T_CHECKF(cond, ...) t_check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)
#define T_STATUS(expr, want) t_check_status((expr), (want), __FILE__, __LINE__, #expr)
#define T_OK(expr) T_STATUS(expr, M40LLM_OK)
/* The call must fail with `want` and m40llm_last_error_message() must contain `substr`. */
#define T_FAIL_WITH(expr, want, substr) \
  t_check_failure((expr), (want), (substr), __FILE__, __LINE__, #expr)
#define T_INT_EQ(a, b)                                                    \
  t_check((long long)(a) == (long long)(b), __FILE__, __LINE__, "%s == %s (%lld vs %lld)", #a, #b, \
          (long long)(a), (long long)(b))

void t_skip(const char *fmt, ...);

/* Prints "N passed, N failed[, N skipped]" and returns the exit code (0 iff none failed). */
int t_finish(void);

/* ---- RNG ------------------------------------------------------------------------------------- */

/* Seeds from env M40LLM_TEST_SEED or from the clock, and prints the seed. */
void t_rng_init(void);
uint64_t t_rand_u64(void);
double t_rand_unit(void);               /* [0, 1) */
float t_rand_float(float lo, float hi); /* [lo, hi) */
int t_rand_int(int lo, int hi);         /* [lo, hi] */
void t_fill_uniform(float *x, size_t n, float lo, float hi);
/* A peaked row (cases_quant.c, cases_causal.c): q for n_heads heads of d dims, head h (1 + 0.1
 * (h % 4)) x one random direction, and the key k0 (d dims) that meets them with logits of 10.09
 * to 13.1 at the default scale 1/sqrt(d). */
void t_peaked_qk(float *q, int n_heads, int d, float *k0);
/* The same directions with k0 at most 6e4 (FP16's range) and q at most 1e3: logits near 2^27
 * (2^27.5 in log2 units), where rounding the kernels' reference point m to nearest lost the
 * margin that keeps the weights' FP16 terms finite. */
void t_huge_qk(float *q, int n_heads, int d, float *k0);

/* ---- FP16 (own implementation, round to nearest even) ---------------------------------------- */

uint16_t t_f32_to_f16(float f);
float t_f16_to_f32(uint16_t h);
int t_f16_is_nan(uint16_t h);
float t_f32_from_bits(uint32_t u);
uint32_t t_f32_bits(float f);

/* ---- Reference attention --------------------------------------------------------------------- */

/* out[h][d] (float64) = softmax_t(scale * q[h] . K[t][g]) V[t][g][d], g = h / (n_heads/n_kv_heads);
 * k, v are [len][n_kv_heads][head_dim] FP16 bits; q is [n_heads][head_dim]; scale 0 means
 * 1/sqrt(head_dim); len 0 gives zeros. A score of -inf has weight 0; a head whose every score is
 * -inf gives zeros. */
void t_ref_attention(double *out, const float *q, const uint16_t *k, const uint16_t *v, int len,
                     int n_heads, int n_kv_heads, int head_dim, float scale);

/* Softmax weights of each query head over positions [0, len) of an F16 model's K
 * ([pos][kv_head][dim]), in double: w[h * len + p]; scale 0 means 1/sqrt(head_dim). */
void t_ref_weights(double *w, const float *q, const uint16_t *k, int len, int n_heads,
                   int n_kv_heads, int d, float scale);

/* ||got - ref||_2 / ||ref||_2; the absolute norm of the difference when ref is all zero; NaN or
 * inf when got holds a non-finite value. */
double t_rel_l2(const float *got, const double *ref, size_t n);

/* 1 if every byte of p is `byte`. */
int t_all_bytes(const void *p, size_t n, unsigned char byte);

/* The entries of an m40llm_build_info.cuda_architectures list, "NN-real" (real[i] = 1) or
 * "NN-virtual", NN possibly followed by letters (arch[i] = NN): up to max of them. Returns the
 * count, or -1 when an entry has another form or there are more than max. */
int t_parse_archs(const char *list, int *arch, int *real, int max);

/* ---- Host model of a KV cache ------------------------------------------------------------------ */

typedef struct t_model {
  int n_layers, max_seqs, n_kv_heads, head_dim, max_seq_len;
  size_t row;   /* n_kv_heads * head_dim: elements per position */
  uint16_t *k;  /* [layer][seq][pos][kv_head][dim] */
  uint16_t *v;
  int *len;     /* [layer][seq] */
} t_model;

int t_model_init(t_model *m, const m40llm_kvcache_options *o);
void t_model_free(t_model *m);
uint16_t *t_model_k(const t_model *m, int layer, int seq); /* position 0 of (layer, seq) */
uint16_t *t_model_v(const t_model *m, int layer, int seq);
int t_model_len(const t_model *m, int layer, int seq);
void t_model_append(t_model *m, int layer, int seq, const uint16_t *k, const uint16_t *v, int n);
void t_model_truncate(t_model *m, int seq, int new_len);
void t_model_reset(t_model *m, int seq);
void t_model_fork(t_model *m, int dst, int src);

/* A library cache, the context it lives on, and the model it must match. */
typedef struct t_kv {
  m40llm_context *ctx;
  m40llm_kvcache *cache;
  m40llm_kvcache_options opts;
  t_model model;
} t_kv;

/* Creates the cache on ctx and its model; reports failures and returns the status. */
int t_kv_create(t_kv *kv, m40llm_context *ctx, int n_layers, int n_heads, int n_kv_heads,
                int head_dim, int max_seqs, int max_seq_len);
/* The same with options of the caller's (any format, protected tokens). */
int t_kv_create_opts(t_kv *kv, m40llm_context *ctx, const m40llm_kvcache_options *o);
void t_kv_destroy(t_kv *kv);

/* Append host data through backend buffers; on success the model follows. Returns the status. */
int t_kv_append_f32(t_kv *kv, int layer, int seq, const float *k, const float *v, int n);
int t_kv_append_f16(t_kv *kv, int layer, int seq, const uint16_t *k, const uint16_t *v, int n);
/* Appends n random positions (values in [-amp, amp]) in random chunks, alternating f32/f16
 * appends. Returns the status of the first failing append (checked as OK). */
int t_kv_append_random(t_kv *kv, int layer, int seq, int n, float amp);
/* Appends the same n random positions (values in [-amp, amp]) to (layer, seq) of each of the
 * n_kvs caches (all of one row size), one append_f32 call each, or append_f16 of the values
 * rounded here. status[i] gets cache i's status (unchecked); M40LLM_ERR_OUT_OF_MEMORY for all
 * when the host buffers cannot be had. */
void t_kv_append_same_random(t_kv *const *kvs, int *status, int n_kvs, int layer, int seq, int n,
                             float amp, int use_f32);

int t_kv_truncate(t_kv *kv, int seq, int new_len);
int t_kv_reset(t_kv *kv, int seq);
int t_kv_fork(t_kv *kv, int dst, int src);

/* Checks every (layer, seq) length and the FP16 contents, bit-exact, against the model. */
void t_kv_check_contents(t_kv *kv);

/* Runs attention (batch call when use_batch, else one call per id) on the library, output
 * poisoned with 0xFF first, and compares every row with the float64 reference over the model.
 * q is host [n_ids][n_heads][head_dim]. When got_out is not NULL it receives the host copy of
 * the output. Returns the largest relative L2 error seen (NaN if any). */
double t_kv_check_attention(t_kv *kv, int layer, const int32_t *ids, int n_ids, const float *q,
                            float scale, double tol, int use_batch, float *got_out);

/* Backend-neutral buffer helpers (report failures). */
void *t_dev_alloc(m40llm_context *ctx, size_t bytes);
void *t_dev_upload(m40llm_context *ctx, const void *host, size_t bytes);
int t_dev_download(m40llm_context *ctx, void *host, const void *dev, size_t bytes);

/* The error-path and sequence-semantics cases, run on any context (CPU or CUDA). */
void t_cases_error_paths(m40llm_context *ctx);
void t_cases_sequence_ops(m40llm_context *ctx);
void t_cases_attention_basic(m40llm_context *ctx);
void t_cases_fp16_rounding(m40llm_context *ctx);
/* Q8/Q4/Q3/Q2 and K/V format pairs (cases_quant.c); small: shorter sequences. */
void t_cases_quantized(m40llm_context *ctx, int small);
/* Whether the CUDA backend has kernels for K format kf with V format vf (m40llm.h: F16, Q8, Q4
 * each with itself, Q8 K with Q4 V, Q4 K with Q3 or Q2 V). */
int t_cuda_has_pair(int kf, int vf);
/* Where options o name a K/V pair the CUDA backend has no kernels for and ctx is on it: checks
 * that create fails there with M40LLM_ERR_UNSUPPORTED, naming both formats, *out untouched, and
 * returns 1 (the caller's case ends); else 0. */
int t_pair_refused(m40llm_context *ctx, const m40llm_kvcache_options *o);

/* Independent models of the quantized formats (cases_quant.c), from the header's definitions:
 * one group of 32 values of format fmt quantized and dequantized in double (exact: a code times
 * an FP16 scale, plus an FP16 min; FP32 arithmetic where the header says it is rounded); the
 * rotation of a row of d dims in FP32 or double; K/V values with outlier channels, constant
 * and zero groups (and, where big, large magnitudes); and the float64 attention of one query
 * head against len rows of k and v (row t at t * stride). */
void t_quantize_group(int fmt, const float *x, double *out);
void t_rotate_f32(float *x, int d);
void t_rotate_f64(double *x, int d);
void t_fill_kv_values(float *x, size_t rows, int d, int big);
void t_ref_head(const float *q, const double *k, const double *v, int len, int d, int stride,
                double scale, double *out);
/* Tiered caches (cases_tiers.c): the tiers' placement, moves, truncate and fork against a host
 * model of the header's rules, read_f16 bit for bit and attention against float64; a one-tier
 * cache against the uniform cache of its formats; errors. A CUDA ctx must refuse them. */
void t_cases_tiers(m40llm_context *ctx, int small);

/* Importance placement (cases_policy.c): decisions against a host mirror fed with the cache's
 * own weights, a twin cache driven to them by tier_move (same tiers, same values, same
 * attention); errors. */
void t_cases_policy(m40llm_context *ctx, int small);

/* Batched append against single appends and the CPU backend, and its errors (cases_batch.c);
 * small: fewer rounds. */
void t_cases_append_batch(m40llm_context *ctx, int small);

/* Causal attention (cases_causal.c): ragged prefill and speculative shapes, windows, every
 * format, against float64 references and the decode call; its errors. cpu: a CPU context. */
void t_cases_causal(m40llm_context *ctx, m40llm_context *cpu, int small);

/* FP16 and BF16 q, out and K/V rows (cases_dtype.c): the _ex calls against the FP32 ones,
 * rounded, bit for bit, and the FP32 ones against the CPU backend; their errors. */
void t_cases_dtype(m40llm_context *ctx, m40llm_context *cpu, int small);

/* Attention weights (cases_weights.c): F16 against float64 references, quantized caches with
 * protected tokens against the CPU backend cpu, entries past each length untouched; errors. */
void t_cases_weights(m40llm_context *ctx, m40llm_context *cpu, int small);
/* Importance (cases_importance.c): F16 against float64 references, against the weights call,
 * errors; with cpu (not NULL), quantized caches with protected tokens against the CPU backend. */
void t_cases_importance(m40llm_context *ctx, m40llm_context *cpu, int small);

/* Positions whose K holds -inf (weight 0), first, last, at tile starts, whole splits, all. */
void t_cases_attention_masked(m40llm_context *ctx);
/* A decode step captured into CUDA graphs and replayed through cudaGraphExecUpdate, against the
 * eager calls and the CPU backend (cases_graph.c: CUDA builds only, linked into test_gpu). */
void t_cases_graph(m40llm_context *ctx, m40llm_context *cpu, int small);

/* Batch attention over seqs 0..2 of layer 0 of kv (n_heads * head_dim >= 9 floats a row) with
 * the 9 ids written into ids_in_out, which lies in out's first row (host-visible memory the
 * backend can write: host memory on the CPU, managed memory on CUDA); dq is q in backend
 * memory, q its host copy. Every row must match the reference for the ids as passed. */
void t_check_ids_alias_out(t_kv *kv, int32_t *ids_in_out, float *out, const float *dq,
                           const float *q);

#endif /* M40LLM_TEST_UTIL_H */
