/* The stored bytes of the quantized formats (c/src/kv_format.c's CPU routines) against the
 * header's storage words, bit by bit: a kernel will load Q3 and Q2 codes by those words, so the
 * CPU backend's round trip through its own packing is not enough. Rows whose codes are known:
 * each group holds 0 and the format's largest code, so its scale is 1 and its minimum 0. */
#include <stdint.h>
#include <string.h>

#include "kv_format.h"
#include "test_util.h"

enum { GROUP = 32, D = 128 };

/* Code e of a group's bytes g, as m40llm.h's words for format fmt put it. */
static int header_code(int fmt, const uint8_t *g, int e) {
  switch (fmt) {
    case M40LLM_KV_Q4: return (g[e / 2] >> (4 * (e % 2))) & 15;
    case M40LLM_KV_Q2: return (g[e / 4] >> (2 * (e % 4))) & 3;
    default: /* Q3: two low bits as Q2's 8 bytes, bit 2 after them */
      return ((g[e / 4] >> (2 * (e % 4))) & 3) | ((g[8 + e / 8] >> (e % 8)) & 1) << 2;
  }
}

static void check_format(int fmt, int bits) {
  t_set_case("layout of format %d", fmt);
  const m40llm_kv_format_desc *f = m40llm_kv_format_find(fmt);
  if (!T_CHECK(f != NULL)) return;
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = 2, o.n_kv_heads = 1, o.head_dim = D, o.max_seqs = 3;
  o.max_seq_len = 5;
  m40llm_kv_layout l;
  size_t bytes = 0;
  if (!T_OK(m40llm_kv_layout_init(&l, &bytes, &o, fmt))) return;
  /* a group: 4 x bits bytes of codes and an FP16 (scale, min) pair */
  T_CHECKF(l.row_bytes[M40LLM_KV_CODES] == (size_t)D / GROUP * 4 * bits &&
               l.row_bytes[M40LLM_KV_PARAMS] == (size_t)D / GROUP * 4 && l.rows == 30 &&
               bytes == 30 * (size_t)D / GROUP * (4 * bits + 4),
           "row bytes %zu + %zu, rows %zu, bytes %zu", l.row_bytes[M40LLM_KV_CODES],
           l.row_bytes[M40LLM_KV_PARAMS], l.rows, bytes);
  const int qmax = (1 << bits) - 1;
  for (int trial = 0; trial < 50; trial++) {
    int want[D];
    float x[D], back[D];
    for (int i = 0; i < D; i++) want[i] = t_rand_int(0, qmax);
    for (int g = 0; g < D / GROUP; g++) {
      want[g * GROUP + t_rand_int(0, 15)] = 0;
      want[g * GROUP + 16 + t_rand_int(0, 15)] = qmax;
    }
    for (int i = 0; i < D; i++) x[i] = (float)want[i];
    uint8_t codes[D];
    uint16_t p[D / GROUP * 2];
    memset(codes, 0xA5, sizeof codes); /* bytes the encoder must write, whatever was there */
    f->encode_f32(codes, p, x, D);
    int bad = -1;
    for (int i = 0; i < D && bad < 0; i++)
      if (header_code(fmt, codes + i / GROUP * 4 * bits, i % GROUP) != want[i]) bad = i;
    T_CHECKF(bad < 0, "trial %d: code %d is not where the header says", trial, bad);
    for (int g = 0; g < D / GROUP; g++)
      T_CHECKF(p[2 * g] == t_f32_to_f16(1.0f) && p[2 * g + 1] == 0, "group %d: (%04x, %04x)", g,
               p[2 * g], p[2 * g + 1]);
    f->decode(back, codes, p, D);
    T_CHECK(memcmp(back, x, sizeof x) == 0);
  }
}

int main(void) {
  t_rng_init();
  check_format(M40LLM_KV_Q4, 4);
  check_format(M40LLM_KV_Q3, 3);
  check_format(M40LLM_KV_Q2, 2);
  return t_finish();
}
