// bench_attention: times m40llm_kvcache_attn_batch_ex (FP32 Q and out, or --io f16/bf16; FP16 K/V
// by default, --format for the others; decode attention) over a grid of decode shapes, next to
// two ceilings measured in the same run:
//   copy  cudaMemcpyAsync device-to-device of a 4 GiB buffer, bytes read + bytes written
//   read  a read-only sweep kernel over one 4 GiB buffer (16-byte loads, grid-stride)
// and the launch floor: the per-call time, in a CUDA graph, of one and of two empty kernels (one
// block per SM), launched as the library launches its split and combine kernels.
//
// Method (printed into the JSON as "method" too):
// - Each shape gets one cache with n_layers = R ("rotation"), max_seqs = batch, max_seq_len = ctx,
//   every sequence filled to ctx with random FP16 (append_f16 in chunks, data made on the GPU).
//   R is chosen so R * (K+V bytes of one layer) >= max(4 * L2, 256 MiB), capped by --rot-cap and
//   free memory; consecutive calls use consecutive layers, so repeated runs don't hit in L2.
// - warm-up: one call on each of the first 64 layers, then --warmup-ms (50) of calls.
// - eager: samples of K back-to-back calls between two cudaEvents (K so a sample is >= ~0.1 ms);
//   per-call time = sample / K; median over samples (no host sync between samples).
// - graph: G >= R calls (one per layer, cycling) captured into one CUDA graph on the context's stream;
//   per-call time = replay time / G; median over replays. Done for batch 1 with ctx <= 2048 and for
//   any shape whose eager per-call time is under --graph-below-us.
// - time_us = graph time when measured, else eager time. bytes = K/V read (2*2*B*Hkv*L*D) + Q read
//   (B*H*D*4) + out written (B*H*D*4). GB/s = bytes / time_us / 1e3.
// - check: one more call on layer 0; every output finite and |out| <= 1 (V is in [-1,1]); for
//   seq 0 and seq B-1 a few heads against a double-precision host reference built from read_f16.
//
// Usage: bench_attention [--json PATH] [--quick] [--batch 1,8] [--ctx 512,2K] [--heads 32/8,64/8]
//                        [--dim 128] [--shape B,H,Hkv,D,L]... [--rot-cap N] [--sample-ms X]
//                        [--budget-ms X] [--graph-below-us X] [--no-graph] [--no-check]
//                        [--device N] [--list]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "m40llm.h"

// ---------------------------------------------------------------------------------------------
// Errors

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "bench: %s:%d: %s: %s\n", __FILE__, __LINE__, #expr,            \
                   cudaGetErrorString(err_));                                              \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

static std::string m40_err(int rc) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, "%s (%d): %s", m40llm_status_string(rc), rc,
                m40llm_last_error_message());
  return buf;
}

