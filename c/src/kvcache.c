#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FAIL(code, ...) m40llm_fail(M40LLM_ERR_##code, __VA_ARGS__)

/* Bytes of the options struct of each version: a version-1 caller's struct ends before
 * v_format, a version-2 one before rotation. */
static size_t options_size(unsigned version) {
  switch (version) {
    case 1: return offsetof(m40llm_kvcache_options, v_format);
    case 2: return offsetof(m40llm_kvcache_options, rotation);
    case 3: return offsetof(m40llm_kvcache_options, n_tiers);
    case 4: return offsetof(m40llm_kvcache_options, placement);
    case 5: return offsetof(m40llm_kvcache_options, observe_interval);
    case 6: return offsetof(m40llm_kvcache_options, demote_margin);
    case 7: return sizeof(m40llm_kvcache_options);
    default: return 0;
  }
}

int m40llm_kvcache_options_init(m40llm_kvcache_options *opts, unsigned version) {
  if (!opts) return FAIL(INVALID_ARGUMENT, "opts is NULL");
  if (!options_size(version))
    return FAIL(INVALID_ARGUMENT,
                "kvcache options version %u is not supported (this library knows 1 to %u)",
                version, M40LLM_KVCACHE_OPTIONS_VERSION);
  const m40llm_kvcache_options defaults = M40LLM_KVCACHE_OPTIONS_INIT;
  memcpy(opts, &defaults, options_size(version));
  opts->version = version;
  return M40LLM_OK;
}

/* The caller's options of any known version as the current version (later fields defaulted). */
static int read_options(m40llm_kvcache_options *out, const m40llm_kvcache_options *in) {
  if (!in) return FAIL(INVALID_ARGUMENT, "opts is NULL");
  if (!options_size(in->version))
    return FAIL(INVALID_ARGUMENT,
                "opts->version %u is not supported (this library knows 1 to %u; use "
                "M40LLM_KVCACHE_OPTIONS_INIT)",
                in->version, M40LLM_KVCACHE_OPTIONS_VERSION);
  const m40llm_kvcache_options defaults = M40LLM_KVCACHE_OPTIONS_INIT;
  *out = defaults;
  if (in->version < 3) { /* what caches of versions 1 and 2 did */
    out->rotation = M40LLM_ROTATE_NONE;
    out->n_sinks = out->window = 0;
  }
  if (in->version < 6) out->observe_interval = 0; /* observe calls only where the caller makes them */
  memcpy(out, in, options_size(in->version));
  out->version = M40LLM_KVCACHE_OPTIONS_VERSION;
  return M40LLM_OK;
}

static int v_format_of(const m40llm_kvcache_options *o) {
  return o->v_format == M40LLM_KV_SAME ? o->format : o->v_format;
}

/* Bytes of one tensor's FP16 protected slots, added to *bytes (0 on overflow). */
static int add_protected_bytes(size_t *bytes, const m40llm_kvcache_options *o, int slots) {
  size_t n = (size_t)slots * (size_t)o->head_dim * sizeof(uint16_t);
  const size_t dims[] = {(size_t)o->n_layers, (size_t)o->max_seqs, (size_t)o->n_kv_heads};
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
    if (n != 0 && n > SIZE_MAX / dims[i]) return 0;
    n *= dims[i];
  }
  if (*bytes > SIZE_MAX - n) return 0;
  *bytes += n;
  return 1;
}

/* The options of tier t's planes: its formats, and its rows as the positions. */
static m40llm_kvcache_options tier_options(const m40llm_kvcache_options *o, int t) {
  m40llm_kvcache_options to = *o;
  to.max_seq_len = o->tiers[t].rows;
  to.format = o->tiers[t].k_format;
  to.v_format = o->tiers[t].v_format;
  to.n_tiers = 0;
  return to;
}

/* A tiered cache's tiers (n_tiers > 0): their formats and rows; adds their planes to *bytes. */
static int check_tiers(const m40llm_kvcache_options *o, int sinks, int window, size_t *bytes) {
  if (o->n_tiers > M40LLM_MAX_TIERS)
    return FAIL(INVALID_ARGUMENT, "opts->n_tiers is %d, must be in 0..%d", o->n_tiers,
                M40LLM_MAX_TIERS);
  if (o->tiers[0].k_format != o->format || o->tiers[0].v_format != v_format_of(o))
    return FAIL(INVALID_ARGUMENT,
                "opts->format and v_format (%d, %d) must name the first tier's formats (%d, %d)",
                o->format, v_format_of(o), o->tiers[0].k_format, o->tiers[0].v_format);
  long long rows = 0;
  for (int t = 0; t < o->n_tiers; t++) {
    const m40llm_kv_tier *tier = &o->tiers[t];
    const m40llm_kv_format_desc *k = m40llm_kv_format_find(tier->k_format);
    const m40llm_kv_format_desc *v = m40llm_kv_format_find(tier->v_format);
    if (!k || !v || k->v_only || tier->k_format == M40LLM_KV_F16 ||
        tier->v_format == M40LLM_KV_F16)
      return FAIL(INVALID_ARGUMENT,
                  "opts->tiers[%d] has formats (%d, %d): a tier's K is Q8 or Q4, its V Q8, Q4, "
                  "Q3 or Q2", t, tier->k_format, tier->v_format);
    if (tier->rows < 0 || tier->rows > o->max_seq_len)
      return FAIL(INVALID_ARGUMENT, "opts->tiers[%d].rows is %d, must be in 0..max_seq_len (%d)",
                  t, tier->rows, o->max_seq_len);
    rows += tier->rows;
    const m40llm_kvcache_options to = tier_options(o, t);
    m40llm_kv_layout l;
    size_t k_bytes = 0, v_bytes = 0;
    int rc = m40llm_kv_layout_init(&l, &k_bytes, &to, to.format);
    if (rc == M40LLM_OK) rc = m40llm_kv_layout_init(&l, &v_bytes, &to, to.v_format);
    if (rc != M40LLM_OK) return rc;
    /* and the tier's slot map in backend memory (m40llm_row_op.pos) */
    const size_t map_bytes = (size_t)tier->rows * (size_t)o->n_layers * (size_t)o->max_seqs *
                             sizeof(int32_t);
    if (k_bytes > SIZE_MAX - v_bytes || map_bytes > SIZE_MAX - k_bytes - v_bytes ||
        *bytes > SIZE_MAX - k_bytes - v_bytes - map_bytes)
      return FAIL(OUT_OF_MEMORY, "cache size overflows size_t");
    *bytes += k_bytes + v_bytes + map_bytes;
  }
  const long long need = (long long)o->max_seq_len - sinks - window;
  if (rows < need)
    return FAIL(INVALID_ARGUMENT,
                "the tiers hold %lld rows, fewer than the %lld that can leave the window "
                "(max_seq_len %d - n_sinks %d - window %d)", rows, need, o->max_seq_len, sinks,
                window);
  return M40LLM_OK;
}

/* Validates opts (already read as the current version) and computes the layouts of K and V and
 * their bytes together, FP16 slots included (a tiered cache: its tiers instead of K and V's
 * positional planes). */
