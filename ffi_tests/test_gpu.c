/* The CUDA backend against the float64 reference and against the CPU backend.
 *
 * Exits 77 (skipped) when the library has no CUDA backend or no GPU is visible, unless
 * M40LLM_REQUIRE_GPU=1, which turns that into a failure.
 * M40LLM_TEST_GPU_BACKEND=cpu runs every case on the CPU backend instead (to check the test
 * itself on a machine without a GPU; the CUDA-only checks are then skipped).
 * M40LLM_TEST_SMALL=1 keeps every kind of case but drops the long contexts (4099 positions and
 * more) and most of the head_dim sweep, for compute-sanitizer runs (scripts/gpu_check.sh), where
 * kernels run 10-100x slower.
 * M40LLM_TEST_ONLY=causal,graph runs those groups of cases only (names: kGroups below), e.g. a
 * sanitizer over one kernel family; each group left out is reported as skipped, an unknown name
 * fails the run, and an empty value is no filter.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef T_HAVE_CUDART
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

#include "test_util.h"

static m40llm_context *dev; /* the context under test */
static m40llm_context *cpu; /* the CPU backend, for lockstep comparisons */
static int on_cuda;
static int small; /* M40LLM_TEST_SMALL=1 */

static int skip_or_fail(const char *why) {
  const char *req = getenv("M40LLM_REQUIRE_GPU");
  if (req && strcmp(req, "1") == 0) {
    T_CHECKF(0, "M40LLM_REQUIRE_GPU=1 but %s", why);
    return t_finish();
  }
  t_skip("the GPU tests: %s", why);
  t_finish();
  return 77;
}

/* The groups of cases, in the order they run (M40LLM_TEST_ONLY picks some). */
static const char *const kGroups[] = {"context", "errors", "sequences", "rounding", "attention",
                                      "quantized", "append", "masked", "causal", "dtype",
                                      "weights", "importance", "tiers", "policy", "graph", "decode",
                                      "fault"};
static const char *only; /* M40LLM_TEST_ONLY, or NULL: every group */

/* Whether the comma-separated list holds the name n[0 .. len). */
static int listed(const char *list, const char *n, size_t len) {
  for (const char *p = list; *p;) {
    const size_t l = strcspn(p, ",");
    if (l == len && strncmp(p, n, len) == 0) return 1;
    p += l + (p[l] == ',');
  }
  return 0;
}

/* Whether the group `name` runs; a group left out is counted as skipped. */
static int group(const char *name) {
  if (!only || listed(only, name, strlen(name))) return 1;
  t_skip("the %s cases (M40LLM_TEST_ONLY=%s)", name, only);
  return 0;
}

/* Every name in M40LLM_TEST_ONLY is a group's. */
static int only_names_known(void) {
  for (const char *p = only; *p;) {
    const size_t len = strcspn(p, ",");
    int known = 0;
    for (size_t g = 0; g < sizeof kGroups / sizeof kGroups[0]; g++)
      known |= listed(kGroups[g], p, len);
    if (!T_CHECKF(known, "M40LLM_TEST_ONLY=%s: no group %.*s", only, (int)len, p)) return 0;
    p += len + (p[len] == ',');
  }
  return 1;
}

static float *random_q(size_t n) {
  float *q = malloc(n * sizeof(float));
  if (!T_CHECK(q != NULL)) return NULL;
  t_fill_uniform(q, n, -3.0f, 3.0f);
  return q;
}

static float pick_scale(int i) { return (i & 1) ? t_rand_float(0.03f, 0.2f) : 0.0f; }

#ifdef T_HAVE_CUDART
/* seq_ids sharing memory with out: managed memory is both the caller's host id array and the
 * output the kernels write (the CPU backend's version of the case is in cases.c). */
static void test_ids_alias_out_managed(void) {
  t_kv kv;
  t_set_case("attention: seq_ids share (managed) memory with out");
  if (t_kv_create(&kv, dev, 1, 4, 2, 16, 3, 40) != M40LLM_OK) return;
  T_OK(t_kv_append_random(&kv, 0, 0, 3, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 1, 17, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 2, 40, 1.0f));
  const size_t n = 9 * 4 * 16;
  float *q = random_q(n), *dq = NULL, *out = NULL;
  if (q && T_CHECK(cudaMallocManaged((void **)&out, n * sizeof(float), cudaMemAttachGlobal) ==
                   cudaSuccess)) {
    dq = t_dev_upload(dev, q, n * sizeof(float));
    if (dq) t_check_ids_alias_out(&kv, (int32_t *)out, out, dq, q);
  }
  if (out) cudaFree(out);
  m40llm_free(dev, dq);
  free(q);
  t_kv_destroy(&kv);
}
#endif

#ifdef T_HAVE_CUDART
/* m40llm_kvcache_append_attn_f32q with its seq_ids in (managed) out: the ids as passed, the
 * same output as append_batch + attn_batch on a twin cache. */
static void test_append_attn_ids_alias_out_managed(void) {
  t_kv a, b;
  t_set_case("append_attn: seq_ids share (managed) memory with out");
  if (t_kv_create(&a, dev, 1, 8, 2, 32, 3, 64) != M40LLM_OK) return;
  if (t_kv_create(&b, dev, 1, 8, 2, 32, 3, 64) != M40LLM_OK) {
    t_kv_destroy(&a);
    return;
  }
  t_kv *const both[2] = {&a, &b};
  int st[2];
  for (int s = 0; s < 3; s++) {
    t_kv_append_same_random(both, st, 2, 0, s, 5 + 17 * s, 1.0f, 1);
    T_OK(st[0]);
    T_OK(st[1]);
  }
  const int32_t ids[3] = {2, 0, 1};
  const size_t qrow = 8 * 32, kvrow = 2 * 32, bytes = 3 * qrow * sizeof(float);
  float *q = random_q(3 * qrow), *kv = random_q(3 * kvrow);
  float *got = malloc(bytes), *want = malloc(bytes);
  float *out = NULL, *dq = NULL, *dkv = NULL, *ob = t_dev_alloc(dev, bytes);
  if (q && kv && got && want && ob &&
      T_CHECK(cudaMallocManaged((void **)&out, bytes, cudaMemAttachGlobal) == cudaSuccess)) {
    dq = t_dev_upload(dev, q, bytes);
    dkv = t_dev_upload(dev, kv, 3 * kvrow * sizeof(float));
    memcpy(out, ids, sizeof ids);
    if (dq && dkv &&
        T_OK(m40llm_kvcache_append_attn_f32q(out, a.cache, 0, (const int32_t *)out, 3, dkv, dkv,
                                             dq, 0.0f)) &&
        T_OK(m40llm_kvcache_append_batch_f32(b.cache, 0, ids, NULL, 3, dkv, dkv)) &&
        T_OK(m40llm_kvcache_attn_batch_f32q(ob, b.cache, 0, ids, 3, dq, 0.0f)) &&
        T_OK(m40llm_context_synchronize(dev)) && t_dev_download(dev, got, out, bytes) &&
        t_dev_download(dev, want, ob, bytes))
      T_CHECKF(memcmp(got, want, bytes) == 0,
               "append_attn with ids in out differs from the two calls");
  }
  if (out) cudaFree(out);
  m40llm_free(dev, dq);
  m40llm_free(dev, dkv);
  m40llm_free(dev, ob);
  free(q), free(kv), free(got), free(want);
  t_kv_destroy(&a);
  t_kv_destroy(&b);
}