#define M40_FATAL(expr)                                                                    \
  do {                                                                                     \
    int rc_ = (expr);                                                                      \
    if (rc_ != M40LLM_OK) {                                                                \
      std::fprintf(stderr, "bench: %s:%d: %s: %s\n", __FILE__, __LINE__, #expr,            \
                   m40_err(rc_).c_str());                                                  \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Kernels: random fill and read sweep

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1).
__device__ __forceinline__ float rand_pm1(uint64_t seed, size_t i) {
  uint64_t h = splitmix64(seed * 0xD1B54A32D192ED03ull + (uint64_t)i);
  return (float)(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void fill_f16_kernel(uint16_t *p, size_t n, uint64_t seed) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = __half_as_ushort(__float2half_rn(rand_pm1(seed, i)));
}

__global__ void fill_f32_kernel(float *p, size_t n, uint64_t seed) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = rand_pm1(seed, i);
}

// Reads n16 16-byte words once each: four independent loads in flight per thread per step.
__global__ void read_sweep_kernel(const uint4 *__restrict__ p, size_t n16, unsigned *out) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
          d = __ldg(p + i + 3 * stride);
    acc += (a.x ^ b.x ^ c.x ^ d.x) + (a.y ^ b.y ^ c.y ^ d.y) + (a.z ^ b.z ^ c.z ^ d.z) +
           (a.w ^ b.w ^ c.w ^ d.w);
  }
  for (; i < n16; i += stride) {
    uint4 a = __ldg(p + i);
    acc += a.x + a.y + a.z + a.w;
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

static int g_sms = 1;

static void fill_f16(cudaStream_t st, uint16_t *p, size_t n, uint64_t seed) {
  int blocks = (int)std::min<size_t>((n + 255) / 256, (size_t)g_sms * 16);
  fill_f16_kernel<<<blocks, 256, 0, st>>>(p, n, seed);
  CUDA_CHECK(cudaGetLastError());
}

static void fill_f32(cudaStream_t st, float *p, size_t n, uint64_t seed) {
  int blocks = (int)std::min<size_t>((n + 255) / 256, (size_t)g_sms * 16);
  fill_f32_kernel<<<blocks, 256, 0, st>>>(p, n, seed);
  CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// Small helpers

static double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double vmin(const std::vector<double> &v) {
  return v.empty() ? NAN : *std::min_element(v.begin(), v.end());
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// half -> float through a table (the host reference converts up to ~10^8 values per shape).
static const std::vector<float> &half_table() {
  static std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t i = 0; i < 65536; i++) v[i] = half_to_float((uint16_t)i);
    return v;
  }();
  return t;
}

static std::string json_str(const std::string &s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if ((unsigned char)c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", (unsigned)(unsigned char)c);
      o += b;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

static std::string json_num(double x) {
  if (!std::isfinite(x)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}

// Events recorded back to back on one stream: e[0], work, e[1], work, ... ; returns ms between
// consecutive pairs.
struct EventRing {
  std::vector<cudaEvent_t> ev;
  explicit EventRing(size_t n) : ev(n) {
    for (auto &e : ev) CUDA_CHECK(cudaEventCreate(&e));
  }
  ~EventRing() {
    for (auto &e : ev) cudaEventDestroy(e);
  }
  std::vector<double> elapsed_ms() {
    CUDA_CHECK(cudaEventSynchronize(ev.back()));
    std::vector<double> r;
    for (size_t i = 0; i + 1 < ev.size(); i++) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
      r.push_back(ms);
    }
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// Shapes and options

struct Shape {
  int batch, n_heads, n_kv_heads, head_dim, ctx;
};

struct Options {
  std::string json_path;
  bool quick = false, list = false, graph = true, check = true;
  std::vector<int> batches, ctxs, dims;
  std::vector<std::pair<int, int>> heads;
  std::vector<Shape> explicit_shapes;
  int rot_cap = 2048;
  double sample_ms = 0.1;       // eager sample / graph replay aims at least this long
  double budget_ms = 250.0;     // measured time per shape and mode, roughly
  double warmup_ms = 50.0;      // calls before the eager samples
  double graph_below_us = 100;  // also graph any shape whose eager call is faster than this
  int device = 0;
  int k_format = M40LLM_KV_F16, v_format = M40LLM_KV_SAME;  // --format
  std::string format_name = "F16";
  int kv_rotation = M40LLM_ROTATE_AUTO;  // --kv-rotation
  int kv_sinks = 4, kv_window = 128;      // --kv-protect
  int io = M40LLM_DTYPE_F32;              // --io: q and out element type
  std::string io_name = "f32";
  bool weights = false;  // --weights: m40llm_kvcache_attn_weights_ex, weights of every head
  bool importance = false;  // --importance: m40llm_kvcache_attn_importance_ex
  bool observe = false;     // --observe: m40llm_kvcache_attn_observe_ex (needs --tiers)
  // --tiers: a tiered cache, each tier's (K, V) formats and share of the quantized rows
  std::vector<std::pair<int, int>> tier_formats;
  std::vector<double> tier_shares;
};

// The formats of a name of --format (and of a --tiers entry); false for none.
static bool format_pair(const std::string &f, int *k, int *v) {
  if (f == "F16") *k = M40LLM_KV_F16, *v = M40LLM_KV_SAME;
  else if (f == "Q8") *k = M40LLM_KV_Q8, *v = M40LLM_KV_SAME;
  else if (f == "Q4") *k = M40LLM_KV_Q4, *v = M40LLM_KV_SAME;
  else if (f == "Q8Q4") *k = M40LLM_KV_Q8, *v = M40LLM_KV_Q4;
  else if (f == "Q4Q3") *k = M40LLM_KV_Q4, *v = M40LLM_KV_Q3;
  else if (f == "Q4Q2") *k = M40LLM_KV_Q4, *v = M40LLM_KV_Q2;
  else if (f == "Q8Q8") *k = M40LLM_KV_Q8, *v = M40LLM_KV_Q8;
  else if (f == "Q4Q4") *k = M40LLM_KV_Q4, *v = M40LLM_KV_Q4;
  else if (f == "Q8Q3") *k = M40LLM_KV_Q8, *v = M40LLM_KV_Q3;
  else if (f == "Q8Q2") *k = M40LLM_KV_Q8, *v = M40LLM_KV_Q2;
  else return false;
  return true;
}

// A tiered cache's tiers for a context of ctx (--tiers): each tier's share of the rows that
// leave the window, the last taking what rounding leaves, so a full context fills every tier.
static void apply_tiers(m40llm_kvcache_options &ko, const Options &o, int ctx) {
  if (o.tier_formats.empty()) return;
  const int sinks = std::min(o.kv_sinks, ctx), window = std::min(o.kv_window, ctx - sinks);
  const int rows = ctx - sinks - window;
  ko.n_tiers = (int)o.tier_formats.size();
  int left = rows;
  for (int t = 0; t < ko.n_tiers; t++) {
    ko.tiers[t].k_format = o.tier_formats[t].first;
    ko.tiers[t].v_format = o.tier_formats[t].second == M40LLM_KV_SAME ? o.tier_formats[t].first
                                                                       : o.tier_formats[t].second;
    ko.tiers[t].rows = t + 1 == ko.n_tiers ? left : (int)std::lround(o.tier_shares[t] * rows);
    left -= ko.tiers[t].rows;
  }
  ko.format = ko.tiers[0].k_format;
  ko.v_format = ko.tiers[0].v_format;
}

static std::vector<Shape> full_grid(bool quick) {
  std::vector<Shape> g;
  if (quick) {
    for (auto hk : {std::make_pair(32, 32), std::make_pair(32, 8)})
      for (int b : {1, 32})
        for (int l : {2048, 32768}) g.push_back({b, hk.first, hk.second, 128, l});
    g.push_back({1, 32, 8, 64, 2048});
    return g;
  }
  struct HD {
    int h, hkv, d;
  };
  const HD hds[] = {{32, 32, 128}, {32, 8, 128}, {64, 8, 128}, {32, 8, 64}};
  for (const HD &hd : hds)
    for (int b : {1, 8, 32, 64}) {
      for (int l : {512, 2048, 8192, 32768}) g.push_back({b, hd.h, hd.hkv, hd.d, l});
      if (b == 1) g.push_back({b, hd.h, hd.hkv, hd.d, 131072});
    }
  // head_dim 256 (groups 8, 2, 2 and 1) and group 7, at fewer batches and lengths (issue 16).
  const HD more[] = {{8, 1, 256}, {16, 8, 256}, {32, 16, 256}, {32, 32, 256}, {28, 4, 128}};
  for (const HD &hd : more) {
    for (int l : {8192, 32768}) g.push_back({1, hd.h, hd.hkv, hd.d, l});
    g.push_back({8, hd.h, hd.hkv, hd.d, 8192});
    g.push_back({32, hd.h, hd.hkv, hd.d, 2048});
  }
  return g;
}

static bool in_list(const std::vector<int> &v, int x) {
  return v.empty() || std::find(v.begin(), v.end(), x) != v.end();
}

static std::vector<Shape> select_grid(const Options &o) {
  std::vector<Shape> base = o.explicit_shapes.empty() ? full_grid(o.quick) : o.explicit_shapes;
  std::vector<Shape> r;
  for (const Shape &s : base) {
    bool hk_ok = o.heads.empty();
    for (auto hk : o.heads) hk_ok |= (hk.first == s.n_heads && hk.second == s.n_kv_heads);
    if (hk_ok && in_list(o.batches, s.batch) && in_list(o.ctxs, s.ctx) && in_list(o.dims, s.head_dim))
      r.push_back(s);
  }
  return r;
}

static int parse_int_k(const char *s) {  // "512", "2K", "2k", "128K", "1M"
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(s, &end, 10);
  if (end == s || errno) {
    std::fprintf(stderr, "bench: bad number '%s'\n", s);
    std::exit(2);
  }
  if (*end == 'k' || *end == 'K') v *= 1024, end++;
  else if (*end == 'm' || *end == 'M') v *= 1024 * 1024, end++;
  if (*end) {
    std::fprintf(stderr, "bench: bad number '%s'\n", s);
    std::exit(2);
  }
  return (int)v;
}

static std::vector<std::string> split(const std::string &s, char sep) {
  std::vector<std::string> r;
  size_t a = 0;
  while (true) {
    size_t b = s.find(sep, a);
    r.push_back(s.substr(a, b == std::string::npos ? std::string::npos : b - a));
    if (b == std::string::npos) break;
    a = b + 1;
  }
  return r;
}

static void usage() {
  std::printf(
      "usage: bench_attention [options]\n"
      "  --json PATH            write results as JSON (rewritten after every shape)\n"
      "  --quick                reduced grid\n"
      "  --batch LIST           filter, e.g. 1,8\n"
      "  --ctx LIST             filter, e.g. 512,2K,128K\n"
      "  --heads LIST           filter, e.g. 32/32,32/8\n"
      "  --dim LIST             filter, e.g. 128\n"
      "  --shape B,H,Hkv,D,L    run this shape instead of the grid (repeatable; filters still apply)\n"
      "  --rot-cap N            most layers to rotate through (default 2048)\n"
      "  --sample-ms X          shortest eager sample / graph replay (default 0.1)\n"
      "  --budget-ms X          measured time per shape and mode (default 250)\n"
      "  --warmup-ms X          calls before the eager samples, in ms (default 50)\n"
      "  --graph-below-us X     also time as a CUDA graph when eager per-call < X (default 100)\n"
      "  --no-graph             no CUDA graph timing\n"
      "  --no-check             skip the output check\n"
      "  --device N             CUDA device (default 0)\n"
      "  --format F             K/V format: F16 (default), Q8, Q4, Q8Q4 (K Q8, V Q4), Q4Q3,\n"
      "                         Q4Q2 (K Q4, V Q3 or Q2)\n"
      "  --kv-rotation R        quantized K/V rotated: auto (the library's default) or none\n"
      "  --kv-protect S,W       quantized K/V: S sinks and a window of W kept FP16 (4,128)\n"
      "  --tiers F:S,...        a tiered cache: tiers of formats F (Q8Q8, Q8Q4, Q4Q3, Q4Q2, ...)\n"
      "                         holding shares S of the rows that leave the window\n"
      "  --io T                 q and out as f32 (default), f16 or bf16 (m40llm_kvcache_attn_batch_ex;\n"
      "                         16-bit runs skip the output check, which reads FP32)\n"
      "  --weights              time m40llm_kvcache_attn_weights_ex (the attention weights too,\n"
      "                         one buffer of B x H x L floats for every layer)\n"
      "  --importance           time m40llm_kvcache_attn_importance_ex (decay 0.9, one buffer\n"
      "                         of B x Hkv x L floats for every layer)\n"
      "  --observe              time m40llm_kvcache_attn_observe_ex: with --tiers, a cache\n"
      "                         placed by importance (M40LLM_PLACE_IMPORTANCE)\n"
      "  --list                 print the selected shapes and exit (no GPU needed)\n");
}

static Options parse_args(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto next = [&]() -> const char * {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json") o.json_path = next();
    else if (a == "--quick") o.quick = true;
    else if (a == "--list") o.list = true;
    else if (a == "--no-graph") o.graph = false;
    else if (a == "--no-check") o.check = false;
    else if (a == "--weights") o.weights = true;
    else if (a == "--importance") o.importance = true;
    else if (a == "--observe") o.observe = true;
    else if (a == "--batch") for (auto &t : split(next(), ',')) o.batches.push_back(parse_int_k(t.c_str()));
    else if (a == "--ctx") for (auto &t : split(next(), ',')) o.ctxs.push_back(parse_int_k(t.c_str()));
    else if (a == "--dim") for (auto &t : split(next(), ',')) o.dims.push_back(parse_int_k(t.c_str()));
    else if (a == "--heads") {
      for (auto &t : split(next(), ',')) {
        auto p = split(t, '/');
        if (p.size() != 2) {
          std::fprintf(stderr, "bench: --heads wants H/Hkv, got '%s'\n", t.c_str());
          std::exit(2);
        }
        o.heads.push_back({parse_int_k(p[0].c_str()), parse_int_k(p[1].c_str())});
      }
    } else if (a == "--shape") {
      auto p = split(next(), ',');
      if (p.size() != 5) {
        std::fprintf(stderr, "bench: --shape wants B,H,Hkv,D,L\n");
        std::exit(2);
      }
      o.explicit_shapes.push_back({parse_int_k(p[0].c_str()), parse_int_k(p[1].c_str()),
                                   parse_int_k(p[2].c_str()), parse_int_k(p[3].c_str()),
                                   parse_int_k(p[4].c_str())});
    } else if (a == "--rot-cap") o.rot_cap = std::max(1, parse_int_k(next()));
    else if (a == "--sample-ms") o.sample_ms = std::atof(next());
    else if (a == "--budget-ms") o.budget_ms = std::atof(next());
    else if (a == "--warmup-ms") o.warmup_ms = std::atof(next());
    else if (a == "--graph-below-us") o.graph_below_us = std::atof(next());
    else if (a == "--device") o.device = parse_int_k(next());
    else if (a == "--format") {
      o.format_name = next();
      if (!format_pair(o.format_name, &o.k_format, &o.v_format)) {
        std::fprintf(stderr, "bench: --format takes F16, Q8, Q4, Q8Q4, Q4Q3 or Q4Q2\n");
        std::exit(2);
      }
    }
    else if (a == "--tiers") {  // e.g. Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25
      o.format_name = std::string("tiers ") + argv[i + 1];
      for (auto &t : split(next(), ',')) {
        const size_t colon = t.find(':');
        int k = 0, v = 0;
        if (colon == std::string::npos || !format_pair(t.substr(0, colon), &k, &v) ||
            k == M40LLM_KV_F16) {
          std::fprintf(stderr, "bench: --tiers takes FORMAT:SHARE,... (e.g. Q8Q8:0.5,Q4Q2:0.5)\n");
          std::exit(2);
        }
        o.tier_formats.push_back({k, v});
        o.tier_shares.push_back(std::atof(t.substr(colon + 1).c_str()));
      }
    }
    else if (a == "--kv-rotation") {
      const std::string r = next();
      if (r == "auto") o.kv_rotation = M40LLM_ROTATE_AUTO;
      else if (r == "none") o.kv_rotation = M40LLM_ROTATE_NONE;
      else {
        std::fprintf(stderr, "bench: --kv-rotation takes auto or none\n");
        std::exit(2);
      }
    }
    else if (a == "--kv-protect") {
      if (std::sscanf(next(), "%d,%d", &o.kv_sinks, &o.kv_window) != 2 || o.kv_sinks < 0 ||
          o.kv_window < 0) {
        std::fprintf(stderr, "bench: --kv-protect takes SINKS,WINDOW (e.g. 4,128 or 0,0)\n");
        std::exit(2);
      }
    }
    else if (a == "--io") {
      o.io_name = next();
      if (o.io_name == "f32") o.io = M40LLM_DTYPE_F32;
      else if (o.io_name == "f16") o.io = M40LLM_DTYPE_F16;
      else if (o.io_name == "bf16") o.io = M40LLM_DTYPE_BF16;
      else {
        std::fprintf(stderr, "bench: --io takes f32, f16 or bf16\n");
        std::exit(2);
      }
      if (o.io != M40LLM_DTYPE_F32) o.check = false;
    }
    else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "bench: unknown argument '%s'\n", a.c_str());
      usage();
      std::exit(2);
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Ceilings: copy and read bandwidth

struct Ceilings {
  double copy_gbps = 0, read_gbps = 0;
  std::vector<double> copy_samples, read_samples;
  size_t buffer_bytes = 0;
};

static Ceilings measure_ceilings(cudaStream_t st) {
  Ceilings c;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  size_t bytes = (size_t)4 << 30;
  while (bytes > ((size_t)64 << 20) && 2 * bytes + ((size_t)512 << 20) > free_b) bytes /= 2;
  c.buffer_bytes = bytes;
  void *src = nullptr, *dst = nullptr;
  unsigned *sink = nullptr;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  fill_f16(st, (uint16_t *)src, bytes / 2, 12345);
  CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, st));

  const int warm = 10, reps = 10;  // warm-up also lets the clocks ramp
  {  // copy
    for (int i = 0; i < warm; i++) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
    EventRing ev(reps + 1);
    CUDA_CHECK(cudaEventRecord(ev.ev[0], st));
    for (int i = 0; i < reps; i++) {
      CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
      CUDA_CHECK(cudaEventRecord(ev.ev[i + 1], st));
    }
    for (double ms : ev.elapsed_ms()) c.copy_samples.push_back(2.0 * bytes / (ms * 1e6));
    c.copy_gbps = median(c.copy_samples);
  }
  {  // read: try a few launch shapes, keep the best median
    const int cfgs[][2] = {{256, 8}, {512, 4}, {128, 16}, {256, 16}};
    for (auto &cfg : cfgs) {
      int threads = cfg[0], blocks = g_sms * cfg[1];
      size_t n16 = bytes / 16;
      for (int i = 0; i < warm; i++)
        read_sweep_kernel<<<blocks, threads, 0, st>>>((const uint4 *)src, n16, sink);
      CUDA_CHECK(cudaGetLastError());
      EventRing ev(reps + 1);
      CUDA_CHECK(cudaEventRecord(ev.ev[0], st));
      for (int i = 0; i < reps; i++) {
        read_sweep_kernel<<<blocks, threads, 0, st>>>((const uint4 *)src, n16, sink);
        CUDA_CHECK(cudaEventRecord(ev.ev[i + 1], st));
      }
      CUDA_CHECK(cudaGetLastError());
      std::vector<double> s;
      for (double ms : ev.elapsed_ms()) s.push_back((double)bytes / (ms * 1e6));
      if (median(s) > c.read_gbps) {
        c.read_gbps = median(s);
        c.read_samples = s;
      }
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(st));
  CUDA_CHECK(cudaFree(src));
  CUDA_CHECK(cudaFree(dst));
  CUDA_CHECK(cudaFree(sink));
  return c;
}

// ---------------------------------------------------------------------------------------------
// Launch floor: what a call of one or two kernels costs in a CUDA graph before it moves a byte

// Nothing but what the library's attention kernels do around their work on sm_90: wait for the
// grid before it, then let the next one launch.
__global__ void floor_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

struct LaunchFloor {
  double one_us = NAN, two_us = NAN;
  bool dependent = false;  // launched as programmatic dependents (as the library does on sm_90+)
};

// Per-call times (us) of `reps` replays of a graph of `calls` calls, after `warm` replays.
static std::vector<double> graph_per_call_us(cudaGraphExec_t exec, cudaStream_t st, int warm,
                                             int reps, int calls) {
  for (int i = 0; i < warm; i++) CUDA_CHECK(cudaGraphLaunch(exec, st));
  EventRing ring(reps + 1);
  CUDA_CHECK(cudaEventRecord(ring.ev[0], st));
  for (int i = 0; i < reps; i++) {
    CUDA_CHECK(cudaGraphLaunch(exec, st));
    CUDA_CHECK(cudaEventRecord(ring.ev[i + 1], st));
  }
  std::vector<double> per_call;
  for (double ms : ring.elapsed_ms()) per_call.push_back(ms * 1e3 / calls);
  return per_call;
}

// Median per-call time over replays of a graph of G calls of `kernels` floor kernels each.
static double graph_floor_us(cudaStream_t st, int kernels, bool dependent) {
  const int G = 512, reps = 21;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)g_sms);
  cfg.blockDim = dim3(128);
  cfg.stream = st;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent ? 1 : 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < G * kernels; i++) CUDA_CHECK(cudaLaunchKernelEx(&cfg, floor_kernel));
  CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  CUDA_CHECK(cudaGraphInstantiateWithFlags(&exec, graph, 0));
  const std::vector<double> per_call = graph_per_call_us(exec, st, 3, reps, G);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return median(per_call);
}

static LaunchFloor measure_launch_floor(cudaStream_t st) {
  LaunchFloor f;
  cudaFuncAttributes attr;
  CUDA_CHECK(cudaFuncGetAttributes(&attr, floor_kernel));
  f.dependent = attr.ptxVersion >= 90;  // the image has the wait, as the library requires
  f.one_us = graph_floor_us(st, 1, f.dependent);
  f.two_us = graph_floor_us(st, 2, f.dependent);
  return f;
}

// ---------------------------------------------------------------------------------------------
// One shape

struct Result {
  Shape s{};
  std::string status = "ok";  // ok | skipped | error
  std::string note;
  int rotation = 0;
  double kv_bytes = 0, qo_bytes = 0, bytes = 0, rotation_bytes = 0;
  double fill_ms = 0;
  double eager_us = NAN, eager_us_min = NAN;
  int eager_calls_per_sample = 0, eager_samples = 0;
  double graph_us = NAN, graph_us_min = NAN;
  int graph_calls = 0, graph_replays = 0;
  std::string graph_error;
  double time_us = NAN;
  std::string time_source;
  double gbps = NAN, share_copy = NAN, share_read = NAN;
  std::string check = "skipped";  // pass | fail | skipped
  double check_max_abs_err = NAN;
  bool check_ref = false;
  std::string check_msg;
};

struct Bench {
  Options opt;
  m40llm_context *ctx = nullptr;
  cudaStream_t st = nullptr;
  cudaDeviceProp prop{};
  Ceilings ceil0, ceil1;
  double copy_gbps = 0, read_gbps = 0;
  LaunchFloor floor;
};

static void cpu_reference_check(Result &r, m40llm_kvcache *cache, m40llm_context *ctx,
                                const float *d_q, const float *d_out, int layer, double &max_err,
                                bool &did_ref, std::string &msg) {
  const Shape &s = r.s;
  size_t row = (size_t)s.n_heads * s.head_dim;
  size_t n = (size_t)s.batch * row;
  std::vector<float> out(n), q(n);
  max_err = INFINITY;
  did_ref = false;
  int rc = m40llm_memcpy_to_host(ctx, out.data(), d_out, n * sizeof(float));
  if (rc == M40LLM_OK) rc = m40llm_memcpy_to_host(ctx, q.data(), d_q, n * sizeof(float));
  if (rc != M40LLM_OK) {
    msg = "copying out: " + m40_err(rc);
    return;
  }
  size_t bad = 0;
  for (float x : out)
    if (!std::isfinite(x) || std::fabs(x) > 1.0f + 1e-4f) bad++;
  bool all_zero = std::all_of(out.begin(), out.end(), [](float x) { return x == 0.0f; });
  max_err = 0;
  if (bad) {
    msg = std::to_string(bad) + " outputs non-finite or |x|>1";
    return;
  }
  if (all_zero) {
    msg = "all outputs zero";
    return;
  }
  size_t kvrow = (size_t)s.n_kv_heads * s.head_dim;
  size_t seq_elems = (size_t)s.ctx * kvrow;
  if (2 * seq_elems * sizeof(uint16_t) > ((size_t)1 << 30)) {
    msg = "bounds only (sequence too large for the host reference)";
    return;
  }
  uint16_t *dk = nullptr, *dv = nullptr;
  if (m40llm_malloc((void **)&dk, ctx, seq_elems * 2) != M40LLM_OK ||
      m40llm_malloc((void **)&dv, ctx, seq_elems * 2) != M40LLM_OK) {
    m40llm_free(ctx, dk);
    msg = "bounds only (no memory for the host reference)";
    return;
  }
  std::vector<uint16_t> hk(seq_elems), hv(seq_elems);
  std::vector<int> seqs = {0};
  if (s.batch > 1) seqs.push_back(s.batch - 1);
  std::vector<int> heads = {0, s.n_heads / 2, s.n_heads - 1};
  const int group = s.n_heads / s.n_kv_heads;
  const double scale = 1.0 / std::sqrt((double)s.head_dim);
  const float *h2f = half_table().data();
  std::vector<double> logit(s.ctx);
  for (int seq : seqs) {
    rc = m40llm_kvcache_read_f16(dk, dv, cache, layer, seq, 0, s.ctx);
    if (rc == M40LLM_OK) rc = m40llm_memcpy_to_host(ctx, hk.data(), dk, seq_elems * 2);
    if (rc == M40LLM_OK) rc = m40llm_memcpy_to_host(ctx, hv.data(), dv, seq_elems * 2);
    if (rc != M40LLM_OK) {
      msg = "read_f16 for the reference: " + m40_err(rc);
      m40llm_free(ctx, dk);
      m40llm_free(ctx, dv);
      max_err = INFINITY;
      return;
    }
    for (int h : heads) {
      int g = h / group;
      const float *qh = &q[(size_t)seq * row + (size_t)h * s.head_dim];
      double mx = -INFINITY;
      for (int p = 0; p < s.ctx; p++) {
        const uint16_t *kp = &hk[(size_t)p * kvrow + (size_t)g * s.head_dim];
        double acc = 0;
        for (int d = 0; d < s.head_dim; d++) acc += (double)qh[d] * h2f[kp[d]];
        logit[p] = acc * scale;
        mx = std::max(mx, logit[p]);
      }
      double den = 0;
      for (int p = 0; p < s.ctx; p++) den += (logit[p] = std::exp(logit[p] - mx));
      for (int d = 0; d < s.head_dim; d++) {
        double acc = 0;
        for (int p = 0; p < s.ctx; p++)
          acc += logit[p] * h2f[hv[(size_t)p * kvrow + (size_t)g * s.head_dim + d]];
        double ref = acc / den;
        double got = out[(size_t)seq * row + (size_t)h * s.head_dim + d];
        max_err = std::max(max_err, std::fabs(ref - got));
      }
    }
  }
  did_ref = true;
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
}

static Result run_shape(Bench &B, const Shape &s) {
  Result r;
  r.s = s;
  const Options &o = B.opt;
  cudaStream_t st = B.st;
  // K/V bytes of one layer in the cache's formats (every position of every sequence is read).
  size_t kv_layer = 0;
  {
    m40llm_kvcache_options one = M40LLM_KVCACHE_OPTIONS_INIT;
    one.n_layers = 1, one.n_heads = s.n_heads, one.n_kv_heads = s.n_kv_heads;
    one.head_dim = s.head_dim, one.max_seqs = s.batch, one.max_seq_len = s.ctx;
    one.format = o.k_format, one.v_format = o.v_format;
    if (!o.tier_formats.empty()) one.n_sinks = o.kv_sinks, one.window = o.kv_window;
    apply_tiers(one, o, s.ctx);
    if (m40llm_kvcache_bytes_needed(&kv_layer, &one) != M40LLM_OK)
      kv_layer = 2ull * 2ull * s.batch * s.n_kv_heads * (size_t)s.ctx * s.head_dim;
  }
  const size_t q_layer = (size_t)s.batch * s.n_heads * s.head_dim;  // floats
  r.kv_bytes = (double)kv_layer;
  r.qo_bytes = 2.0 * q_layer * (o.io == M40LLM_DTYPE_F32 ? 4 : 2);
  r.bytes = r.kv_bytes + r.qo_bytes;

  // Rotation count and memory.
  const size_t l2 = (size_t)std::max(B.prop.l2CacheSize, 1);
  const size_t target = std::max<size_t>(4 * l2, (size_t)256 << 20);
  int R = kv_layer >= target ? 1 : (int)std::min<size_t>((target + kv_layer - 1) / kv_layer, (size_t)o.rot_cap);
  R = std::max(R, 1);

  const size_t row_elems = (size_t)s.n_kv_heads * s.head_dim;
  const int chunk = (int)std::max<size_t>(1, std::min<size_t>((size_t)s.ctx, ((size_t)16 << 20) / (row_elems * 2)));
  const size_t chunk_bytes = 2 * (size_t)chunk * row_elems * 2;

  m40llm_kvcache_options ko = M40LLM_KVCACHE_OPTIONS_INIT;
  ko.n_heads = s.n_heads;
  ko.n_kv_heads = s.n_kv_heads;
  ko.head_dim = s.head_dim;
  ko.max_seqs = s.batch;
  ko.max_seq_len = s.ctx;
  ko.format = o.k_format;
  ko.rotation = o.kv_rotation;
  ko.n_sinks = o.kv_sinks;
  ko.window = o.kv_window;
  ko.v_format = o.v_format;
  apply_tiers(ko, o, s.ctx);
  if (o.observe) ko.placement = M40LLM_PLACE_IMPORTANCE;

  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t margin = ((size_t)512 << 20) + total_b / 50;
  auto need_for = [&](int layers, size_t *cache_bytes) -> int {
    ko.n_layers = layers;
    int rc = m40llm_kvcache_bytes_needed(cache_bytes, &ko);
    return rc;
  };
  size_t cache_bytes = 0;
  int rc = need_for(R, &cache_bytes);
  if (rc != M40LLM_OK) {
    r.status = "error";
    r.note = "kvcache_bytes_needed: " + m40_err(rc);
    return r;
  }
  while (R > 1 && cache_bytes + 2 * R * q_layer * 4 + chunk_bytes + margin > free_b) {
    R = std::max(1, R / 2);
    need_for(R, &cache_bytes);
  }
  if (cache_bytes + 2 * R * q_layer * 4 + chunk_bytes + margin > free_b) {
    r.status = "skipped";
    char b[200];
    std::snprintf(b, sizeof b, "needs %.2f GB, %.2f GB free", (cache_bytes + 2 * q_layer * 4 + chunk_bytes + margin) / 1e9,
                  free_b / 1e9);
    r.note = b;
    return r;
  }
  ko.n_layers = R;
  r.rotation = R;
  if (R > 1 && (size_t)R * kv_layer < target && R < o.rot_cap) r.note = "rotation reduced to fit memory";
  r.rotation_bytes = (double)kv_layer * R;

  // Allocate and fill.
  m40llm_kvcache *cache = nullptr;
  rc = m40llm_kvcache_create(&cache, B.ctx, &ko);
  if (rc != M40LLM_OK) {
    r.status = (rc == M40LLM_ERR_OUT_OF_MEMORY) ? "skipped" : "error";
    r.note = "kvcache_create: " + m40_err(rc);
    return r;
  }
  float *d_q = nullptr, *d_out = nullptr, *d_w = nullptr;
  uint16_t *d_k = nullptr, *d_v = nullptr;
  const size_t w_floats = (size_t)s.batch * s.n_heads * (size_t)s.ctx;
  const size_t imp_floats = (size_t)s.batch * s.n_kv_heads * (size_t)s.ctx;
  if (o.weights) M40_FATAL(m40llm_malloc((void **)&d_w, B.ctx, w_floats * 4));
  if (o.importance) {
    M40_FATAL(m40llm_malloc((void **)&d_w, B.ctx, imp_floats * 4));
    M40_FATAL(m40llm_memset(B.ctx, d_w, 0, imp_floats * 4));
  }
  M40_FATAL(m40llm_malloc((void **)&d_q, B.ctx, (size_t)R * q_layer * 4));
  M40_FATAL(m40llm_malloc((void **)&d_out, B.ctx, (size_t)R * q_layer * 4));
  M40_FATAL(m40llm_malloc((void **)&d_k, B.ctx, chunk_bytes / 2));
  M40_FATAL(m40llm_malloc((void **)&d_v, B.ctx, chunk_bytes / 2));
  // 16-bit q: FP16 bit patterns of small values (finite as BF16 too); the buffers hold FP32's size.
  if (o.io == M40LLM_DTYPE_F32) fill_f32(st, d_q, (size_t)R * q_layer, 777 + (uint64_t)s.ctx);
  else fill_f16(st, (uint16_t *)d_q, (size_t)R * q_layer, 777 + (uint64_t)s.ctx);
  const size_t io_bytes = o.io == M40LLM_DTYPE_F32 ? 4 : 2;
  CUDA_CHECK(cudaMemsetAsync(d_out, 0, (size_t)R * q_layer * 4, st));

  cudaEvent_t f0, f1;
  CUDA_CHECK(cudaEventCreate(&f0));
  CUDA_CHECK(cudaEventCreate(&f1));
  CUDA_CHECK(cudaEventRecord(f0, st));
  uint64_t seed = 1000003ull * (uint64_t)s.ctx + 7919ull * s.batch + 104729ull * s.n_heads + s.head_dim;
  for (int layer = 0; layer < R && r.status == "ok"; layer++)
    for (int seq = 0; seq < s.batch && r.status == "ok"; seq++)
      for (int pos = 0; pos < s.ctx; pos += chunk) {
        int n = std::min(chunk, s.ctx - pos);
        fill_f16(st, d_k, (size_t)n * row_elems, seed++);
        fill_f16(st, d_v, (size_t)n * row_elems, seed++);
        rc = m40llm_kvcache_append_f16(cache, layer, seq, d_k, d_v, n);
        if (rc != M40LLM_OK) {
          r.status = "error";
          r.note = "append_f16: " + m40_err(rc);
          break;
        }
      }
  CUDA_CHECK(cudaEventRecord(f1, st));
  rc = m40llm_context_synchronize(B.ctx);
  if (rc != M40LLM_OK && r.status == "ok") {
    r.status = "error";
    r.note = "fill: " + m40_err(rc);
  }
  float fms = 0;
  if (r.status == "ok") {
    CUDA_CHECK(cudaEventElapsedTime(&fms, f0, f1));
    r.fill_ms = fms;
    int len = -1;
    rc = m40llm_kvcache_seq_len(&len, cache, R - 1, s.batch - 1);
    if (rc != M40LLM_OK || len != s.ctx) {
      r.status = "error";
      r.note = "seq_len after fill: " + std::to_string(len) + " (" + m40_err(rc) + ")";
    }
  }
  CUDA_CHECK(cudaEventDestroy(f0));
  CUDA_CHECK(cudaEventDestroy(f1));

  std::vector<int32_t> seq_ids(s.batch);
  for (int i = 0; i < s.batch; i++) seq_ids[i] = i;
  long long counter = 0;
  int call_rc = M40LLM_OK;
  auto call = [&](int layer) {
    void *out_l = (char *)d_out + (size_t)layer * q_layer * io_bytes;
    const void *q_l = (const char *)d_q + (size_t)layer * q_layer * io_bytes;
    int rc2 = o.weights ? m40llm_kvcache_attn_weights_ex(out_l, d_w, (size_t)s.ctx, cache, layer,
                                                         seq_ids.data(), s.batch, q_l, o.io, 0.0f)
              : o.importance
                  ? m40llm_kvcache_attn_importance_ex(out_l, d_w, (size_t)s.ctx, 0.9f, cache,
                                                      layer, seq_ids.data(), s.batch, q_l, o.io,
                                                      0.0f)
              : o.observe ? m40llm_kvcache_attn_observe_ex(out_l, cache, layer, seq_ids.data(),
                                                           s.batch, q_l, o.io, 0.0f)
                  : m40llm_kvcache_attn_batch_ex(out_l, cache, layer, seq_ids.data(), s.batch,
                                                 q_l, o.io, 0.0f);
    if (rc2 != M40LLM_OK && call_rc == M40LLM_OK) call_rc = rc2;
  };
  auto next_call = [&]() { call((int)(counter++ % R)); };

  double est_ms = 0;
  if (r.status == "ok") {
    // Warm-up: touch every layer once (at most 64 calls), then estimate one call.
    for (int i = 0; i < std::min(R, 64); i++) next_call();
    rc = m40llm_context_synchronize(B.ctx);
    if (call_rc != M40LLM_OK || rc != M40LLM_OK) {
      r.status = "error";
      r.note = "attention: " + m40_err(call_rc != M40LLM_OK ? call_rc : rc);
    }
  }
  if (r.status == "ok") {
    EventRing ev(2);
    const int n_est = 4;
    CUDA_CHECK(cudaEventRecord(ev.ev[0], st));
    for (int i = 0; i < n_est; i++) next_call();
    CUDA_CHECK(cudaEventRecord(ev.ev[1], st));
    est_ms = std::max(ev.elapsed_ms()[0] / n_est, 1e-4);
    // Busy the GPU for --warmup-ms first: right after a large shape's fill and free, the one
    // warm-up call of a rotation-1 shape left its eager median 15% slow (B64 32/32 D128 L512
    // after B32 L32K on an H100: 212 vs 183 us, same binary).
    const int n_warm = (int)std::min(100000.0, std::ceil(o.warmup_ms / est_ms));
    for (int i = 0; i < n_warm; i++) next_call();

    // Eager: samples of K back-to-back calls.
    int K = (int)std::min(4096.0, std::max(1.0, std::ceil(o.sample_ms / est_ms)));
    int samples = (int)std::min(301.0, std::max(9.0, o.budget_ms / (K * est_ms)));
    EventRing ring(samples + 1);
    CUDA_CHECK(cudaEventRecord(ring.ev[0], st));
    for (int i = 0; i < samples; i++) {
      for (int k = 0; k < K; k++) next_call();
      CUDA_CHECK(cudaEventRecord(ring.ev[i + 1], st));
    }
    std::vector<double> per_call;
    for (double ms : ring.elapsed_ms()) per_call.push_back(ms * 1e3 / K);
    rc = m40llm_context_synchronize(B.ctx);
    if (call_rc != M40LLM_OK || rc != M40LLM_OK) {
      r.status = "error";
      r.note = "attention: " + m40_err(call_rc != M40LLM_OK ? call_rc : rc);
    } else {
      r.eager_us = median(per_call);
      r.eager_us_min = vmin(per_call);
      r.eager_calls_per_sample = K;
      r.eager_samples = samples;
    }
  }

  const bool small = s.batch == 1 && s.ctx <= 2048;
  if (r.status == "ok" && o.graph && (small || r.eager_us < o.graph_below_us)) {
    double t_ms = r.eager_us * 1e-3;
    int G = R * (int)std::max(1.0, std::ceil(o.sample_ms / (R * t_ms)));
    G = std::min(G, std::max(R, 4096));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    call_rc = M40LLM_OK;
    cudaError_t e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      for (int i = 0; i < G; i++) call(i % R);
      e = cudaStreamEndCapture(st, &graph);
    }
    if (e != cudaSuccess || call_rc != M40LLM_OK) {
      r.graph_error = std::string("capture: ") + cudaGetErrorString(e) +
                      (call_rc != M40LLM_OK ? "; attention during capture: " + m40_err(call_rc) : "");
    } else {
      e = cudaGraphInstantiateWithFlags(&exec, graph, 0);
      if (e != cudaSuccess) r.graph_error = std::string("instantiate: ") + cudaGetErrorString(e);
    }
    (void)cudaGetLastError();
    if (exec) {
      int reps = (int)std::min(301.0, std::max(9.0, o.budget_ms / (G * t_ms)));
      const std::vector<double> per_call = graph_per_call_us(exec, st, 2, reps, G);
      r.graph_us = median(per_call);
      r.graph_us_min = vmin(per_call);
      r.graph_calls = G;
      r.graph_replays = reps;
      rc = m40llm_context_synchronize(B.ctx);
      if (rc != M40LLM_OK) {
        r.status = "error";
        r.note = "graph replay: " + m40_err(rc);
      }
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }

  if (r.status == "ok") {
    if (std::isfinite(r.graph_us)) {
      r.time_us = r.graph_us;
      r.time_source = "graph";
    } else {
      r.time_us = r.eager_us;
      r.time_source = "eager";
    }
    r.gbps = r.bytes / (r.time_us * 1e3);
    r.share_copy = r.gbps / B.copy_gbps;
    r.share_read = r.gbps / B.read_gbps;
  }

  if (r.status == "ok" && o.check) {
    call_rc = M40LLM_OK;
    CUDA_CHECK(cudaMemsetAsync(d_out, 0xff, q_layer * 4, st));  // NaN pattern: catches unwritten rows
    call(0);
    rc = m40llm_context_synchronize(B.ctx);
    if (call_rc != M40LLM_OK || rc != M40LLM_OK) {
      r.status = "error";
      r.note = "check call: " + m40_err(call_rc != M40LLM_OK ? call_rc : rc);
    } else {
      double err = 0;
      bool did_ref = false;
      std::string msg;
      cpu_reference_check(r, cache, B.ctx, d_q, d_out, 0, err, did_ref, msg);
      r.check_ref = did_ref;
      r.check_max_abs_err = did_ref ? err : NAN;
      r.check_msg = msg;
      bool ok = msg.empty() || msg.rfind("bounds only", 0) == 0;
      if (did_ref && !(err <= 1e-3)) ok = false;
      r.check = ok ? "pass" : "fail";
    }
  }

  m40llm_kvcache_destroy(cache);
  m40llm_free(B.ctx, d_q);
  m40llm_free(B.ctx, d_out);
  if (d_w) m40llm_free(B.ctx, d_w);
  m40llm_free(B.ctx, d_k);
  m40llm_free(B.ctx, d_v);
  rc = m40llm_context_synchronize(B.ctx);
  if (rc != M40LLM_OK) {
    std::fprintf(stderr, "bench: context unusable after shape: %s\n", m40_err(rc).c_str());
    if (r.status == "ok") {
      r.status = "error";
      r.note = "after shape: " + m40_err(rc);
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Output

static const char *kMethod =
    "m40llm_kvcache_attn_batch_ex, Q/out of the run's io (--io), K/V in the run's format (--format), every "
    "sequence at full ctx; kv_bytes are that format's bytes (codes and scales). "
    "Cache n_layers = rotation R with R*KV >= max(4*L2, 256MiB) (capped); calls cycle layers. "
    "Warm-up: one call on each of the first 64 layers, then --warmup-ms (default 50) of calls. "
    "eager_us: median over samples of K back-to-back calls between cudaEvents, divided by K. "
    "graph_us: median over replays of a CUDA graph of G>=R calls, divided by G. "
    "time_us = graph_us when measured else eager_us. bytes = KV + Q + out. "
    "copy_gbps: cudaMemcpyAsync D2D, bytes read+written, median of 10. "
    "read_gbps: read-only 16-byte grid-stride sweep, best launch shape, median of 10. "
    "Ceilings = max of the measurement before and after the grid. "
    "launch_floor_us: median per-call time over replays of a CUDA graph of 512 calls of one or "
    "two empty kernels (one block per SM, 128 threads; programmatic dependents on sm_90+).";

static std::string shape_json(const Result &r) {
  std::string j = "{";
  auto kv = [&](const char *k, const std::string &v, bool comma = true) {
    j += std::string("\"") + k + "\": " + v + (comma ? ", " : "");
  };
  kv("batch", std::to_string(r.s.batch));
  kv("n_heads", std::to_string(r.s.n_heads));
  kv("n_kv_heads", std::to_string(r.s.n_kv_heads));
  kv("head_dim", std::to_string(r.s.head_dim));
  kv("ctx", std::to_string(r.s.ctx));
  kv("status", json_str(r.status));
  kv("note", json_str(r.note));
  kv("rotation", std::to_string(r.rotation));
  kv("kv_bytes", json_num(r.kv_bytes));
  kv("qo_bytes", json_num(r.qo_bytes));
  kv("bytes", json_num(r.bytes));
  kv("rotation_bytes", json_num(r.rotation_bytes));
  kv("fill_ms", json_num(r.fill_ms));
  kv("eager_us", json_num(r.eager_us));
  kv("eager_us_min", json_num(r.eager_us_min));
  kv("eager_calls_per_sample", std::to_string(r.eager_calls_per_sample));
  kv("eager_samples", std::to_string(r.eager_samples));
  kv("graph_us", json_num(r.graph_us));
  kv("graph_us_min", json_num(r.graph_us_min));
  kv("graph_step32_us", json_num(r.graph_us * 32));
  kv("graph_calls", std::to_string(r.graph_calls));
  kv("graph_replays", std::to_string(r.graph_replays));
  kv("graph_error", json_str(r.graph_error));
  kv("time_us", json_num(r.time_us));
  kv("time_source", json_str(r.time_source));
  kv("gbps", json_num(r.gbps));
  kv("share_copy", json_num(r.share_copy));
  kv("share_read", json_num(r.share_read));
  kv("check", json_str(r.check));
  kv("check_ref", r.check_ref ? "true" : "false");
  kv("check_max_abs_err", json_num(r.check_max_abs_err));
  kv("check_msg", json_str(r.check_msg), false);
  return j + "}";
}

static void write_json(const Bench &B, const std::vector<Result> &rs, bool complete) {
  if (B.opt.json_path.empty()) return;
  std::string tmp = B.opt.json_path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "bench: cannot write %s: %s\n", tmp.c_str(), std::strerror(errno));
    return;
  }
  std::fprintf(f, "{\n  \"tool\": \"bench_attention\",\n  \"library_version\": %s,\n",
               json_str(m40llm_version_string()).c_str());
  std::fprintf(f, "  \"format\": %s,\n", json_str(B.opt.format_name).c_str());
  std::fprintf(f, "  \"io\": %s,\n", json_str(B.opt.io_name).c_str());
  std::fprintf(f, "  \"weights\": %s,\n", B.opt.weights ? "true" : "false");
  std::fprintf(f, "  \"importance\": %s,\n", B.opt.importance ? "true" : "false");
  std::fprintf(f, "  \"observe\": %s,\n", B.opt.observe ? "true" : "false");
  std::fprintf(f, "  \"kv_rotation\": %s,\n  \"kv_protect\": [%d, %d],\n",
               B.opt.kv_rotation == M40LLM_ROTATE_NONE ? "\"none\"" : "\"auto\"",
               B.opt.kv_sinks, B.opt.kv_window);
  std::fprintf(f,
               "  \"device\": {\"name\": %s, \"cc\": \"%d.%d\", \"sms\": %d, \"l2_bytes\": %d, "
               "\"total_memory\": %zu},\n",
               json_str(B.prop.name).c_str(), B.prop.major, B.prop.minor, B.prop.multiProcessorCount,
               B.prop.l2CacheSize, (size_t)B.prop.totalGlobalMem);
  std::fprintf(f, "  \"copy_gbps\": %s,\n  \"read_gbps\": %s,\n", json_num(B.copy_gbps).c_str(),
               json_num(B.read_gbps).c_str());
  auto arr = [](const std::vector<double> &v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); i++) s += (i ? ", " : "") + json_num(v[i]);
    return s + "]";
  };
  std::fprintf(f,
               "  \"ceilings\": {\"buffer_bytes\": %zu, \"copy_before\": %s, \"read_before\": %s, "
               "\"copy_after\": %s, \"read_after\": %s, \"copy_samples_before\": %s, "
               "\"read_samples_before\": %s},\n",
               B.ceil0.buffer_bytes, json_num(B.ceil0.copy_gbps).c_str(), json_num(B.ceil0.read_gbps).c_str(),
               json_num(B.ceil1.copy_gbps).c_str(), json_num(B.ceil1.read_gbps).c_str(),
               arr(B.ceil0.copy_samples).c_str(), arr(B.ceil0.read_samples).c_str());
  std::fprintf(f, "  \"launch_floor_us\": {\"one_kernel\": %s, \"two_kernels\": %s, \"dependent\": %s},\n",
               json_num(B.floor.one_us).c_str(), json_num(B.floor.two_us).c_str(),
               B.floor.dependent ? "true" : "false");
  std::fprintf(f, "  \"method\": %s,\n  \"complete\": %s,\n  \"shapes\": [\n", json_str(kMethod).c_str(),
               complete ? "true" : "false");
  for (size_t i = 0; i < rs.size(); i++)
    std::fprintf(f, "    %s%s\n", shape_json(rs[i]).c_str(), i + 1 < rs.size() ? "," : "");
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
  if (std::rename(tmp.c_str(), B.opt.json_path.c_str()) != 0)
    std::fprintf(stderr, "bench: cannot rename %s: %s\n", tmp.c_str(), std::strerror(errno));
}

static std::string ctx_str(int l) {
  return (l % 1024 == 0) ? std::to_string(l / 1024) + "K" : std::to_string(l);
}

static void print_header() {
  std::printf("%4s %7s %4s %5s %4s %9s %10s %10s %5s %8s %6s %6s %5s %s\n", "B", "H/Hkv", "D", "L", "R",
              "KV MB", "eager us", "graph us", "src", "GB/s", "%copy", "%read", "check", "note");
}

static void print_row(const Result &r) {
  char hk[16];
  std::snprintf(hk, sizeof hk, "%d/%d", r.s.n_heads, r.s.n_kv_heads);
  if (r.status != "ok") {
    std::printf("%4d %7s %4d %5s %4s %9.2f %10s %10s %5s %8s %6s %6s %5s %s: %s\n", r.s.batch, hk,
                r.s.head_dim, ctx_str(r.s.ctx).c_str(), "-", r.kv_bytes / 1e6, "-", "-", "-", "-", "-", "-",
                "-", r.status.c_str(), r.note.c_str());
  } else {
    std::string note = r.graph_error.empty() ? r.check_msg : ("graph: " + r.graph_error);
    char g[32] = "-";
    if (std::isfinite(r.graph_us)) std::snprintf(g, sizeof g, "%.2f", r.graph_us);
    std::printf("%4d %7s %4d %5s %4d %9.2f %10.2f %10s %5s %8.0f %5.1f%% %5.1f%% %5s %s\n", r.s.batch, hk,
                r.s.head_dim, ctx_str(r.s.ctx).c_str(), r.rotation, r.kv_bytes / 1e6, r.eager_us, g,
                r.time_source.c_str(), r.gbps, 100 * r.share_copy, 100 * r.share_read, r.check.c_str(),
                note.c_str());
  }
  std::fflush(stdout);
}

int main(int argc, char **argv) {
  Bench B;
  B.opt = parse_args(argc, argv);
  std::vector<Shape> grid = select_grid(B.opt);
  if (B.opt.list) {
    for (const Shape &s : grid)
      std::printf("%d %d %d %d %d\n", s.batch, s.n_heads, s.n_kv_heads, s.head_dim, s.ctx);
    return 0;
  }
  if (grid.empty()) {
    std::fprintf(stderr, "bench: no shape selected\n");
    return 2;
  }

  CUDA_CHECK(cudaSetDevice(B.opt.device));
  CUDA_CHECK(cudaGetDeviceProperties(&B.prop, B.opt.device));
  g_sms = B.prop.multiProcessorCount;
  CUDA_CHECK(cudaStreamCreateWithFlags(&B.st, cudaStreamNonBlocking));
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CUDA;
  co.device = B.opt.device;
  co.cuda_stream = (void *)B.st;
  M40_FATAL(m40llm_context_create(&B.ctx, &co));

  std::printf("m40llm %s bench_attention on %s (cc %d.%d, %d SMs, L2 %.1f MB, %.1f GB)\n",
              m40llm_version_string(), B.prop.name, B.prop.major, B.prop.minor, B.prop.multiProcessorCount,
              B.prop.l2CacheSize / 1e6, B.prop.totalGlobalMem / 1e9);
  B.ceil0 = measure_ceilings(B.st);
  B.copy_gbps = B.ceil0.copy_gbps;
  B.read_gbps = B.ceil0.read_gbps;
  std::printf("K/V format: %s%s, protected %d sinks + window %d (quantized only), q/out %s%s\n",
              B.opt.format_name.c_str(),
              B.opt.kv_rotation == M40LLM_ROTATE_NONE ? ", not rotated" : "", B.opt.kv_sinks,
              B.opt.kv_window, B.opt.io_name.c_str(),
              B.opt.weights      ? ", with the attention weights (m40llm_kvcache_attn_weights_ex)"
              : B.opt.importance ? ", with the importance (m40llm_kvcache_attn_importance_ex)"
              : B.opt.observe    ? ", observed (m40llm_kvcache_attn_observe_ex)"
                                 : "");
  std::printf("ceilings: copy %.0f GB/s (read+write, %zu MiB buffer), read sweep %.0f GB/s\n", B.copy_gbps,
              B.ceil0.buffer_bytes >> 20, B.read_gbps);
  B.floor = measure_launch_floor(B.st);
  std::printf("launch floor (CUDA graph, per call): one empty kernel %.2f us, two %.2f us%s\n",
              B.floor.one_us, B.floor.two_us, B.floor.dependent ? " (programmatic dependents)" : "");
  std::printf("%zu shapes\n", grid.size());
  print_header();

  std::vector<Result> results;
  int errors = 0;
  for (const Shape &s : grid) {
    Result r = run_shape(B, s);
    if (r.status == "error" || r.check == "fail") errors++;
    results.push_back(r);
    print_row(r);
    write_json(B, results, false);
  }

  B.ceil1 = measure_ceilings(B.st);
  std::printf("ceilings after: copy %.0f GB/s, read %.0f GB/s\n", B.ceil1.copy_gbps, B.ceil1.read_gbps);
  double c = std::max(B.ceil0.copy_gbps, B.ceil1.copy_gbps), rd = std::max(B.ceil0.read_gbps, B.ceil1.read_gbps);
  if (c != B.copy_gbps || rd != B.read_gbps) {  // shares against the higher of the two readings
    for (Result &r : results)
      if (r.status == "ok") {
        r.share_copy = r.gbps / c;
        r.share_read = r.gbps / rd;
      }
    B.copy_gbps = c;
    B.read_gbps = rd;
  }
  write_json(B, results, true);
  m40llm_context_destroy(B.ctx);
  CUDA_CHECK(cudaStreamDestroy(B.st));
  std::printf("done: %zu shapes, %d with errors or failed checks\n", results.size(), errors);
  return errors ? 1 : 0;
}