static int check_options(const m40llm_kvcache_options *o, m40llm_kv_layout *k_layout,
                         m40llm_kv_layout *v_layout, size_t *out_bytes) {
  if (o->n_layers < 1) return FAIL(INVALID_ARGUMENT, "opts->n_layers is %d, must be >= 1", o->n_layers);
  if (o->n_heads < 1) return FAIL(INVALID_ARGUMENT, "opts->n_heads is %d, must be >= 1", o->n_heads);
  if (o->n_kv_heads < 1)
    return FAIL(INVALID_ARGUMENT, "opts->n_kv_heads is %d, must be >= 1", o->n_kv_heads);
  if (o->n_heads % o->n_kv_heads != 0)
    return FAIL(INVALID_ARGUMENT, "opts->n_heads %d is not a multiple of opts->n_kv_heads %d",
                o->n_heads, o->n_kv_heads);
  if (o->head_dim < 1 || o->head_dim > 256)
    return FAIL(INVALID_ARGUMENT, "opts->head_dim is %d, must be in 1..256", o->head_dim);
  if (o->max_seqs < 1) return FAIL(INVALID_ARGUMENT, "opts->max_seqs is %d, must be >= 1", o->max_seqs);
  if (o->max_seq_len < 1)
    return FAIL(INVALID_ARGUMENT, "opts->max_seq_len is %d, must be >= 1", o->max_seq_len);
  if (!m40llm_kv_format_find(o->format))
    return FAIL(UNSUPPORTED, "opts->format %d is not a KV format of this library", o->format);
  if (o->v_format != M40LLM_KV_SAME && !m40llm_kv_format_find(o->v_format))
    return FAIL(UNSUPPORTED, "opts->v_format %d is not a KV format of this library",
                o->v_format);
  if (m40llm_kv_format_find(o->format)->v_only)
    return FAIL(INVALID_ARGUMENT,
                "opts->format %s is a V format only (3- and 2-bit K cost more accuracy than "
                "they save); set format to K's (Q4, Q8, F16) and v_format to %s",
                m40llm_kv_format_find(o->format)->name, m40llm_kv_format_find(o->format)->name);
  if (o->rotation < M40LLM_ROTATE_AUTO || o->rotation > M40LLM_ROTATE_KV)
    return FAIL(INVALID_ARGUMENT, "opts->rotation is %d, not an m40llm_kv_rotation", o->rotation);
  if (o->n_sinks < 0) return FAIL(INVALID_ARGUMENT, "opts->n_sinks is %d, must be >= 0", o->n_sinks);
  if (o->window < 0) return FAIL(INVALID_ARGUMENT, "opts->window is %d, must be >= 0", o->window);
  if (o->n_tiers < 0)
    return FAIL(INVALID_ARGUMENT, "opts->n_tiers is %d, must be in 0..%d", o->n_tiers,
                M40LLM_MAX_TIERS);
  if (o->placement != M40LLM_PLACE_FIRST_FREE && o->placement != M40LLM_PLACE_IMPORTANCE)
    return FAIL(INVALID_ARGUMENT, "opts->placement is %d, not an m40llm_tier_placement",
                o->placement);
  if (o->observe_interval < 0)
    return FAIL(INVALID_ARGUMENT, "opts->observe_interval is %d, must be >= 0",
                o->observe_interval);
  if (!(o->demote_margin >= 0.0f) || isinf(o->demote_margin))
    return FAIL(INVALID_ARGUMENT, "opts->demote_margin is %g, must be finite and >= 0",
                (double)o->demote_margin);
  if (o->placement == M40LLM_PLACE_IMPORTANCE && o->n_tiers == 0)
    return FAIL(INVALID_ARGUMENT,
                "opts->placement is M40LLM_PLACE_IMPORTANCE, which places rows in tiers, but "
                "opts->n_tiers is 0");
  size_t k_bytes = 0, v_bytes = 0;
  int rc = m40llm_kv_layout_init(k_layout, &k_bytes, o, o->format);
  if (rc == M40LLM_OK) rc = m40llm_kv_layout_init(v_layout, &v_bytes, o, v_format_of(o));
  if (rc != M40LLM_OK) return rc;
  if (k_bytes > SIZE_MAX - v_bytes) return FAIL(OUT_OF_MEMORY, "cache size overflows size_t");
  size_t bytes = k_bytes + v_bytes;
  int sinks, window;
  m40llm_kv_protection(o, o->format, v_format_of(o), &sinks, &window);
  if (o->n_tiers > 0) {
    bytes = 0;
    if ((rc = check_tiers(o, sinks, window, &bytes)) != M40LLM_OK) return rc;
  }
  const int formats[2] = {o->format, v_format_of(o)};
  for (int i = 0; i < 2; i++)
    if (formats[i] != M40LLM_KV_F16 && !add_protected_bytes(&bytes, o, sinks + window))
      return FAIL(OUT_OF_MEMORY, "cache size overflows size_t");
  if (!m40llm_policy_add_bytes(&bytes, o, window)) return FAIL(OUT_OF_MEMORY, "cache size overflows size_t");
  *out_bytes = bytes;
  return M40LLM_OK;
}

/* Whether a tensor of this format is stored rotated under rotation (m40llm_kv_rotation). */
static int is_rotated(int format, int rotation, int is_v) {
  if (format == M40LLM_KV_F16 || rotation == M40LLM_ROTATE_NONE) return 0;
  return !is_v || rotation != M40LLM_ROTATE_K;
}

int m40llm_kvcache_bytes_needed(size_t *out_bytes, const m40llm_kvcache_options *opts) {
  if (!out_bytes) return FAIL(INVALID_ARGUMENT, "out_bytes is NULL");
  size_t bytes = 0;
  m40llm_kvcache_options o;
  m40llm_kv_layout k_layout, v_layout;
  int rc = read_options(&o, opts);
  if (rc == M40LLM_OK) rc = check_options(&o, &k_layout, &v_layout, &bytes);
  if (rc == M40LLM_OK) *out_bytes = bytes;
  return rc;
}

static void release_tensor(m40llm_kvcache *c, m40llm_kv_tensor *t) {
  for (int p = 0; p < M40LLM_KV_PLANES; p++) m40llm_free(c->ctx, t->plane[p]);
  m40llm_free(c->ctx, t->fp16);
}

static void release(m40llm_kvcache *c) {
  release_tensor(c, &c->k);
  release_tensor(c, &c->v);
  for (int t = 0; t < M40LLM_MAX_TIERS; t++) {
    release_tensor(c, &c->tier_k[t]);
    release_tensor(c, &c->tier_v[t]);
    free(c->tier_pos[t]);
    m40llm_free(c->ctx, c->tier_map[t]);
  }
  free(c->where);
  free(c->tier_count);
  free(c->ops);
  free(c->lens);
  free(c->lo);
  free(c->batch);
  free(c->batch_seen);
  free(c->batch_ids);
  m40llm_policy_free(c);
  free(c);
}

/* The planes of one tensor, each its own allocation (aligned for the widest loads), unless
 * the cache is tiered, and a quantized tensor's FP16 slots where the cache has any. */
static int alloc_tensor(m40llm_kv_tensor *t, m40llm_kvcache *c, const m40llm_kv_layout *l,
                        int is_v) {
  t->layout = *l;
  t->rotated = is_rotated(l->fmt->format, c->opts.rotation, is_v);
  for (int p = 0; p < M40LLM_KV_PLANES; p++) {
    if (l->row_bytes[p] == 0 || c->n_tiers > 0) continue;
    const int rc = m40llm_malloc((void **)&t->plane[p], c->ctx, l->rows * l->row_bytes[p]);
    if (rc != M40LLM_OK) return rc;
  }
  if (l->fmt->format == M40LLM_KV_F16 || c->slots == 0) return M40LLM_OK;
  const size_t rows = m40llm_kv_protected_row(&c->opts, c->slots, c->opts.n_layers, 0, 0, 0);
  return m40llm_malloc((void **)&t->fp16, c->ctx, rows * (size_t)c->opts.head_dim * sizeof(uint16_t));
}

/* A tiered cache's tiers (each tier's K and V planes and slot map), its position map and its
 * host counts (all zero). Tensors of no rows allocate nothing. */