/* Host pointers where the kernels need device memory are refused, naming the argument, before
 * anything is queued: the context stays usable. Pinned host memory mapped into the device's
 * address space and managed memory are accepted. */
static void test_pointer_kinds(void) {
  t_kv kv;
  t_set_case("pointer kinds: setup");
  if (t_kv_create(&kv, dev, 1, 4, 2, 16, 2, 8) != M40LLM_OK) return;
  T_OK(t_kv_append_random(&kv, 0, 0, 5, 1.0f));
  const size_t n = 4 * 16, row = 2 * 16;
  float *hq = random_q(n), *hout = malloc(n * sizeof(float));
  float *hk = calloc(row, sizeof(float)), *hv = calloc(row, sizeof(float));
  uint16_t *hk16 = malloc(row * sizeof(uint16_t));
  float *dq = hq ? t_dev_upload(dev, hq, n * sizeof(float)) : NULL;
  float *dout = t_dev_alloc(dev, n * sizeof(float));
  float *dk = t_dev_alloc(dev, row * sizeof(float)), *dv = t_dev_alloc(dev, row * sizeof(float));
  uint16_t *dk16 = t_dev_alloc(dev, row * sizeof(uint16_t));
  float *pinned = NULL;
  if (!T_CHECK(hq && hout && hk && hv && hk16) || !dq || !dout || !dk || !dv || !dk16) goto done;
  T_OK(m40llm_memset(dev, dout, 0xFF, n * sizeof(float)));
  T_OK(m40llm_memset(dev, dk, 0, row * sizeof(float)));
  T_OK(m40llm_memset(dev, dv, 0, row * sizeof(float)));
  memset(hout, 0xFF, n * sizeof(float));
  T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(dout, kv.cache, 0, 0, hq, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "q is host memory");
  T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(hout, kv.cache, 0, 0, dq, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "out is host memory");
  T_CHECK(t_all_bytes(hout, n * sizeof(float), 0xFF));
  T_FAIL_WITH(m40llm_kvcache_append_f32(kv.cache, 0, 1, hk, dv, 1), M40LLM_ERR_INVALID_ARGUMENT,
              "k is host memory");
  T_FAIL_WITH(m40llm_kvcache_append_f32(kv.cache, 0, 1, dk, hv, 1), M40LLM_ERR_INVALID_ARGUMENT,
              "v is host memory");
  T_FAIL_WITH(m40llm_kvcache_read_f16(hk16, NULL, kv.cache, 0, 0, 0, 1),
              M40LLM_ERR_INVALID_ARGUMENT, "k_out is host memory");
  T_FAIL_WITH(m40llm_kvcache_read_f16(dk16, hk16, kv.cache, 0, 0, 0, 1),
              M40LLM_ERR_INVALID_ARGUMENT, "v_out is host memory");
  /* append_attn checks q, out, k and v before it appends: refused, and no sequence grew */
  {
    const int32_t id = 1;
    int before = -1, after = -2;
    T_OK(m40llm_kvcache_seq_len(&before, kv.cache, 0, 1));
    T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(dout, kv.cache, 0, &id, 1, dk, dv, hq, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "q is host memory");
    T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(hout, kv.cache, 0, &id, 1, dk, dv, dq, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "out is host memory");
    /* (an F16 cache at head_dim 16: the attention call writes the rows, and checks them) */
    T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(dout, kv.cache, 0, &id, 1, hk, dv, dq, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "k is host memory");
    T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(dout, kv.cache, 0, &id, 1, dk, hv, dq, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "v is host memory");
    T_OK(m40llm_kvcache_seq_len(&after, kv.cache, 0, 1));
    T_INT_EQ(after, before);
  }
  /* a call that passes, then the same call with a host q: still refused */
  T_OK(m40llm_kvcache_attn_last_token_f32q(dout, kv.cache, 0, 0, dq, 0.0f));
  T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(dout, kv.cache, 0, 0, hq, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "q is host memory");
  /* pinned host memory is mapped into the device's address space (unified addressing) */
  if (T_CHECK(cudaMallocHost((void **)&pinned, n * sizeof(float)) == cudaSuccess)) {
    memcpy(pinned, hq, n * sizeof(float));
    const int32_t id = 0;
    T_OK(m40llm_kvcache_attn_batch_f32q(dout, kv.cache, 0, &id, 1, pinned, 0.0f));
    T_OK(m40llm_context_synchronize(dev));
  }
  t_set_case("pointer kinds: the cache is unchanged and usable");
  t_kv_check_contents(&kv);
  t_kv_check_attention(&kv, 0, (const int32_t[]){0}, 1, hq, 0.0f, 1e-5, 1, NULL);
done:
  if (pinned) cudaFreeHost(pinned);
  free(hq);
  free(hout);
  free(hk);
  free(hv);
  free(hk16);
  m40llm_free(dev, dq);
  m40llm_free(dev, dout);
  m40llm_free(dev, dk);
  m40llm_free(dev, dv);
  m40llm_free(dev, dk16);
  t_kv_destroy(&kv);
}
#endif

/* A context with check_pointers = 0 skips the pointer check: every call still computes what
 * the reference says (device pointers throughout; a host pointer would fault it). */