static int alloc_tiers(m40llm_kvcache *c) {
  if (c->n_tiers == 0) return M40LLM_OK;
  const m40llm_kvcache_options *o = &c->opts;
  const size_t seqs = (size_t)o->n_layers * (size_t)o->max_seqs;
  c->tier_count = m40llm_host_calloc(seqs * M40LLM_MAX_TIERS, sizeof *c->tier_count);
  c->ops = m40llm_host_calloc(M40LLM_TIER_OPS, sizeof *c->ops);
  c->where = seqs > SIZE_MAX / sizeof *c->where / (size_t)o->max_seq_len
                 ? NULL
                 : m40llm_host_malloc(seqs * (size_t)o->max_seq_len * sizeof *c->where);
  if (!c->tier_count || !c->ops || !c->where)
    return FAIL(OUT_OF_MEMORY, "allocating the tiers' maps on the host");
  int rc = M40LLM_OK;
  for (int t = 0; t < c->n_tiers && rc == M40LLM_OK; t++) {
    if (o->tiers[t].rows == 0) continue;
    const m40llm_kvcache_options to = tier_options(o, t);
    m40llm_kv_layout k, v;
    size_t unused;
    if ((rc = m40llm_kv_layout_init(&k, &unused, &to, to.format)) != M40LLM_OK ||
        (rc = m40llm_kv_layout_init(&v, &unused, &to, to.v_format)) != M40LLM_OK)
      break;
    const m40llm_kv_layout *layouts[2] = {&k, &v};
    m40llm_kv_tensor *tensors[2] = {&c->tier_k[t], &c->tier_v[t]};
    for (int i = 0; i < 2 && rc == M40LLM_OK; i++) {
      tensors[i]->layout = *layouts[i];
      tensors[i]->rotated = is_rotated(layouts[i]->fmt->format, o->rotation, i);
      for (int p = 0; p < M40LLM_KV_PLANES && rc == M40LLM_OK; p++)
        if (layouts[i]->row_bytes[p])
          rc = m40llm_malloc((void **)&tensors[i]->plane[p], c->ctx,
                             layouts[i]->rows * layouts[i]->row_bytes[p]);
    }
    if (rc == M40LLM_OK &&
        !(c->tier_pos[t] = m40llm_host_malloc(seqs * (size_t)o->tiers[t].rows * sizeof(int32_t))))
      rc = FAIL(OUT_OF_MEMORY, "allocating tier %d's slot map on the host", t);
    if (rc == M40LLM_OK)
      rc = m40llm_malloc((void **)&c->tier_map[t], c->ctx,
                         seqs * (size_t)o->tiers[t].rows * sizeof(int32_t));
  }
  return rc;
}

int m40llm_kvcache_create(m40llm_kvcache **out, m40llm_context *ctx,
                          const m40llm_kvcache_options *opts) {
  if (!out) return FAIL(INVALID_ARGUMENT, "out is NULL");
  if (!ctx) return FAIL(INVALID_ARGUMENT, "ctx is NULL");
  size_t bytes = 0;
  m40llm_kvcache_options o;
  m40llm_kv_layout k_layout, v_layout;
  int rc = read_options(&o, opts);
  if (rc != M40LLM_OK || (rc = check_options(&o, &k_layout, &v_layout, &bytes)) != M40LLM_OK ||
      (rc = ctx->ops->check_cache(&o)) != M40LLM_OK || (rc = m40llm_context_check(ctx)) != M40LLM_OK)
    return rc;
  m40llm_kvcache *c = m40llm_host_calloc(1, sizeof *c);
  if (!c) return FAIL(OUT_OF_MEMORY, "allocating the cache handle");
  c->ctx = ctx;
  c->opts = o;
  m40llm_kv_protection(&o, o.format, v_format_of(&o), &c->n_sinks, &c->window);
  c->slots = c->n_sinks + c->window;
  c->lens = m40llm_host_calloc((size_t)o.n_layers * (size_t)o.max_seqs, sizeof *c->lens);
  c->lo = m40llm_host_calloc((size_t)o.n_layers * (size_t)o.max_seqs, sizeof *c->lo);
  c->batch = m40llm_host_calloc((size_t)o.max_seqs, sizeof *c->batch);
  c->batch_seen = m40llm_host_calloc((size_t)o.max_seqs, sizeof *c->batch_seen);
  c->batch_ids = m40llm_host_calloc((size_t)o.max_seqs, sizeof *c->batch_ids);
  if (!c->lens || !c->lo || !c->batch || !c->batch_seen || !c->batch_ids) {
    free(c->lens);
    free(c->lo);
    free(c->batch);
    free(c->batch_seen);
    free(c->batch_ids);
    free(c);
    return FAIL(OUT_OF_MEMORY, "allocating sequence lengths");
  }
  c->n_tiers = o.n_tiers;
  if ((rc = alloc_tensor(&c->k, c, &k_layout, 0)) != M40LLM_OK ||
      (rc = alloc_tensor(&c->v, c, &v_layout, 1)) != M40LLM_OK ||
      (rc = alloc_tiers(c)) != M40LLM_OK || (rc = m40llm_policy_alloc(c)) != M40LLM_OK ||
      (rc = m40llm_context_result(ctx, ctx->ops->cache_created(c))) != M40LLM_OK) {
    release(c);
    return rc;
  }
  *out = c;
  return M40LLM_OK;
}

void m40llm_kvcache_destroy(m40llm_kvcache *cache) {
  if (!cache) return;
  /* Work still queued may read the buffers; the CUDA free waits for the stream. */
  release(cache);
}

int m40llm_kvcache_get_options(m40llm_kvcache_options *out, const m40llm_kvcache *cache) {
  if (!out) return FAIL(INVALID_ARGUMENT, "out is NULL");
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  const unsigned version = out->version;
  if (!options_size(version))
    return FAIL(INVALID_ARGUMENT, "out->version %u is not supported (this library knows 1 to %u)",
                version, M40LLM_KVCACHE_OPTIONS_VERSION);
  memcpy(out, &cache->opts, options_size(version));
  out->version = version;
  return M40LLM_OK;
}

static int check_layer_seq(const m40llm_kvcache *c, int layer, int seq) {
  if (layer < 0 || layer >= c->opts.n_layers)
    return FAIL(OUT_OF_RANGE, "layer %d is outside 0..%d", layer, c->opts.n_layers - 1);
  if (seq < 0 || seq >= c->opts.max_seqs)
    return FAIL(OUT_OF_RANGE, "seq %d is outside 0..%d", seq, c->opts.max_seqs - 1);
  return M40LLM_OK;
}

static int check_seq(const m40llm_kvcache *c, const char *name, int seq) {
  if (seq < 0 || seq >= c->opts.max_seqs)
    return FAIL(OUT_OF_RANGE, "%s %d is outside 0..%d", name, seq, c->opts.max_seqs - 1);
  return M40LLM_OK;
}

static int check_dtype(int dtype) {
  if (m40llm_dtype_size(dtype) == 0)
    return FAIL(INVALID_ARGUMENT, "dtype %d is not an m40llm_dtype (F32 0, F16 1, BF16 2)", dtype);
  return M40LLM_OK;
}

int m40llm_kvcache_seq_len(int *out_len, const m40llm_kvcache *cache, int layer, int seq) {
  if (!out_len) return FAIL(INVALID_ARGUMENT, "out_len is NULL");
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc = check_layer_seq(cache, layer, seq);
  if (rc == M40LLM_OK) *out_len = *m40llm_len_slot(cache, layer, seq);
  return rc;
}

int m40llm_kvcache_seq_reset(m40llm_kvcache *cache, int seq) {
  return m40llm_kvcache_seq_truncate(cache, seq, 0);
}

int m40llm_kvcache_seq_truncate(m40llm_kvcache *cache, int seq, int new_len) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc = check_seq(cache, "seq", seq);
  if (rc != M40LLM_OK) return rc;
  if (new_len < 0) return FAIL(INVALID_ARGUMENT, "new_len is %d, must be >= 0", new_len);
  if (cache->n_tiers > 0 && (rc = m40llm_context_check(cache->ctx)) != M40LLM_OK) return rc;
  for (int l = 0; l < cache->opts.n_layers; l++) {
    int *len = m40llm_len_slot(cache, l, seq), *lo = m40llm_lo_slot(cache, l, seq);
    /* A tiered cache's rows past new_len leave their tiers first (a backend failure leaves
     * this layer and the ones after it as they were). */
    if (cache->n_tiers > 0 && *len > new_len &&
        ((rc = m40llm_tiers_truncate(cache, l, seq, new_len)) != M40LLM_OK ||
         (rc = m40llm_policy_truncate(cache, l, seq, *len, new_len)) != M40LLM_OK))
      return rc;
    if (*len > new_len) *len = new_len;
    if (*lo > new_len) *lo = new_len;
  }
  return M40LLM_OK;
}