static void test_pointer_checks_off(void) {
  t_set_case("check_pointers = 0: setup");
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  o.check_pointers = 0;
  m40llm_context *ctx = NULL;
  if (!T_OK(m40llm_context_create(&ctx, &o))) return;
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, 8, 2, 64, 3, 300) == M40LLM_OK) {
    const int lens[3] = {1, 33, 257};
    for (int s = 0; s < 3; s++) T_OK(t_kv_append_random(&kv, 0, s, lens[s], 1.0f));
    float *q = random_q(3 * 8 * 64);
    const int32_t ids[3] = {2, 0, 1};
    t_set_case("check_pointers = 0: attention");
    if (T_CHECK(q)) t_kv_check_attention(&kv, 0, ids, 3, q, 0.0f, 1e-5, 1, NULL);
    free(q);
    t_kv_destroy(&kv);
  }
  m40llm_context_destroy(ctx);
}

#ifdef T_HAVE_CUDART
/* A device fault, made on purpose with a kernel of our own (PTX through the driver API, loaded
 * at run time so that the test needs no libcuda at link time): it stores to an unmapped
 * address. The fault is sticky: it ends every CUDA context of this device in this process, so
 * this runs last. Skipped with M40LLM_TEST_NO_FAULT=1 (compute-sanitizer runs would report the
 * fault). */
static const char fault_ptx[] =
    ".version 6.0\n.target sm_52\n.address_size 64\n"
    ".visible .entry m40llm_test_fault(.param .u64 p)\n{\n"
    "  .reg .u64 %rd<2>;\n  .reg .u32 %r<2>;\n"
    "  ld.param.u64 %rd1, [p];\n  mov.u32 %r1, 1;\n  st.global.u32 [%rd1], %r1;\n  ret;\n}\n";

static int launch_fault(void *stream) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!T_CHECKF(lib != NULL, "dlopen libcuda.so.1")) return 0;
  int (*load)(void **, const void *) = NULL;
  int (*get)(void **, void *, const char *) = NULL;
  int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                void *, void **, void **) = NULL;
  *(void **)&load = dlsym(lib, "cuModuleLoadData");
  *(void **)&get = dlsym(lib, "cuModuleGetFunction");
  *(void **)&launch = dlsym(lib, "cuLaunchKernel");
  void *mod = NULL, *fn = NULL;
  unsigned long long bad = 0x10; /* unmapped */
  void *params[1] = {&bad};
  const int ok = T_CHECK(load && get && launch) && T_CHECK(load(&mod, fault_ptx) == 0) &&
                 T_CHECK(get(&fn, mod, "m40llm_test_fault") == 0) &&
                 T_CHECK(launch(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL) == 0);
  return ok; /* libcuda stays loaded: cudart uses it too */
}

static void test_context_lost(void) {
  const char *no_fault = getenv("M40LLM_TEST_NO_FAULT");
  if (no_fault && strcmp(no_fault, "1") == 0) {
    t_skip("the device-fault test (M40LLM_TEST_NO_FAULT=1)");
    return;
  }
  t_set_case("context lost: setup");
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  m40llm_context *a = NULL, *b = NULL;
  t_kv kv;
  int have_kv = 0;
  if (!T_OK(m40llm_context_create(&a, &o)) || !T_OK(m40llm_context_create(&b, &o))) goto done;
  if (t_kv_create(&kv, a, 1, 4, 2, 16, 2, 8) != M40LLM_OK) goto done;
  have_kv = 1;
  T_OK(t_kv_append_random(&kv, 0, 0, 3, 1.0f));
  float *q = t_dev_alloc(a, 64 * sizeof(float)), *out = t_dev_alloc(a, 64 * sizeof(float));
  if (!q || !out || !T_OK(m40llm_context_synchronize(a))) goto done;
  if (!launch_fault(m40llm_context_cuda_stream(a))) goto done;

  t_set_case("context lost: the call that meets the fault");
  T_FAIL_WITH(m40llm_context_synchronize(a), M40LLM_ERR_CONTEXT_LOST, "device fault");
  t_set_case("context lost: every later GPU call says so at once");
  void *p = NULL;
  T_FAIL_WITH(m40llm_context_synchronize(a), M40LLM_ERR_CONTEXT_LOST, "context is lost");
  T_FAIL_WITH(m40llm_malloc(&p, a, 256), M40LLM_ERR_CONTEXT_LOST, "context is lost");
  T_CHECK(p == NULL);
  T_FAIL_WITH(m40llm_kvcache_attn_last_token_f32q(out, kv.cache, 0, 0, q, 0.0f),
              M40LLM_ERR_CONTEXT_LOST, "context is lost");
  T_FAIL_WITH(m40llm_kvcache_append_f32(kv.cache, 0, 0, q, q, 1), M40LLM_ERR_CONTEXT_LOST,
              "context is lost");
  T_FAIL_WITH(m40llm_kvcache_read_f16((uint16_t *)out, NULL, kv.cache, 0, 0, 0, 1),
              M40LLM_ERR_CONTEXT_LOST, "context is lost");
  T_FAIL_WITH(m40llm_kvcache_seq_fork(kv.cache, 1, 0), M40LLM_ERR_CONTEXT_LOST, "context is lost");
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  T_FAIL_WITH(m40llm_context_device_info(&info, a), M40LLM_ERR_CONTEXT_LOST, "context is lost");
  t_set_case("context lost: host-side state still answers");
  int len = -1;
  if (T_OK(m40llm_kvcache_seq_len(&len, kv.cache, 0, 0))) T_INT_EQ(len, 3);
  t_set_case("context lost: another context on the device, and a new one");
  T_FAIL_WITH(m40llm_context_synchronize(b), M40LLM_ERR_CONTEXT_LOST, "device fault");
  T_FAIL_WITH(m40llm_context_synchronize(b), M40LLM_ERR_CONTEXT_LOST, "context is lost");
  /* a new context: refused, or (if the runtime let it be made) lost at its first GPU call */
  m40llm_context *c = NULL;
  const int rc = m40llm_context_create(&c, &o);
  if (rc == M40LLM_OK)
    T_FAIL_WITH(m40llm_context_synchronize(c), M40LLM_ERR_CONTEXT_LOST, "device fault");
  else
    T_CHECKF(rc == M40LLM_ERR_CONTEXT_LOST && c == NULL,
             "creating a context after the fault: %s (%s)", m40llm_status_string(rc),
             m40llm_last_error_message());
  m40llm_context_destroy(c);
  /* the buffers and the cache go with the context: destroy them as usual */
  m40llm_free(a, q);
  m40llm_free(a, out);
done:
  if (have_kv) t_kv_destroy(&kv);
  m40llm_context_destroy(a);
  m40llm_context_destroy(b);
  t_set_case("");
}
#endif

/* ---- The CUDA context itself ---------------------------------------------------------------- */

/* The device facts of version 2 against the build's list and what the driver loads from it:
 * the newest SASS of the GPU's major version not newer than the GPU, else the newest PTX not
 * newer than it, JIT-compiled. */
static void test_device_code(const m40llm_device_info *info) {
  t_set_case("CUDA device code");
  m40llm_build_info b = M40LLM_BUILD_INFO_INIT;
  if (!T_OK(m40llm_build_info_get(&b)) || !T_CHECK(b.cuda == 1)) return;
  int arch[64], real[64];
  const int n = t_parse_archs(b.cuda_architectures, arch, real, 64);
  if (!T_CHECKF(n >= 1, "cuda_architectures \"%s\"", b.cuda_architectures)) return;
  const int cc = 10 * info->compute_major + info->compute_minor;
  int sass = 0, ptx = 0;
  for (int i = 0; i < n; i++) {
    if (arch[i] > cc) continue;
    if (real[i] && arch[i] / 10 == info->compute_major && arch[i] > sass) sass = arch[i];
    if (!real[i] && arch[i] > ptx) ptx = arch[i];
  }
  if (!T_CHECKF(sass || ptx, "the build (%s) has no code for sm_%d", b.cuda_architectures, cc))
    return;
  T_INT_EQ(info->native_code, sass != 0);
  T_INT_EQ(info->kernel_arch, sass ? sass : ptx);
  T_INT_EQ(info->tensor_cores, b.tensor_cores && info->kernel_arch >= 80);
  printf("code: %s_%d %s (build: %s, CUDA %d.%d), tensor cores: %s\n",
         info->native_code ? "sm" : "compute", info->kernel_arch,
         info->native_code ? "SASS, native" : "PTX, JIT-compiled by the driver",
         b.cuda_architectures, b.cuda_toolkit_version / 1000, b.cuda_toolkit_version % 1000 / 10,
         info->tensor_cores ? "yes" : "no");

  t_set_case("CUDA device info, version 1");
  m40llm_device_info v1;
  memset(&v1, 0x5A, sizeof v1);
  v1.version = 1;
  const size_t v1_size = offsetof(m40llm_device_info, kernel_arch);
  if (T_OK(m40llm_context_device_info(&v1, dev))) {
    T_INT_EQ(v1.version, 1);
    T_CHECK(v1.backend == M40LLM_BACKEND_CUDA && strcmp(v1.name, info->name) == 0);
    T_CHECK(t_all_bytes((const char *)&v1 + v1_size, sizeof v1 - v1_size, 0x5A));
  }
}

static void test_cuda_context(int count) {
  t_set_case("CUDA device info");
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (T_OK(m40llm_context_device_info(&info, dev))) {
    T_CHECK(info.backend == M40LLM_BACKEND_CUDA);
    T_CHECK(info.device == 0);
    T_CHECK(memchr(info.name, '\0', sizeof info.name) != NULL && info.name[0] != '\0');
    T_CHECK(info.compute_major >= 5 && info.compute_minor >= 0);
    T_CHECK(info.multiprocessors > 0);
    T_CHECK(info.total_memory > 0 && info.free_memory > 0 &&
            info.free_memory <= info.total_memory);
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB (%.1f GiB free), %d device(s)\n", info.name,
           info.compute_major, info.compute_minor, info.multiprocessors,
           (double)info.total_memory / 1073741824.0, (double)info.free_memory / 1073741824.0,
           count);
  }
  T_CHECK(m40llm_context_cuda_stream(dev) != NULL);
  T_OK(m40llm_context_synchronize(dev));
  test_device_code(&info);

  t_set_case("CUDA context creation");
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  m40llm_context *sentinel = (m40llm_context *)&o, *c = sentinel;
  o.backend = M40LLM_BACKEND_CUDA;
  o.device = count;
  T_FAIL_WITH(m40llm_context_create(&c, &o), M40LLM_ERR_OUT_OF_RANGE, "device");
  o.device = -1;
  T_FAIL_WITH(m40llm_context_create(&c, &o), M40LLM_ERR_OUT_OF_RANGE, "device");
  T_CHECK(c == sentinel);
  /* AUTO picks CUDA; a second context works beside the first and goes away cleanly */
  c = NULL;
  if (T_OK(m40llm_context_create(&c, NULL))) {
    m40llm_device_info i2 = M40LLM_DEVICE_INFO_INIT;
    if (T_OK(m40llm_context_device_info(&i2, c))) T_CHECK(i2.backend == M40LLM_BACKEND_CUDA);
    T_CHECK(m40llm_context_cuda_stream(c) != m40llm_context_cuda_stream(dev));
    t_kv kv;
    if (t_kv_create(&kv, c, 1, 4, 2, 64, 2, 64) == M40LLM_OK) {
      T_OK(t_kv_append_random(&kv, 0, 0, 50, 1.0f));
      float *q = random_q(4 * 64);
      const int32_t id = 0;
      if (q) t_kv_check_attention(&kv, 0, &id, 1, q, 0.0f, 1e-5, 1, NULL);
      free(q);
      t_kv_destroy(&kv);
    }
    m40llm_context_destroy(c);
  }

  /* head_dim must be a multiple of 8 on CUDA; the CPU takes any in 1..256 */
  t_set_case("CUDA head_dim not a multiple of 8");
  const int bad_dims[] = {1, 4, 12, 20, 100, 250};
  for (size_t i = 0; i < sizeof bad_dims / sizeof bad_dims[0]; i++) {
    m40llm_kvcache_options ko = M40LLM_KVCACHE_OPTIONS_INIT;
    ko.n_layers = 1;
    ko.n_heads = 4;
    ko.n_kv_heads = 2;
    ko.head_dim = bad_dims[i];
    ko.max_seqs = 1;
    ko.max_seq_len = 16;
    m40llm_kvcache *kc = NULL;
    T_FAIL_WITH(m40llm_kvcache_create(&kc, dev, &ko), M40LLM_ERR_UNSUPPORTED, "head_dim");
    T_CHECK(kc == NULL);
    if (T_OK(m40llm_kvcache_create(&kc, cpu, &ko))) m40llm_kvcache_destroy(kc);
  }
}