/* A tiered cache's maps and counts of (layer, src) into dst (the backend copied the rows). */
static void fork_maps(m40llm_kvcache *c, int l, int dst, int src) {
  memcpy(m40llm_tier_counts(c, l, dst), m40llm_tier_counts(c, l, src),
         M40LLM_MAX_TIERS * sizeof(int32_t));
  memcpy(m40llm_tier_where_of(c, l, dst), m40llm_tier_where_of(c, l, src),
         (size_t)*m40llm_len_slot(c, l, src) * sizeof(uint32_t));
  for (int t = 0; t < c->n_tiers; t++)
    if (c->opts.tiers[t].rows > 0) /* a tier of no rows has no map */
      memcpy(m40llm_tier_slot_pos(c, t, l, dst), m40llm_tier_slot_pos(c, t, l, src),
             (size_t)m40llm_tier_counts(c, l, src)[t] * sizeof(int32_t));
}

int m40llm_kvcache_seq_fork(m40llm_kvcache *cache, int dst_seq, int src_seq) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc;
  if ((rc = check_seq(cache, "dst_seq", dst_seq)) != M40LLM_OK ||
      (rc = check_seq(cache, "src_seq", src_seq)) != M40LLM_OK)
    return rc;
  if (dst_seq == src_seq) return FAIL(INVALID_ARGUMENT, "dst_seq and src_seq are both %d", dst_seq);
  if ((rc = m40llm_context_check(cache->ctx)) != M40LLM_OK) return rc;
  /* What observe calls left for either sequence is read before the fork replaces dst's */
  for (int l = 0; l < cache->opts.n_layers; l++)
    if ((rc = m40llm_policy_settle(cache, l, src_seq)) != M40LLM_OK ||
        (rc = m40llm_policy_settle(cache, l, dst_seq)) != M40LLM_OK)
      return rc;
  rc = m40llm_context_result(cache->ctx, cache->ctx->ops->fork(cache, dst_seq, src_seq));
  if (rc != M40LLM_OK) return rc;
  for (int l = 0; l < cache->opts.n_layers; l++) {
    const int old_len = *m40llm_len_slot(cache, l, dst_seq);
    *m40llm_len_slot(cache, l, dst_seq) = *m40llm_len_slot(cache, l, src_seq);
    *m40llm_lo_slot(cache, l, dst_seq) = *m40llm_lo_slot(cache, l, src_seq);
    if (cache->n_tiers > 0) fork_maps(cache, l, dst_seq, src_seq);
    if ((rc = m40llm_policy_fork(cache, l, dst_seq, src_seq, old_len)) != M40LLM_OK) return rc;
  }
  return M40LLM_OK;
}

/* The items' sequences after their append: lengths moved on, window starts raised. */
static void appended(m40llm_kvcache *c, int layer, const m40llm_append_item *items, int n_items) {
  for (int i = 0; i < n_items; i++) {
    int *len = m40llm_len_slot(c, layer, items[i].seq);
    int *lo = m40llm_lo_slot(c, layer, items[i].seq);
    *len = items[i].pos + items[i].n_tokens;
    if (*lo < *len - c->window) *lo = *len - c->window;
  }
}

/* The backend's append of checked items (distinct sequences, each n_tokens >= 1, capacity
 * checked), then their lengths and window starts. */
static int run_append(m40llm_kvcache *c, int layer, const m40llm_append_item *items, int n_items,
                      const void *k, const void *v, int dtype) {
  int rc = m40llm_context_check(c->ctx);
  if (rc != M40LLM_OK || n_items == 0) return rc;
  rc = m40llm_context_result(c->ctx,
                             c->n_tiers > 0
                                 ? m40llm_tiers_append(c, layer, items, n_items, k, v, dtype)
                                 : c->ctx->ops->append(c, layer, items, n_items, k, v, dtype));
  if (rc == M40LLM_OK) appended(c, layer, items, n_items);
  return rc;
}

static int append(m40llm_kvcache *c, int layer, int seq, const void *k, const void *v,
                  int n_tokens, int dtype) {
  if (!c) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc = check_layer_seq(c, layer, seq);
  if (rc != M40LLM_OK) return rc;
  if (!k) return FAIL(INVALID_ARGUMENT, "k is NULL");
  if (!v) return FAIL(INVALID_ARGUMENT, "v is NULL");
  if (n_tokens < 1) return FAIL(INVALID_ARGUMENT, "n_tokens is %d, must be >= 1", n_tokens);
  const int len = *m40llm_len_slot(c, layer, seq);
  if ((long long)len + n_tokens > c->opts.max_seq_len)
    return FAIL(CAPACITY, "appending %d token(s) to layer %d seq %d (length %d) passes max_seq_len %d",
                n_tokens, layer, seq, len, c->opts.max_seq_len);
  const m40llm_append_item item = {seq, len, n_tokens};
  return run_append(c, layer, &item, 1, k, v, dtype);
}

int m40llm_kvcache_append_f32(m40llm_kvcache *cache, int layer, int seq, const float *k,
                              const float *v, int n_tokens) {
  return append(cache, layer, seq, k, v, n_tokens, M40LLM_DTYPE_F32);
}

int m40llm_kvcache_append_f16(m40llm_kvcache *cache, int layer, int seq, const uint16_t *k,
                              const uint16_t *v, int n_tokens) {
  return append(cache, layer, seq, k, v, n_tokens, M40LLM_DTYPE_F16);
}

/* Checks the batch copied into c->batch (n entries: the caller's ids and counts) and adds up
 * its tokens; marks each id in c->batch_seen, which the caller clears. */
static int check_batch(const m40llm_kvcache *c, int layer, int n, unsigned long long *out_tokens) {
  unsigned long long tokens = 0;
  for (int i = 0; i < n; i++) {
    const m40llm_append_item *it = &c->batch[i];
    if (it->seq < 0 || it->seq >= c->opts.max_seqs)
      return FAIL(OUT_OF_RANGE, "seq_ids[%d] = %d is outside 0..%d", i, (int)it->seq,
                  c->opts.max_seqs - 1);
    int *seen = &c->batch_seen[it->seq];
    if (*seen)
      return FAIL(INVALID_ARGUMENT, "seq_ids[%d] = %d repeats seq_ids[%d]: a batch names each "
                  "sequence once", i, (int)it->seq, *seen - 1);
    *seen = i + 1;
    if (it->n_tokens < 0)
      return FAIL(INVALID_ARGUMENT, "n_tokens[%d] is %d, must be >= 0", i, (int)it->n_tokens);
    const int len = *m40llm_len_slot(c, layer, it->seq);
    if ((long long)len + it->n_tokens > c->opts.max_seq_len)
      return FAIL(CAPACITY,
                  "appending %d token(s) to layer %d seq %d (seq_ids[%d], length %d) passes "
                  "max_seq_len %d: nothing was appended to any sequence",
                  (int)it->n_tokens, layer, (int)it->seq, i, len, c->opts.max_seq_len);
    tokens += (unsigned long long)it->n_tokens;
  }
  *out_tokens = tokens;
  return M40LLM_OK;
}

/* Reads a call's ids and counts (NULL: one each) once into the cache's scratch, which is then
 * the only copy checked and used; a call names each sequence once, so at most max_seqs. */
static int read_batch(m40llm_kvcache *c, const int32_t *seq_ids, const int32_t *counts,
                      int n_seqs) {
  if (!seq_ids) return FAIL(INVALID_ARGUMENT, "seq_ids is NULL");
  if (n_seqs < 1) return FAIL(INVALID_ARGUMENT, "n_seqs is %d, must be >= 1", n_seqs);
  if (n_seqs > c->opts.max_seqs)
    return FAIL(INVALID_ARGUMENT,
                "n_seqs %d is more than max_seqs %d: a call names each sequence once", n_seqs,
                c->opts.max_seqs);
  for (int i = 0; i < n_seqs; i++) {
    c->batch[i].seq = seq_ids[i];
    c->batch[i].n_tokens = counts ? counts[i] : 1;
  }
  return M40LLM_OK;
}

/* Reads a batch's ids and counts once into c->batch, checks them and the rows' span, and
 * leaves there the items of the sequences with tokens (*n_items), positions set. The cache and
 * layer are checked. */