#ifdef T_HAVE_CUDART
/* A stream the caller owns (non-blocking, so nothing orders it with the legacy stream). */
static void test_user_stream(void) {
  t_set_case("caller's CUDA stream");
  cudaStream_t s = NULL;
  if (!T_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess)) return;
  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = M40LLM_BACKEND_CUDA;
  o.cuda_stream = (void *)s;
  m40llm_context *c = NULL;
  if (T_OK(m40llm_context_create(&c, &o))) {
    T_CHECK(m40llm_context_cuda_stream(c) == (void *)s);
    t_kv kv;
    const int len = small ? 700 : 2500;
    if (t_kv_create(&kv, c, 2, 8, 2, 128, 3, len + 500) == M40LLM_OK) {
      T_OK(t_kv_append_random(&kv, 1, 0, len, 1.0f));
      T_OK(t_kv_append_random(&kv, 1, 2, 17, 1.0f));
      T_OK(t_kv_fork(&kv, 1, 0));
      T_OK(t_kv_truncate(&kv, 1, len - 501));
      t_kv_check_contents(&kv);
      const int32_t ids[4] = {0, 1, 2, 1};
      float *q = random_q(4 * 8 * 128);
      if (q) t_kv_check_attention(&kv, 1, ids, 4, q, 0.0f, 1e-5, 1, NULL);
      free(q);
      t_kv_destroy(&kv);
    }
    T_OK(m40llm_context_synchronize(c));
    m40llm_context_destroy(c);
  }
  T_CHECK(cudaStreamDestroy(s) == cudaSuccess);
}
#endif

/* ---- Shapes x lengths ------------------------------------------------------------------------- */

static void shuffle(int32_t *a, int n) {
  for (int i = n - 1; i > 0; i--) {
    int j = t_rand_int(0, i);
    int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

static void test_shape_sweep(void) {
  static const int dims[] = {64, 80, 128, 256};
  static const int heads[][2] = {{8, 8}, {16, 4}, {32, 4}, {12, 4}, {28, 4}, {8, 1}};
  int config = 0;
  for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
    for (size_t hi = 0; hi < sizeof heads / sizeof heads[0]; hi++, config++) {
      const int hd = dims[di], nh = heads[hi][0], nkv = heads[hi][1];
      /* small: seq 6 gets 600 positions instead of 4099, and the random one at most 700 */
      const int max_seqs = 9, max_len = small ? 700 : 5000;
      t_kv kv;
      t_set_case("sweep %d/%d heads, head_dim %d: setup", nh, nkv, hd);
      if (t_kv_create(&kv, dev, 2, nh, nkv, hd, max_seqs, max_len) != M40LLM_OK) continue;
      const int lens[9] = {1, 2, 31, 33, 255, 257, small ? 600 : 4099, t_rand_int(1, max_len), 0};
      for (int s = 0; s < max_seqs; s++) {
        if (lens[s]) T_OK(t_kv_append_random(&kv, 1, s, lens[s], 1.0f));
        if (s % 3 != 2) T_OK(t_kv_append_random(&kv, 0, s, t_rand_int(1, 40), 1.0f));
      }
      t_set_case("sweep %d/%d heads, head_dim %d: contents", nh, nkv, hd);
      t_kv_check_contents(&kv);

      int32_t ids[12];
      for (int s = 0; s < max_seqs; s++) ids[s] = s;
      for (int r = max_seqs; r < 12; r++) ids[r] = t_rand_int(0, max_seqs - 1);
      shuffle(ids, 12);
      const size_t stride = (size_t)nh * (size_t)hd;
      float *q = random_q(12 * stride);
      if (q) {
        const float scale = pick_scale(config);
        t_set_case("sweep %d/%d heads, head_dim %d, scale %g: layer 1 batch", nh, nkv, hd,
                   (double)scale);
        t_kv_check_attention(&kv, 1, ids, 12, q, scale, 1e-5, 1, NULL);
        t_set_case("sweep %d/%d heads, head_dim %d, scale %g: layer 0 batch", nh, nkv, hd,
                   (double)scale);
        t_kv_check_attention(&kv, 0, ids, 12, q, scale, 1e-5, 1, NULL);
        /* single calls on the long, the random, the length-1 and the empty sequence */
        const int32_t singles[4] = {6, 7, 0, 8};
        t_set_case("sweep %d/%d heads, head_dim %d, scale %g: single", nh, nkv, hd,
                   (double)scale);
        t_kv_check_attention(&kv, 1, singles, 4, q, scale, 1e-5, 0, NULL);
      }
      free(q);
      t_kv_destroy(&kv);
    }
  }
  t_set_case("");
}

/* Every head_dim the CUDA backend takes has its own thread layout: the multiples of 8 that are
 * not powers of two (48, 80 and 112 run the tensor-core kernel's 16-dim tail on sm_80+), and
 * groups that leave a partial tile of query heads. Lengths straddle the 128-position tiles. */
static void test_head_dim_sweep(void) {
  static const int all_dims[] = {8,   16,  24,  40,  48,  56,  72,  80,  88,  96,  104,
                                 112, 120, 136, 144, 160, 192, 200, 224, 240, 248};
  static const int small_dims[] = {8, 24, 48, 112, 120, 136, 248};
  static const int heads[][2] = {{4, 4}, {12, 4}, {10, 1}, {16, 2}};
  const int *dims = small ? small_dims : all_dims;
  const size_t n_dims = small ? sizeof small_dims / sizeof small_dims[0]
                              : sizeof all_dims / sizeof all_dims[0];
  int n = 0;
  for (size_t di = 0; di < n_dims; di++) {
    for (size_t hi = 0; hi < sizeof heads / sizeof heads[0]; hi++, n++) {
      const int hd = dims[di], nh = heads[hi][0], nkv = heads[hi][1];
      t_kv kv;
      t_set_case("head_dim sweep %d/%d heads, head_dim %d: setup", nh, nkv, hd);
      if (t_kv_create(&kv, dev, 1, nh, nkv, hd, 5, 600) != M40LLM_OK) continue;
      const int lens[5] = {1, 128, 129, t_rand_int(130, 600), 0};
      for (int s = 0; s < 5; s++)
        if (lens[s]) T_OK(t_kv_append_random(&kv, 0, s, lens[s], 1.0f));
      const int32_t ids[6] = {3, 0, 4, 1, 2, 3};
      float *q = random_q(6 * (size_t)nh * (size_t)hd);
      if (q) {
        const float scale = pick_scale(n);
        t_set_case("head_dim sweep %d/%d heads, head_dim %d, scale %g", nh, nkv, hd,
                   (double)scale);
        t_kv_check_attention(&kv, 0, ids, 6, q, scale, 1e-5, 1, NULL);
        t_kv_check_attention(&kv, 0, ids, 1, q, scale, 1e-5, 0, NULL);
      }
      free(q);
      if (n % 7 == 0) t_kv_check_contents(&kv);
      t_kv_destroy(&kv);
    }
  }
  t_set_case("");
}

/* A launch whose rows alone fill the GPU, so sequences of hundreds of positions are not split,
 * followed by a launch of two rows that are. */
static void test_wide_batch(void) {
  t_kv kv;
  t_set_case("wide batch: setup");
  const int max_len = small ? 300 : 1500;
  if (t_kv_create(&kv, dev, 1, 32, 32, 128, 4, max_len) != M40LLM_OK) return;
  const int lens[4] = {small ? 130 : 700, max_len, 1, 0};
  for (int s = 0; s < 4; s++)
    if (lens[s]) T_OK(t_kv_append_random(&kv, 0, s, lens[s], 1.0f));
  int32_t ids[130];
  for (int i = 0; i < 130; i++) ids[i] = i < 4 ? i : t_rand_int(0, 3);
  float *q = random_q(130 * 32 * 128);
  if (q) {
    t_set_case("wide batch: 130 rows of 32/32 heads");
    t_kv_check_attention(&kv, 0, ids, 130, q, 0.0f, 1e-5, 1, NULL);
  }
  free(q);
  t_kv_destroy(&kv);
}

/* Split launches share the context's split-K scratch between caches and calls. Two caches with
 * different head layouts (32/8 and 12/12 heads) and split counts take turns on one context;
 * every call is checked against the reference and must repeat the first call's output bit for
 * bit (no state leaks from one launch into the next). */
static void test_repeated_split_calls(void) {
  t_kv a, b;
  t_set_case("repeated split calls: setup");
  if (t_kv_create(&a, dev, 1, 32, 8, 128, 3, 3000) != M40LLM_OK) return;
  if (t_kv_create(&b, dev, 1, 12, 12, 64, 2, 5000) != M40LLM_OK) {
    t_kv_destroy(&a);
    return;
  }
  T_OK(t_kv_append_random(&a, 0, 0, 2999, 1.0f));
  T_OK(t_kv_append_random(&a, 0, 1, 700, 1.0f));
  T_OK(t_kv_append_random(&a, 0, 2, 33, 1.0f));
  T_OK(t_kv_append_random(&b, 0, 0, 4097, 1.0f));
  T_OK(t_kv_append_random(&b, 0, 1, 257, 1.0f));
  const int32_t ids_a[3] = {0, 1, 2}, ids_b[2] = {1, 0};
  const size_t na = 3 * 32 * 128, nb = 2 * 12 * 64;
  float *qa = random_q(na), *qb = random_q(nb);
  float *first_a = malloc(na * sizeof(float)), *got_a = malloc(na * sizeof(float));
  float *first_b = malloc(nb * sizeof(float)), *got_b = malloc(nb * sizeof(float));
  if (qa && qb && first_a && got_a && first_b && got_b) {
    for (int rep = 0; rep < 4; rep++) {
      t_set_case("repeated split calls: 32/8 heads, 3 sequences, call %d", rep);
      t_kv_check_attention(&a, 0, ids_a, 3, qa, 0.0f, 1e-5, 1, rep ? got_a : first_a);
      t_set_case("repeated split calls: 12/12 heads, 2 sequences, call %d", rep);
      t_kv_check_attention(&b, 0, ids_b, 2, qb, 0.0f, 1e-5, 1, rep ? got_b : first_b);
      /* one sequence alone in between: a different split layout over the same scratch */
      t_set_case("repeated split calls: 32/8 heads, 1 sequence, call %d", rep);
      t_kv_check_attention(&a, 0, ids_a, 1, qa, 0.0f, 1e-5, 1, NULL);
      if (rep) {
        t_set_case("repeated split calls: call %d repeats call 0", rep);
        T_CHECKF(memcmp(first_a, got_a, na * sizeof(float)) == 0, "32/8 output changed");
        T_CHECKF(memcmp(first_b, got_b, nb * sizeof(float)) == 0, "12/12 output changed");
      }
    }
  } else {
    T_CHECKF(0, "host allocation failed");
  }
  free(qa);
  free(qb);
  free(first_a);
  free(got_a);
  free(first_b);
  free(got_b);
  t_kv_destroy(&a);
  t_kv_destroy(&b);
  t_set_case("");
}

/* ---- Long contexts ----------------------------------------------------------------------------- */

static void long_case(int nh, int nkv, int hd, int len, float scale) {
  t_kv kv;
  t_set_case("long context %d/%d heads, head_dim %d, length %d: setup", nh, nkv, hd, len);
  if (t_kv_create(&kv, dev, 1, nh, nkv, hd, 2, len + 64) != M40LLM_OK) return;
  T_OK(t_kv_append_random(&kv, 0, 0, len, 1.0f));
  T_OK(t_kv_append_random(&kv, 0, 1, 3, 1.0f));
  const int32_t ids[3] = {0, 1, 0};
  float *q = random_q(3 * (size_t)nh * (size_t)hd);
  if (q) {
    t_set_case("long context %d/%d heads, head_dim %d, length %d, scale %g", nh, nkv, hd, len,
               (double)scale);
    t_kv_check_attention(&kv, 0, ids, 3, q, scale, 2e-5, 1, NULL);
    t_kv_check_attention(&kv, 0, ids, 1, q, scale, 2e-5, 0, NULL);
  }
  free(q);
  /* the stored data is still exact that far out */
  t_set_case("long context %d/%d heads, head_dim %d, length %d: contents", nh, nkv, hd, len);
  t_kv_check_contents(&kv);
  t_kv_destroy(&kv);
}

static void test_long_contexts(void) {
  long_case(8, 2, 128, 32768 + t_rand_int(0, 300), 0.0f);
  long_case(16, 1, 64, 65536 + t_rand_int(1, 1000), t_rand_float(0.05f, 0.15f));
  long_case(4, 4, 256, 32769, 0.0f);
  long_case(28, 4, 80, 9000 + t_rand_int(0, 1000), 0.0f);
}

/* Splits of 512+ positions run the tensor-core kernel with K/V staged in shared memory on sm_90
 * (head_dim 80-112; 128 loads through registers): a long sequence, batched with a 3-position one
 * that ends inside a step. Runs in small mode too, so that compute-sanitizer sees the bulk
 * copies. */
static void test_long_gqa_splits(void) {
  long_case(32, 8, 112, 16384 + t_rand_int(1, 999), 0.0f);
  if (!small) long_case(64, 8, 128, 40000 + t_rand_int(1, 999), 0.0f);
}

/* Plans of at most a block an SM whose blocks take 256 positions or more run the tensor-core
 * kernel's broad blocks on sm_80+ (twice the warps, head_dim 192 and 256; mma_broad_warps): a
 * long sequence of few K/V heads, about 300 positions a block at the device's SM count S.
 * long_case's one-sequence call plans so at 8/1 on every GPU and at 28/4 at the H100's and
 * H200's 132 SMs (not at every S); 12/3 plans more blocks than SMs (its 4-head tiles' splits
 * take 256 positions at least) and takes the direct pass at the same length; the batch call
 * (two long rows) plans every resident block (SplitPass::fill) on the direct pass. */
static void test_broad_blocks(void) {
  if (!on_cuda) return; /* the CPU backend plans no blocks */
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  if (!T_OK(m40llm_context_device_info(&info, dev))) return;
  const int sms = info.multiprocessors > 0 ? info.multiprocessors : 24;
  static const int shapes[4][3] = {{8, 1, 256}, {28, 4, 256}, {8, 1, 192}, {12, 3, 192}};
  for (int i = 0; i < 4; i++) {
    const int nkv = shapes[i][1];
    long_case(shapes[i][0], nkv, shapes[i][2], 300 * sms / nkv + t_rand_int(0, 99),
              i % 2 ? t_rand_float(0.05f, 0.15f) : 0.0f);
  }
}

/* Plans of more splits than a combine block of 8 warps loads in one round trip (48 up to head_dim
 * 128, 32 above), on a grid of at most a block an SM, merge in blocks of 32 warps (combine_wide in
 * cuda/tuning.cuh): one K/V head and about 26,500 positions, at head_dim 64 (a word a lane), 80
 * (the merging warp partly past the head's 20 words) and 256 (two words a lane). The FP32
 * kernels' plans (the M40's) split them into 52 or more (512 positions, an 8-head tile's shortest
 * split), the tensor-core kernel's where its target of blocks allows as many; the one-row calls'
 * grids are 8-16 blocks (the M40 has 24 SMs), the three-row calls' 24-48. */
static void test_wide_combine(void) {
  if (!on_cuda) return; /* the CPU backend plans no blocks */
  long_case(16, 1, 64, 26500 + t_rand_int(0, 99), 0.0f);
  long_case(12, 1, 80, 26500 + t_rand_int(0, 99), t_rand_float(0.05f, 0.15f));
  long_case(8, 1, 256, 26500 + t_rand_int(0, 99), 0.0f);
}

/* ---- Batches ---------------------------------------------------------------------------------- */

static void test_ragged_batch(void) {
  t_kv kv;
  t_set_case("ragged batch: setup");
  const int longest = small ? 1025 : 4099;
  if (t_kv_create(&kv, dev, 1, 32, 8, 128, 5, longest) != M40LLM_OK) return;
  const int lens[5] = {1, 33, 257, longest, 0};
  for (int s = 0; s < 5; s++)
    if (lens[s]) T_OK(t_kv_append_random(&kv, 0, s, lens[s], 1.0f));
  const int32_t ids[10] = {0, 1, 2, 3, 4, 3, 4, 0, 3, 1};
  float *q = random_q(10 * 32 * 128);
  if (q) {
    for (int i = 0; i < 2; i++) {
      t_set_case("ragged batch {1, 33, 257, %d, 0} + repeats, scale %s", longest,
                 i ? "explicit" : "0");
      const float scale = i ? 0.07f : 0.0f;
      t_kv_check_attention(&kv, 0, ids, 10, q, scale, 1e-5, 1, NULL);
      t_kv_check_attention(&kv, 0, ids, 5, q, scale, 1e-5, 0, NULL);
    }
  }
  free(q);
  t_kv_destroy(&kv);
}

/* More rows than one launch takes, ids in random order with many repeats. */
static void test_big_batch(void) {
  t_kv kv;
  t_set_case("big batch: setup");
  const int max_len = small ? 300 : 700;
  if (t_kv_create(&kv, dev, 2, 8, 2, 64, 6, max_len) != M40LLM_OK) return;
  for (int s = 0; s < 6; s++) {
    if (s != 4) T_OK(t_kv_append_random(&kv, 1, s, t_rand_int(1, max_len), 1.0f));
    T_OK(t_kv_append_random(&kv, 0, s, t_rand_int(1, 10), 1.0f));
  }
  const int n = 300;
  int32_t ids[300];
  for (int i = 0; i < n; i++) ids[i] = t_rand_int(0, 5);
  float *q = random_q((size_t)n * 8 * 64);
  if (q) {
    t_set_case("big batch: %d rows", n);
    t_kv_check_attention(&kv, 1, ids, n, q, 0.0f, 1e-5, 1, NULL);
    t_kv_check_attention(&kv, 0, ids, 129, q, 0.0f, 1e-5, 1, NULL);
  }
  free(q);
  t_kv_destroy(&kv);
}

/* ---- Lockstep with the CPU backend --------------------------------------------------------- */

static int both_append(t_kv *g, t_kv *c, int layer, int seq, int n, int use_f32) {
  t_kv *const kvs[2] = {g, c};
  int st[2];
  t_kv_append_same_random(kvs, st, 2, layer, seq, n, 1.5f, use_f32);
  T_CHECKF(st[0] == st[1], "append: device returned %d, CPU %d", st[0], st[1]);
  return st[0];
}

static void compare_backends(t_kv *g, t_kv *c, const char *when) {
  const int nh = g->opts.n_heads, hd = g->opts.head_dim, ms = g->opts.max_seqs;
  const size_t stride = (size_t)nh * (size_t)hd;
  int32_t ids[8];
  int n = 0;
  for (int s = 0; s < ms; s++) ids[n++] = s;
  ids[n++] = t_rand_int(0, ms - 1);
  float *q = random_q((size_t)n * stride);
  float *og = malloc((size_t)n * stride * sizeof(float));
  float *oc = malloc((size_t)n * stride * sizeof(float));
  if (q && og && oc) {
    for (int l = 0; l < g->opts.n_layers; l++) {
      t_set_case("lockstep with CPU backend, %s, layer %d", when, l);
      float scale = pick_scale(l);
      t_kv_check_attention(g, l, ids, n, q, scale, 1e-5, 1, og);
      t_kv_check_attention(c, l, ids, n, q, scale, 1e-5, 1, oc);
      double num = 0.0, den = 0.0;
      for (size_t i = 0; i < (size_t)n * stride; i++) {
        double d = (double)og[i] - (double)oc[i];
        num += d * d;
        den += (double)oc[i] * oc[i];
      }
      T_CHECKF(num <= 1e-10 * den, "device and CPU attention differ: rel L2 %g",
               den > 0 ? sqrt(num / den) : sqrt(num));
    }
  }
  free(q);
  free(og);
  free(oc);
  t_set_case("lockstep with CPU backend, %s: contents", when);
  t_kv_check_contents(g);
  t_kv_check_contents(c);
}

static void test_lockstep(void) {
  t_kv g, c;
  const int n_layers = 3, nh = 12, nkv = 4, hd = 64, ms = 4, max_len = small ? 600 : 1500;
  t_set_case("lockstep with CPU backend: setup");
  if (t_kv_create(&g, dev, n_layers, nh, nkv, hd, ms, max_len) != M40LLM_OK) return;
  if (t_kv_create(&c, cpu, n_layers, nh, nkv, hd, ms, max_len) != M40LLM_OK) {
    t_kv_destroy(&g);
    return;
  }
  for (int step = 0; step < 60; step++) {
    const int op = t_rand_int(0, 9);
    const int seq = t_rand_int(0, ms - 1);
    t_set_case("lockstep with CPU backend, step %d, op %d", step, op);
    if (op <= 5) {
      const int layer = t_rand_int(0, n_layers - 1);
      const int len = t_model_len(&g.model, layer, seq);
      const int room = max_len - len;
      if (room == 0 || op == 5) {
        /* past capacity on both: nothing changes */
        T_STATUS(both_append(&g, &c, layer, seq, room + t_rand_int(1, 5), op & 1),
                 M40LLM_ERR_CAPACITY);
      } else {
        const int most = max_len / 5;
        int n = t_rand_int(1, room < most ? room : most);
        T_OK(both_append(&g, &c, layer, seq, n, op & 1));
      }
    } else if (op == 6) {
      int src = t_rand_int(0, ms - 1);
      if (src == seq) src = (src + 1) % ms;
      int sg = t_kv_fork(&g, seq, src), sc = t_kv_fork(&c, seq, src);
      T_OK(sg);
      T_OK(sc);
    } else if (op <= 8) {
      int new_len = t_rand_int(0, max_len + max_len / 15);
      T_OK(t_kv_truncate(&g, seq, new_len));
      T_OK(t_kv_truncate(&c, seq, new_len));
    } else {
      T_OK(t_kv_reset(&g, seq));
      T_OK(t_kv_reset(&c, seq));
    }
    if (step % 15 == 14) {
      char when[64];
      snprintf(when, sizeof when, "after step %d", step);
      compare_backends(&g, &c, when);
    }
  }
  T_OK(m40llm_context_synchronize(dev));
  t_kv_destroy(&g);
  t_kv_destroy(&c);
  t_set_case("");
}

int main(void) {
  t_rng_init();
  const char *backend_env = getenv("M40LLM_TEST_GPU_BACKEND");
  const int force_cpu = backend_env && strcmp(backend_env, "cpu") == 0;
  const char *small_env = getenv("M40LLM_TEST_SMALL");
  small = small_env && strcmp(small_env, "1") == 0;
  if (small) printf("small mode (M40LLM_TEST_SMALL=1): no long contexts, a few head_dims\n");
  only = getenv("M40LLM_TEST_ONLY");
  if (only && !*only) only = NULL;
  if (only && !only_names_known()) return t_finish();
  int count = 0;
  if (!force_cpu) {
    if (!m40llm_built_with_cuda()) return skip_or_fail("m40llm was built without the CUDA backend");
    if (!T_OK(m40llm_cuda_device_count(&count))) return t_finish();
    if (count == 0) return skip_or_fail("no CUDA device is visible");
  } else {
    printf("M40LLM_TEST_GPU_BACKEND=cpu: running the GPU cases on the CPU backend\n");
  }

  m40llm_context_options o = M40LLM_CONTEXT_OPTIONS_INIT;
  o.backend = force_cpu ? M40LLM_BACKEND_CPU : M40LLM_BACKEND_CUDA;
  t_set_case("create contexts");
  if (!T_OK(m40llm_context_create(&dev, &o))) return t_finish();
  o.backend = M40LLM_BACKEND_CPU;
  if (!T_OK(m40llm_context_create(&cpu, &o))) {
    m40llm_context_destroy(dev);
    return t_finish();
  }
  on_cuda = !force_cpu;

  if (group("context")) {
    if (on_cuda) {
      test_cuda_context(count);
#ifdef T_HAVE_CUDART
      test_user_stream();
      test_ids_alias_out_managed();
      test_append_attn_ids_alias_out_managed();
      test_pointer_kinds();
#endif
      test_pointer_checks_off();
    } else {
      t_skip("the context cases: CUDA contexts only");
    }
  }
  if (group("errors")) t_cases_error_paths(dev);
  if (group("sequences")) t_cases_sequence_ops(dev);
  if (group("rounding")) t_cases_fp16_rounding(dev);
  if (group("attention")) t_cases_attention_basic(dev);
  if (group("quantized")) t_cases_quantized(dev, small);
  if (group("append")) t_cases_append_batch(dev, small);
  if (group("masked")) t_cases_attention_masked(dev);
  if (group("causal")) t_cases_causal(dev, cpu, small);
  if (group("dtype")) t_cases_dtype(dev, cpu, small);
  if (group("weights")) t_cases_weights(dev, cpu, small);
  if (group("importance")) t_cases_importance(dev, cpu, small);
  if (group("tiers")) t_cases_tiers(dev, small);
  if (group("policy")) t_cases_policy(dev, small);
  if (group("graph")) {
#ifdef T_HAVE_CUDART
    if (on_cuda) t_cases_graph(dev, cpu, small);
    else t_skip("graph capture: a CUDA graph needs the CUDA backend");
#else
    t_skip("graph capture: built without the CUDA runtime");
#endif
  }
  if (group("decode")) {
    test_shape_sweep();
    test_head_dim_sweep();
    test_ragged_batch();
    test_wide_batch();
    test_big_batch();
    test_repeated_split_calls();
    if (!small) test_long_contexts();
    test_long_gqa_splits();
    test_broad_blocks();
    test_wide_combine();
    test_lockstep();
  }

  t_set_case("final synchronize");
  T_OK(m40llm_context_synchronize(dev));
  m40llm_context_destroy(cpu);
  m40llm_context_destroy(dev);
#ifdef T_HAVE_CUDART
  /* last: the fault ends CUDA on this device */
  if (on_cuda && group("fault")) test_context_lost();
#endif
  t_set_case("");
  return t_finish();
}