static int prepare_batch(m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                         const int32_t *n_tokens, int n_seqs, const void *k, const void *v,
                         int dtype, int *n_items) {
  int rc = read_batch(c, seq_ids, n_tokens, n_seqs);
  if (rc != M40LLM_OK) return rc;
  unsigned long long tokens = 0;
  rc = check_batch(c, layer, n_seqs, &tokens);
  for (int i = 0; i < n_seqs; i++) /* only ids in range were marked */
    if (c->batch[i].seq >= 0 && c->batch[i].seq < c->opts.max_seqs)
      c->batch_seen[c->batch[i].seq] = 0;
  if (rc != M40LLM_OK) return rc;
  if (tokens > 0 && !k) return FAIL(INVALID_ARGUMENT, "k is NULL");
  if (tokens > 0 && !v) return FAIL(INVALID_ARGUMENT, "v is NULL");
  /* The rows must lie in the address space from where k and v start. */
  const unsigned long long row = (unsigned long long)c->opts.n_kv_heads *
                                 (unsigned long long)c->opts.head_dim *
                                 m40llm_dtype_size(dtype);
  if (tokens > UINTPTR_MAX / row || tokens * row > UINTPTR_MAX - (uintptr_t)k ||
      tokens * row > UINTPTR_MAX - (uintptr_t)v)
    return FAIL(INVALID_ARGUMENT, "%llu token(s) of %llu bytes from k or v pass the end of the "
                "address space", tokens, row);
  int n = 0;
  for (int i = 0; i < n_seqs; i++) {
    m40llm_append_item it = c->batch[i];
    if (it.n_tokens == 0) continue;
    it.pos = *m40llm_len_slot(c, layer, it.seq);
    c->batch[n++] = it;
  }
  *n_items = n;
  return M40LLM_OK;
}

static int append_batch(m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                        const int32_t *n_tokens, int n_seqs, const void *k, const void *v,
                        int dtype) {
  if (!c) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  if (layer < 0 || layer >= c->opts.n_layers)
    return FAIL(OUT_OF_RANGE, "layer %d is outside 0..%d", layer, c->opts.n_layers - 1);
  int n_items = 0;
  int rc = check_dtype(dtype);
  if (rc == M40LLM_OK) rc = prepare_batch(c, layer, seq_ids, n_tokens, n_seqs, k, v, dtype, &n_items);
  return rc != M40LLM_OK ? rc : run_append(c, layer, c->batch, n_items, k, v, dtype);
}

int m40llm_kvcache_append_batch_f32(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                    const int32_t *n_tokens, int n_seqs, const float *k,
                                    const float *v) {
  return append_batch(cache, layer, seq_ids, n_tokens, n_seqs, k, v, M40LLM_DTYPE_F32);
}

int m40llm_kvcache_append_batch_f16(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                    const int32_t *n_tokens, int n_seqs, const uint16_t *k,
                                    const uint16_t *v) {
  return append_batch(cache, layer, seq_ids, n_tokens, n_seqs, k, v, M40LLM_DTYPE_F16);
}

int m40llm_kvcache_append_batch_ex(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                   const int32_t *n_tokens, int n_seqs, const void *k,
                                   const void *v, int dtype) {
  return append_batch(cache, layer, seq_ids, n_tokens, n_seqs, k, v, dtype);
}

int m40llm_kvcache_read_f16(uint16_t *k_out, uint16_t *v_out, const m40llm_kvcache *cache,
                            int layer, int seq, int pos, int n_tokens) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  if (!k_out && !v_out) return FAIL(INVALID_ARGUMENT, "k_out and v_out are both NULL");
  int rc = check_layer_seq(cache, layer, seq);
  if (rc != M40LLM_OK) return rc;
  if (n_tokens < 1) return FAIL(INVALID_ARGUMENT, "n_tokens is %d, must be >= 1", n_tokens);
  const int len = *m40llm_len_slot(cache, layer, seq);
  if (pos < 0 || (long long)pos + n_tokens > len)
    return FAIL(OUT_OF_RANGE, "positions %d..%lld are outside layer %d seq %d (length %d)", pos,
                (long long)pos + n_tokens - 1, layer, seq, len);
  if ((rc = m40llm_context_check(cache->ctx)) != M40LLM_OK) return rc;
  /* A tiered cache's read gathers row ops in the cache's scratch: calls on a context are
   * serialized (m40llm.h, Threading), reads included. */
  if (cache->n_tiers > 0)
    return m40llm_tiers_read((m40llm_kvcache *)cache, k_out, v_out, layer, seq, pos, n_tokens);
  return m40llm_context_result(cache->ctx,
                               cache->ctx->ops->read_f16(cache, k_out, v_out, layer, seq, pos,
                                                         n_tokens));
}

static int check_attention(const m40llm_kvcache *c, int layer, const void *q, const void *out,
                           int dtype, int n_rows, float *scale) {
  if (layer < 0 || layer >= c->opts.n_layers)
    return FAIL(OUT_OF_RANGE, "layer %d is outside 0..%d", layer, c->opts.n_layers - 1);
  const int rc = check_dtype(dtype);
  if (rc != M40LLM_OK) return rc;
  if (!q) return FAIL(INVALID_ARGUMENT, "q is NULL");
  if (!out) return FAIL(INVALID_ARGUMENT, "out is NULL");
  if (!isfinite(*scale)) return FAIL(INVALID_ARGUMENT, "scale is not finite");
  if (*scale == 0.0f) *scale = 1.0f / sqrtf((float)c->opts.head_dim);
  /* Bytes of q and of out: n_rows rows of n_heads x head_dim elements, which must fit in the
   * address space from where each starts. Said first, so that a wrong n_seqs is named as such. */
  const uintptr_t row =
      (uintptr_t)c->opts.n_heads * (uintptr_t)c->opts.head_dim * m40llm_dtype_size(dtype);
  const uintptr_t qa = (uintptr_t)q, oa = (uintptr_t)out;
  if ((uintptr_t)n_rows > UINTPTR_MAX / row || (uintptr_t)n_rows * row > UINTPTR_MAX - qa ||
      (uintptr_t)n_rows * row > UINTPTR_MAX - oa)
    return FAIL(INVALID_ARGUMENT,
                "%d row(s) of %ju bytes (n_heads x head_dim elements) from q or out pass the end of "
                "the address space: n_seqs (or the rows counted) is too large",
                n_rows, (uintmax_t)row);
  const uintptr_t n = (uintptr_t)n_rows * row;
  if (qa < oa + n && oa < qa + n)
    return FAIL(INVALID_ARGUMENT,
                "q and out overlap: %d row(s) of %ju bytes make each %ju bytes, but they start "
                "%ju bytes apart (is n_seqs, or are the rows counted, more than the buffers hold?)",
                n_rows, (uintmax_t)row, (uintmax_t)n, (uintmax_t)(qa > oa ? qa - oa : oa - qa));
  return M40LLM_OK;
}

/* An exported buffer's rows (n_rows x per_row of stride floats, named `name`) fit the address
 * space and overlap neither q nor out (row_bytes each, of the call's dtype). */
static int check_export(const char *name, const float *buf, size_t stride, int n_rows,
                        int per_row, const void *q, const void *out, uintptr_t row_bytes) {
  if (!buf) return FAIL(INVALID_ARGUMENT, "%s is NULL", name);
  const uintptr_t rows = (uintptr_t)n_rows * (uintptr_t)per_row;
  const uintptr_t wa = (uintptr_t)buf;
  if (stride > 0 && (rows > UINTPTR_MAX / sizeof(float) / stride ||
                     rows * stride * sizeof(float) > UINTPTR_MAX - wa))
    return FAIL(INVALID_ARGUMENT,
                "%ju rows of %zu floats from %s pass the end of the address space",
                (uintmax_t)rows, stride, name);
  const uintptr_t n = rows * stride * sizeof(float), io = (uintptr_t)n_rows * row_bytes;
  const uintptr_t qa = (uintptr_t)q, oa = (uintptr_t)out;
  if (n > 0 && ((wa < qa + io && qa < wa + n) || (wa < oa + io && oa < wa + n)))
    return FAIL(INVALID_ARGUMENT, "%s (%ju bytes: %ju rows of %zu floats) overlap %s", name,
                (uintmax_t)n, (uintmax_t)rows, stride,
                wa < qa + io && qa < wa + n ? "q" : "out");
  return M40LLM_OK;
}

/* Ids copied on the stack up to this many; more come from the heap. */
#define M40LLM_IDS_ON_STACK 64

/* What an attention call exports besides its output (attn_batch's `mode`). */
enum { EXPORT_WEIGHTS, EXPORT_IMPORTANCE, EXPORT_OBSERVE };

/* What the cache's own observe calls export (m40llm_kvcache_options.observe_interval). */
static const m40llm_attn_export observe_export = {NULL, 0, NULL, 0, 0.0f, NULL, NULL, 1};

/* Whether a plain call of layer on n checked ids is one of the cache's own observe calls: due,
 * the ids distinct, and the context's stream not being captured (an observe call cannot be). */
static int observes_itself(m40llm_kvcache *c, int layer, const int32_t *ids, int n) {
  if (!m40llm_policy_due(c, layer, ids, n)) return 0;
  int distinct = 1;
  for (int i = 0; i < n; i++) {
    distinct &= !c->batch_seen[ids[i]];
    c->batch_seen[ids[i]] = 1;
  }
  for (int i = 0; i < n; i++) c->batch_seen[ids[i]] = 0;
  const m40llm_backend_ops *ops = c->ctx->ops;
  return distinct && !(ops->capturing && ops->capturing(c->ctx));
}

/* After the backend's attention of a call on checked ids (rc: its status): an observe call's
 * ranking and the host's view of its sequences, or a plain call counted toward the next. */
static int attended(m40llm_kvcache *c, int layer, const int32_t *ids, int n, int observe, int rc) {
  if (!observe) {
    if (rc == M40LLM_OK) m40llm_policy_plain_call(c, layer, ids, n);
    return rc;
  }
  if (rc == M40LLM_OK)
    rc = m40llm_context_result(c->ctx, c->ctx->ops->tier_rank(c, layer, ids, n));
  /* A failure past the backend's first launch (a device fault) may have counted the call in
   * some sums: the host no longer trusts what it knows of them. */
  if (rc == M40LLM_OK) m40llm_policy_observed(c, layer, ids, n);
  else m40llm_policy_unknown(c, layer, ids, n);
  return rc;
}

/* The batch call, exporting what x asks (not yet checked): nothing (NULL: a plain call, which
 * may be one of the cache's own observe calls), its weights, its importance, or (observe) the
 * weights the cache's importance placement sums. */
static int attn_batch(void *out, const m40llm_attn_export *x, int mode,
                      m40llm_kvcache *cache, int layer, const int32_t *seq_ids, int n_seqs,
                      const void *q, int dtype, float scale) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  if (!seq_ids) return FAIL(INVALID_ARGUMENT, "seq_ids is NULL");
  if (n_seqs < 1) return FAIL(INVALID_ARGUMENT, "n_seqs is %d, must be >= 1", n_seqs);
  int rc = check_attention(cache, layer, q, out, dtype, n_seqs, &scale);
  if (rc != M40LLM_OK) return rc;
  const char *name = NULL;
  size_t stride = 0;
  if (x) {
    const uintptr_t row_bytes = (uintptr_t)cache->opts.n_heads *
                                (uintptr_t)cache->opts.head_dim * m40llm_dtype_size(dtype);
    if (mode == EXPORT_OBSERVE) {
      name = "importance";
      stride = (size_t)cache->opts.max_seq_len; /* the cache's own rows: always long enough */
      if (cache->opts.placement != M40LLM_PLACE_IMPORTANCE)
        return FAIL(INVALID_ARGUMENT,
                    "the cache's placement is not M40LLM_PLACE_IMPORTANCE: it keeps no importance "
                    "to observe into");
    } else if (mode == EXPORT_IMPORTANCE) {
      name = "importance";
      stride = x->importance_stride;
      if (!(x->decay >= 0.0f && x->decay <= 1.0f))
        return FAIL(INVALID_ARGUMENT, "decay is %g, must be in [0, 1]", (double)x->decay);
      rc = check_export(name, x->importance, stride, n_seqs, cache->opts.n_kv_heads, q, out,
                        row_bytes);
    } else {
      name = "weights";
      stride = x->weights_stride;
      rc = check_export(name, x->weights, stride, n_seqs, cache->opts.n_heads, q, out,
                        row_bytes);
    }
    if (rc != M40LLM_OK) return rc;
  }
  /* The ids are read once, here, into the library's own copy, which is checked and then the
   * only one the backend sees: the caller's array may share memory with out (which the backend
   * writes) and is not read again. */
  int32_t on_stack[M40LLM_IDS_ON_STACK];
  int32_t *ids = on_stack;
  if (n_seqs > M40LLM_IDS_ON_STACK) {
    ids = m40llm_host_malloc((size_t)n_seqs * sizeof *ids);
    if (!ids)
      return FAIL(OUT_OF_MEMORY, "allocating the copy of %d sequence ids", n_seqs);
  }
  memcpy(ids, seq_ids, (size_t)n_seqs * sizeof *ids);
  for (int i = 0; i < n_seqs && rc == M40LLM_OK; i++) {
    if (ids[i] < 0 || ids[i] >= cache->opts.max_seqs)
      rc = FAIL(OUT_OF_RANGE, "seq_ids[%d] = %d is outside 0..%d", i, (int)ids[i],
                cache->opts.max_seqs - 1);
    else if (mode == EXPORT_OBSERVE && cache->batch_seen[ids[i]])
      rc = FAIL(INVALID_ARGUMENT, "seq_ids[%d] = %d repeats seq_ids[%d]: an observe call names "
                "each sequence once", i, (int)ids[i], cache->batch_seen[ids[i]] - 1);
    else if (x && (size_t)*m40llm_len_slot(cache, layer, ids[i]) > stride)
      rc = FAIL(INVALID_ARGUMENT,
                "%s_stride is %zu, but seq_ids[%d] = %d has %d positions in layer %d: a "
                "row of %s holds every position of its sequence",
                name, stride, i, (int)ids[i], *m40llm_len_slot(cache, layer, ids[i]), layer,
                name);
    if (mode == EXPORT_OBSERVE && rc == M40LLM_OK) cache->batch_seen[ids[i]] = i + 1;
  }
  if (mode == EXPORT_OBSERVE)
    for (int i = 0; i < n_seqs; i++)
      if (ids[i] >= 0 && ids[i] < cache->opts.max_seqs) cache->batch_seen[ids[i]] = 0;
  if (rc == M40LLM_OK) rc = m40llm_context_check(cache->ctx);
  if (rc == M40LLM_OK) {
    int observe = mode == EXPORT_OBSERVE;
    if (!x && observes_itself(cache, layer, ids, n_seqs)) x = &observe_export, observe = 1;
    rc = m40llm_context_result(cache->ctx,
                               cache->ctx->ops->attention(cache, layer, ids, n_seqs, q, out,
                                                          dtype, scale, x));
    if (!x || observe) rc = attended(cache, layer, ids, n_seqs, observe, rc);
  }
  if (ids != on_stack) free(ids);
  return rc;
}

int m40llm_kvcache_attn_batch_ex(void *out, m40llm_kvcache *cache, int layer,
                                 const int32_t *seq_ids, int n_seqs, const void *q, int dtype,
                                 float scale) {
  return attn_batch(out, NULL, EXPORT_WEIGHTS, cache, layer, seq_ids, n_seqs, q, dtype, scale);
}

int m40llm_kvcache_attn_weights_ex(void *out, float *weights, size_t weights_stride,
                                   m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                   int n_seqs, const void *q, int dtype, float scale) {
  const m40llm_attn_export x = {weights, weights_stride, NULL, 0, 0.0f, NULL, NULL, 0};
  return attn_batch(out, &x, EXPORT_WEIGHTS, cache, layer, seq_ids, n_seqs, q, dtype, scale);
}

int m40llm_kvcache_attn_importance_ex(void *out, float *importance, size_t importance_stride,
                                      float decay, m40llm_kvcache *cache, int layer,
                                      const int32_t *seq_ids, int n_seqs, const void *q,
                                      int dtype, float scale) {
  const m40llm_attn_export x = {NULL, 0, importance, importance_stride, decay, NULL, NULL, 0};
  return attn_batch(out, &x, EXPORT_IMPORTANCE, cache, layer, seq_ids, n_seqs, q, dtype, scale);
}

int m40llm_kvcache_attn_observe_ex(void *out, m40llm_kvcache *cache, int layer,
                                   const int32_t *seq_ids, int n_seqs, const void *q, int dtype,
                                   float scale) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  const m40llm_attn_export x = {NULL, 0, NULL, 0, 0.0f, NULL, NULL, 1};
  return attn_batch(out, &x, EXPORT_OBSERVE, cache, layer, seq_ids, n_seqs, q, dtype, scale);
}

int m40llm_kvcache_attn_batch_f32q(float *out, m40llm_kvcache *cache, int layer,
                                   const int32_t *seq_ids, int n_seqs, const float *q,
                                   float scale) {
  return m40llm_kvcache_attn_batch_ex(out, cache, layer, seq_ids, n_seqs, q, M40LLM_DTYPE_F32,
                                      scale);
}

int m40llm_kvcache_attn_last_token_f32q(float *out, m40llm_kvcache *cache, int layer, int seq,
                                        const float *q, float scale) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc = check_seq(cache, "seq", seq);
  if (rc != M40LLM_OK) return rc;
  const int32_t id = seq;
  return m40llm_kvcache_attn_batch_f32q(out, cache, layer, &id, 1, q, scale);
}

/* Whether out's n_rows query rows share a byte with n_rows K/V rows at kv (the call's dtype):
 * append_attn then appends before it attends, as it says it reads k and v first. */
static int out_meets_rows(const m40llm_kvcache *c, const void *out, const void *kv, int n_rows,
                          int dtype) {
  const uintptr_t e = m40llm_dtype_size(dtype), d = (uintptr_t)c->opts.head_dim;
  const uintptr_t oa = (uintptr_t)out, ka = (uintptr_t)kv;
  const uintptr_t on = (uintptr_t)n_rows * (uintptr_t)c->opts.n_heads * d * e;
  const uintptr_t kn = (uintptr_t)n_rows * (uintptr_t)c->opts.n_kv_heads * d * e;
  return oa < ka + kn && ka < oa + on;
}

int m40llm_kvcache_append_attn_ex(void *out, m40llm_kvcache *cache, int layer,
                                  const int32_t *seq_ids, int n_seqs, const void *k,
                                  const void *v, const void *q, int dtype, float scale) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  int rc = check_attention(cache, layer, q, out, dtype, n_seqs > 0 ? n_seqs : 0, &scale);
  if (rc != M40LLM_OK) return rc;
  int n_items = 0;
  /* Every id is checked and read before the append writes (seq_ids may share memory with out,
   * which the attention writes): the items keep them in order, one token each. */
  if ((rc = prepare_batch(cache, layer, seq_ids, NULL, n_seqs, k, v, dtype, &n_items)) !=
      M40LLM_OK)
    return rc;
  for (int i = 0; i < n_items; i++) cache->batch_ids[i] = cache->batch[i].seq;
  /* What would fail the attention (q or out the backend cannot use, a buffer it cannot grow, an
   * observe call's scratch among them) fails before the append writes. */
  const int observe = observes_itself(cache, layer, cache->batch_ids, n_items);
  int observe_len = 0;
  for (int i = 0; i < n_items && observe; i++) {
    const int len = *m40llm_len_slot(cache, layer, cache->batch[i].seq) + 1;
    observe_len = len > observe_len ? len : observe_len;
  }
  if ((rc = m40llm_context_check(cache->ctx)) != M40LLM_OK ||
      (rc = m40llm_context_result(cache->ctx,
                                  cache->ctx->ops->prepare_attention(cache, n_items, q, out, dtype,
                                                                     observe_len))) != M40LLM_OK)
    return rc;
  const m40llm_backend_ops *ops = cache->ctx->ops;
  if (n_items > 0 && cache->n_tiers == 0 && ops->attention_appends &&
      ops->attention_appends(cache) && !out_meets_rows(cache, out, k, n_items, dtype) &&
      !out_meets_rows(cache, out, v, n_items, dtype)) {
    /* One backend call writes the rows and attends: it sees the lengths that count them. A
     * failure leaves the lengths as they were (a row written past them is not there). */
    for (int i = 0; i < n_items; i++) *m40llm_len_slot(cache, layer, cache->batch[i].seq) += 1;
    const m40llm_attn_export x = {NULL, 0, NULL, 0, 0.0f, k, v, 0};
    rc = m40llm_context_result(cache->ctx, ops->attention(cache, layer, cache->batch_ids,
                                                          n_items, q, out, dtype, scale, &x));
    for (int i = 0; i < n_items; i++) *m40llm_len_slot(cache, layer, cache->batch[i].seq) -= 1;
    if (rc == M40LLM_OK) appended(cache, layer, cache->batch, n_items);
    return rc;
  }
  if ((rc = run_append(cache, layer, cache->batch, n_items, k, v, dtype)) != M40LLM_OK) return rc;
  rc = m40llm_context_result(cache->ctx,
                             ops->attention(cache, layer, cache->batch_ids, n_items, q, out,
                                            dtype, scale, observe ? &observe_export : NULL));
  return attended(cache, layer, cache->batch_ids, n_items, observe, rc);
}

int m40llm_kvcache_append_attn_f32q(float *out, m40llm_kvcache *cache, int layer,
                                    const int32_t *seq_ids, int n_seqs, const float *k,
                                    const float *v, const float *q, float scale) {
  return m40llm_kvcache_append_attn_ex(out, cache, layer, seq_ids, n_seqs, k, v, q,
                                       M40LLM_DTYPE_F32, scale);
}

int m40llm_causal_options_init(m40llm_causal_options *opts, unsigned version) {
  if (!opts) return FAIL(INVALID_ARGUMENT, "opts is NULL");
  if (version != 1)
    return FAIL(INVALID_ARGUMENT,
                "causal options version %u is not supported (this library knows 1 to %u)",
                version, M40LLM_CAUSAL_OPTIONS_VERSION);
  const m40llm_causal_options defaults = M40LLM_CAUSAL_OPTIONS_INIT;
  *opts = defaults;
  return M40LLM_OK;
}

/* Reads the causal call's ids and counts once into c->batch and checks them against the
 * layer's lengths (the layer is checked): each id in range and named once, each count 1..len.
 * Leaves the items there, positions set, and the rows' sum in *out_rows. */
static int prepare_causal(m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          const int32_t *q_counts, int n_seqs, int *out_rows) {
  int rc = read_batch(c, seq_ids, q_counts, n_seqs);
  if (rc != M40LLM_OK) return rc;
  long long rows = 0;
  for (int i = 0; i < n_seqs && rc == M40LLM_OK; i++) {
    m40llm_append_item *it = &c->batch[i];
    if (it->seq < 0 || it->seq >= c->opts.max_seqs) {
      rc = FAIL(OUT_OF_RANGE, "seq_ids[%d] = %d is outside 0..%d", i, (int)it->seq,
                c->opts.max_seqs - 1);
      break;
    }
    int *seen = &c->batch_seen[it->seq];
    if (*seen) {
      rc = FAIL(INVALID_ARGUMENT, "seq_ids[%d] = %d repeats seq_ids[%d]: a call names each "
                "sequence once", i, (int)it->seq, *seen - 1);
      break;
    }
    *seen = i + 1;
    const int len = *m40llm_len_slot(c, layer, it->seq);
    if (it->n_tokens < 1 || it->n_tokens > len)
      rc = FAIL(INVALID_ARGUMENT,
                "q_counts[%d] is %d, must be 1..%d (the length of layer %d seq %d, whose last "
                "q_counts[%d] positions are the query rows' own: append them first)",
                i, (int)it->n_tokens, len, layer, (int)it->seq, i);
    it->pos = len - it->n_tokens;
    rows += it->n_tokens;
  }
  for (int i = 0; i < n_seqs; i++) /* only ids in range were marked */
    if (c->batch[i].seq >= 0 && c->batch[i].seq < c->opts.max_seqs)
      c->batch_seen[c->batch[i].seq] = 0;
  if (rc != M40LLM_OK) return rc;
  if (rows > INT32_MAX) return FAIL(INVALID_ARGUMENT, "the counts add up to %lld rows", rows);
  *out_rows = (int)rows;
  return M40LLM_OK;
}

int m40llm_kvcache_attn_causal_ex(void *out, m40llm_kvcache *cache, int layer,
                                  const int32_t *seq_ids, const int32_t *q_counts, int n_seqs,
                                  const void *q, int dtype, const m40llm_causal_options *opts) {
  if (!cache) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  m40llm_causal_options o = M40LLM_CAUSAL_OPTIONS_INIT;
  if (opts) {
    if (opts->version != 1)
      return FAIL(INVALID_ARGUMENT,
                  "opts->version %u is not supported (this library knows 1 to %u; use "
                  "M40LLM_CAUSAL_OPTIONS_INIT)",
                  opts->version, M40LLM_CAUSAL_OPTIONS_VERSION);
    o = *opts;
  }
  if (o.window < 0)
    return FAIL(INVALID_ARGUMENT, "opts->window is %d, must be >= 0 (0: no window)", o.window);
  if (layer < 0 || layer >= cache->opts.n_layers)
    return FAIL(OUT_OF_RANGE, "layer %d is outside 0..%d", layer, cache->opts.n_layers - 1);
  int rows = 0;
  int rc = prepare_causal(cache, layer, seq_ids, q_counts, n_seqs, &rows);
  if (rc != M40LLM_OK || (rc = check_attention(cache, layer, q, out, dtype, rows, &o.scale)) != M40LLM_OK ||
      (rc = m40llm_context_check(cache->ctx)) != M40LLM_OK)
    return rc;
  return m40llm_context_result(cache->ctx,
                               cache->ctx->ops->attention_causal(cache, layer, cache->batch,
                                                                 n_seqs, q, out, dtype,
                                                                 o.scale, o.window));
}

int m40llm_kvcache_attn_causal_f32q(float *out, m40llm_kvcache *cache, int layer,
                                    const int32_t *seq_ids, const int32_t *q_counts,
                                    int n_seqs, const float *q,
                                    const m40llm_causal_options *opts) {
  return m40llm_kvcache_attn_causal_ex(out, cache, layer, seq_ids, q_counts, n_seqs, q,
                                       M40LLM_DTYPE_F32, opts);
}

/* ---- For the capacity planner (capacity.c) ---- */

int m40llm_kvcache_read_options(m40llm_kvcache_options *out, const m40llm_kvcache_options *in) {
  return read_options(out, in);
}

/* ---- Tiers ---- */

static int check_tiered(const m40llm_kvcache *c, int layer, int seq) {
  if (!c) return FAIL(INVALID_ARGUMENT, "cache is NULL");
  if (c->n_tiers == 0)
    return FAIL(INVALID_ARGUMENT, "the cache has no tiers (its options' n_tiers is 0)");
  return check_layer_seq(c, layer, seq);
}

int m40llm_kvcache_tier_move(m40llm_kvcache *cache, int layer, int seq, int begin, int end,
                             int tier) {
  int rc = check_tiered(cache, layer, seq);
  if (rc != M40LLM_OK) return rc;
  const int len = *m40llm_len_slot(cache, layer, seq);
  if (begin < 0 || begin > end || end > len)
    return FAIL(OUT_OF_RANGE, "positions [%d, %d) of layer %d seq %d: must satisfy 0 <= begin "
                "<= end <= the length %d", begin, end, layer, seq, len);
  if (tier < 0 || tier >= cache->n_tiers)
    return FAIL(OUT_OF_RANGE, "tier %d is outside 0..%d", tier, cache->n_tiers - 1);
  if ((rc = m40llm_context_check(cache->ctx)) != M40LLM_OK) return rc;
  return m40llm_context_result(cache->ctx,
                               m40llm_tiers_move(cache, layer, seq, begin, end, tier));
}

int m40llm_kvcache_tier_rows(int32_t *out_rows, const m40llm_kvcache *cache, int layer, int seq) {
  if (!out_rows) return FAIL(INVALID_ARGUMENT, "out_rows is NULL");
  const int rc = check_tiered(cache, layer, seq);
  if (rc != M40LLM_OK) return rc;
  memcpy(out_rows, m40llm_tier_counts(cache, layer, seq), (size_t)cache->n_tiers * sizeof *out_rows);
  return M40LLM_OK;
}

int m40llm_kvcache_tier_stats(m40llm_tier_stats *out, const m40llm_kvcache *cache) {
  if (!out) return FAIL(INVALID_ARGUMENT, "out is NULL");
  const unsigned version = out->version;
  if (version < 1 || version > M40LLM_TIER_STATS_VERSION)
    return FAIL(INVALID_ARGUMENT, "out->version %u is not supported (this library knows 1 to %u; "
                "use M40LLM_TIER_STATS_INIT)", version, M40LLM_TIER_STATS_VERSION);
  const int rc = check_tiered(cache, 0, 0);
  if (rc != M40LLM_OK) return rc;
  const m40llm_kvcache_options *o = &cache->opts;
  m40llm_tier_stats st = M40LLM_TIER_STATS_INIT;
  st.n_tiers = cache->n_tiers;
  int64_t positions = 0;
  for (int l = 0; l < o->n_layers; l++)
    for (int s = 0; s < o->max_seqs; s++) {
      const int32_t *count = m40llm_tier_counts(cache, l, s);
      int64_t held = 0;
      for (int t = 0; t < cache->n_tiers; t++) st.rows[t] += count[t], held += count[t];
      positions += *m40llm_len_slot(cache, l, s);
      st.kept_rows += *m40llm_len_slot(cache, l, s) - held;
    }
  /* A row's bytes in one K/V head: the bits of a position are the same in every head. */
  double bytes = (double)st.kept_rows * 2.0 * 2.0 * o->head_dim;
  for (int t = 0; t < cache->n_tiers; t++) {
    st.free_rows[t] = (int64_t)o->tiers[t].rows * o->n_layers * o->max_seqs - st.rows[t];
    size_t row = 0;
    for (int p = 0; p < M40LLM_KV_PLANES; p++)
      row += cache->tier_k[t].layout.row_bytes[p] + cache->tier_v[t].layout.row_bytes[p];
    /* a head's share of the row's 4-byte slot map entry (tier_map) */
    bytes += (double)st.rows[t] * ((double)row + 4.0 / o->n_kv_heads);
  }
  st.bits_per_value = positions > 0 ? 8.0 * bytes / ((double)positions * 2.0 * o->head_dim) : 0.0;
  st.moved_rows = cache->tier_moved;
  st.demoted_rows = cache->imp_demoted;
  st.observe_calls = cache->imp_observed;
  st.version = version;
  memcpy(out, &st,
         version == 1   ? offsetof(m40llm_tier_stats, demoted_rows)
         : version == 2 ? offsetof(m40llm_tier_stats, observe_calls)
                        : sizeof st);
  return M40LLM_OK;
}

int m40llm_kvcache_tier_of(int *out_tier, const m40llm_kvcache *cache, int layer, int seq,
                           int pos) {
  if (!out_tier) return FAIL(INVALID_ARGUMENT, "out_tier is NULL");
  int rc = check_tiered(cache, layer, seq);
  if (rc != M40LLM_OK) return rc;
  const int len = *m40llm_len_slot(cache, layer, seq);
  if (pos < 0 || pos >= len)
    return FAIL(OUT_OF_RANGE, "pos %d of layer %d seq %d is outside [0, %d)", pos, layer, seq,
                len);
  if (m40llm_is_protected(cache, layer, seq, pos)) {
    *out_tier = -1;
    return M40LLM_OK;
  }
  const uint32_t w = m40llm_tier_where_of(cache, layer, seq)[pos];
  *out_tier = m40llm_where_tier(w);
  return M40LLM_OK;
}
