/*
 * m40llm — a GPU-resident FP16 KV cache and decode-time attention for LLM inference.
 *
 * Pure C11; includes no CUDA header, so C programs and bindgen need no toolkit to read it.
 *
 * Conventions
 * - Every fallible call returns an int status: M40LLM_OK (0) or a negative M40LLM_ERR_* code.
 *   m40llm_status_string() names a code; m40llm_last_error_message() gives the detail of the last
 *   failure on the calling thread (thread-local, valid until the next failing call on that thread).
 * - Output parameters come first. On failure nothing is written to them, no cache contents or
 *   lengths change, and the handle stays usable (except after M40LLM_ERR_CONTEXT_LOST).
 * - destroy(NULL) and free(ctx, NULL) are no-ops.
 * - Options structs carry a version field; initialise them with their *_INIT macro (or the
 *   *_init function) so newer library versions can add fields without breaking older callers.
 *
 * Memory
 * - Buffers passed to append, read and attention calls live in the context's backend memory:
 *   device pointers for the CUDA backend (from m40llm_malloc or the caller's own cudaMalloc in the
 *   same CUDA context), host pointers for the CPU backend. m40llm_malloc/m40llm_memcpy_* let code
 *   stay backend-neutral.
 *
 * Device faults (CUDA backend)
 * - A kernel that faults (e.g. an illegal address: a buffer too small for the call, memory freed
 *   while in use) leaves a "sticky" error in the CUDA context of that device in this process:
 *   every later CUDA call there fails, for this library and for the caller's own CUDA work alike,
 *   and the device's memory, every cache on it included, is lost. Only a new process (or
 *   cudaDeviceReset, once nothing uses the device) recovers. The call that meets such an error
 *   returns M40LLM_ERR_CONTEXT_LOST with the CUDA error in the message; from then on every call
 *   on that context, or on a cache made from it, that would use the GPU returns
 *   M40LLM_ERR_CONTEXT_LOST at once, saying so (calls that only read or change host-side
 *   state, such as m40llm_kvcache_seq_len and seq_truncate, still work). Other contexts on the
 *   same device get it at their next GPU call. Destroy the caches and the context as usual (it
 *   releases their host memory; the device memory went with the CUDA context).
 * - To keep a wrong pointer from faulting, the CUDA backend checks that q and out (attention),
 *   k and v (append) and k_out and v_out (read) are memory its kernels can address: device or
 *   managed memory (of any device), or pinned host memory mapped into the device's address
 *   space; anything else, e.g. a plain host pointer, fails with M40LLM_ERR_INVALID_ARGUMENT
 *   naming the argument. The context remembers the last few pointers that passed until
 *   m40llm_free is called on it, so a decode loop over the same buffers pays for the check
 *   once. It cannot see a buffer's size, nor memory freed behind its back.
 *
 * Ordering
 * - CUDA backend: append, read, fork, attention, memset and device-to-device copies are enqueued
 *   on the context's stream and may return before the GPU finishes; host<->device copies block
 *   until done. Errors raised while a kernel runs surface at the next call that synchronizes
 *   (m40llm_context_synchronize or a host copy). CPU backend: every call completes before it
 *   returns.
 * - Where the build has sm_90+ code (e.g. CUDA architectures 90-real) and the GPU runs it, the
 *   attention kernels are programmatic dependent launches: they may be scheduled before the
 *   work queued ahead of them ends, and wait on the device for it before they touch memory.
 *   Stream order holds as for any kernel. A kernel you launch after a call as a programmatic
 *   dependent must itself wait (cudaGridDependencySynchronize) before it touches the call's q,
 *   out or cache, as any programmatic dependent must.
 * - A tiered cache's attention call (m40llm_kvcache_options.n_tiers) makes a launch per tier
 *   that holds rows of the call's sequences (the first tier where none does). With sm_90 code
 *   on the tensor cores they follow each other on the context's stream as programmatic
 *   dependents. Elsewhere the first runs on the context's stream and the others
 *   beside it on streams the context owns (made with its first tiered cache, of the stream's
 *   priority), forked from the stream by an event and joined back into it before the call's
 *   combine kernel, and in a graph capture they are branches of the graph. A short call of
 *   three launches or more (at most 1024 x the GPU's SM count positions over its sequences and
 *   K/V heads, a K/V head of more than 8 query heads counted once per 8) makes one launch for
 *   all its tiers instead, on
 *   sm_80+ GPUs, where every architecture of the build is sm_70+ and CUDA (build and driver) is
 *   12.1 or later. Stream order holds as for any call.
 *
 * Graphs (CUDA backend)
 * - A decode step's calls can be captured into a CUDA graph on the context's stream
 *   (m40llm_context_cuda_stream; the caller's, if it gave one): append, append_batch,
 *   attn_batch, attn_last_token, append_attn and attn_causal, their _ex forms, every K/V
 *   format. They allocate no device memory (after the warm-up below), never wait for the
 *   GPU and read no device memory on the host; the capture records their kernel launches.
 *   Except: with M40LLM_PLACE_IMPORTANCE, an append may wait for the GPU (see
 *   m40llm_kvcache_attn_observe_ex), and the observe call is refused. Not capturable: host copies,
 *   m40llm_malloc and m40llm_free, m40llm_context_synchronize, creating or destroying a cache.
 * - A captured call bakes in what the host decided when it was made: the positions an append
 *   writes and the lengths attention reads (its split plan is a kernel argument), the
 *   pointers and the scale. The cache's lengths (host state) move when the call is made, as
 *   for an eager call, not when the graph runs. So a graph holds one step: launch it once (a
 *   second launch redoes that same step: same positions written, same lengths read). The
 *   library's way to run step after step as graphs is graph-safe parameter updates by
 *   re-capture: capture each step's calls again and apply the new graph to the instantiated
 *   one with cudaGraphExecUpdate, which succeeds while the step launches the same kernels
 *   (the same calls, and each attention's split structure unchanged) and costs much less
 *   than instantiating; where it refuses (e.g. a sequence has grown into needing the combine
 *   kernel), instantiate the new graph. m40llm_graph_capture_begin / _end do both for you
 *   (the CUDA runtime's own graph calls work as well). Lengths do not
 *   advance on the device. An update does not touch launches already queued, so the host can
 *   capture and update the next step while the GPU runs the one before
 *   (examples/decode_loop.c, rust/m40llm/examples/decode_loop.rs; ffi_tests/cases_graph.c
 *   tests it).
 * - Warm-up rule: make a step's calls once outside a capture before capturing them. The first
 *   call of a context with 16-bit rows (an _ex call with M40LLM_DTYPE_F16 or _BF16) allocates
 *   its staging buffer, and a call with more rows than before grows it; during a capture such
 *   a call fails with M40LLM_ERR_UNSUPPORTED before anything is written or captured (the
 *   capture stays valid); so does m40llm_kvcache_attn_importance_ex's scratch buffer. The
 *   attention workspace is sized when a cache is created: decode
 *   calls never grow it. The first calls also ask the runtime about their kernels (once per
 *   context and cache shape) and, on a GPU that runs PTX, have the driver compile them.
 * - A call that fails during a capture leaves the calls captured before it recorded and their
 *   lengths moved, for a graph that is not launched: end the capture, discard the graph and
 *   put the lengths back (m40llm_kvcache_seq_truncate).
 *
 * Threading
 * - A context and every cache made from it form one unit: calls on them must not run concurrently
 *   (serialize them, e.g. one thread per context). Distinct contexts are independent and may be
 *   used from different threads at once. Status strings are static and thread-safe.
 */
#ifndef M40LLM_H
#define M40LLM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define M40LLM_VERSION_MAJOR 0
#define M40LLM_VERSION_MINOR 1
#define M40LLM_VERSION_PATCH 0
#define M40LLM_VERSION_NUMBER \
  (M40LLM_VERSION_MAJOR * 10000 + M40LLM_VERSION_MINOR * 100 + M40LLM_VERSION_PATCH)

/** Version of the linked library, as M40LLM_VERSION_NUMBER computes it. */
unsigned m40llm_version_number(void);
/** Version of the linked library as "MAJOR.MINOR.PATCH". Static storage. */
const char *m40llm_version_string(void);

/* ---- Status ------------------------------------------------------------------------------ */

typedef enum m40llm_status {
  M40LLM_OK = 0,
  M40LLM_ERR_INVALID_ARGUMENT = -1, /* NULL pointer, non-positive size, inconsistent shape */
  M40LLM_ERR_OUT_OF_RANGE = -2,     /* layer, sequence, position or device index outside bounds */
  M40LLM_ERR_CAPACITY = -3,         /* an append would pass max_seq_len; nothing fits a plan */
  M40LLM_ERR_OUT_OF_MEMORY = -4,    /* host or device allocation failed */
  M40LLM_ERR_NO_DEVICE = -5,        /* CUDA requested but no usable GPU, or built without CUDA */
  M40LLM_ERR_CUDA = -6,             /* the CUDA runtime reported an error; see the message */
  M40LLM_ERR_UNSUPPORTED = -7,      /* valid request this build or backend cannot serve */
  M40LLM_ERR_CONTEXT_LOST = -8      /* the context's GPU had a device fault: see Device faults */
} m40llm_status;

/** Name and meaning of a status code ("unknown status" for others). Static storage. */
const char *m40llm_status_string(int status);

/** Detail of the last failure on this thread, or "" if none. Valid until the next failure on
 *  this thread. */
const char *m40llm_last_error_message(void);

/* ---- Backends and devices ------------------------------------------------------------------ */

typedef enum m40llm_backend {
  M40LLM_BACKEND_AUTO = 0, /* CUDA when a usable GPU exists, else CPU */
  M40LLM_BACKEND_CUDA = 1,
  M40LLM_BACKEND_CPU = 2
} m40llm_backend;

/** 1 if this library was built with the CUDA backend, else 0. */
int m40llm_built_with_cuda(void);

/** Number of usable CUDA devices; 0 when built without CUDA or when no driver/GPU is present
 *  (that is not an error). */
int m40llm_cuda_device_count(int *out_count);

/* What this library was built with (it logs nothing itself: the caller may check or log it).
 * An architecture is 10 x major + minor of a compute capability (52 for the M40, 90 for H100). */
#define M40LLM_BUILD_INFO_VERSION 1
typedef struct m40llm_build_info {
  unsigned version;               /* set by the caller: M40LLM_BUILD_INFO_VERSION */
  int cuda;                       /* 1 with the CUDA backend (as m40llm_built_with_cuda), else 0 */
  const char *cuda_architectures; /* the GPU code built in, in CMake's CUDA_ARCHITECTURES form,
                                     sorted: "NN-real" is sm_NN SASS (machine code, run by GPUs
                                     of NN's major version from NN up), "NN-virtual" compute_NN
                                     PTX (which the driver JIT-compiles for a GPU of NN or newer
                                     that has no SASS here), e.g. "52-real;52-virtual;90-real";
                                     "" without CUDA. Static storage. */
  int cuda_toolkit_version;       /* the CUDA toolkit built with, as CUDART_VERSION: 1000 x major
                                     + 10 x minor (11080 for 11.8); 0 without CUDA */
  int tensor_cores;               /* 1 if the tensor-core attention kernels are built in (CMake
                                     option M40LLM_TENSOR_CORES, on by default, and an
                                     architecture of 80 or newer in the list); whether a GPU runs
                                     them is m40llm_device_info.tensor_cores */
} m40llm_build_info;
#define M40LLM_BUILD_INFO_INIT { M40LLM_BUILD_INFO_VERSION, 0, NULL, 0, 0 }
/** Describes the build. out->version must be set (use the INIT macro). Needs no context or GPU. */
int m40llm_build_info_get(m40llm_build_info *out);

/* ---- Context ------------------------------------------------------------------------------- */

/** A backend plus, for CUDA, one device and one stream. Owns the scratch memory of attention. */
typedef struct m40llm_context m40llm_context;

/* Version 2 added check_pointers; version-1 structs are still taken (the library reads only the
 * fields of the version a struct says it is). */
#define M40LLM_CONTEXT_OPTIONS_VERSION 2
typedef struct m40llm_context_options {
  unsigned version;   /* M40LLM_CONTEXT_OPTIONS_VERSION (or 1) */
  int backend;        /* m40llm_backend */
  int device;         /* CUDA device ordinal, 0..count-1 where the context uses CUDA (else
                         M40LLM_ERR_OUT_OF_RANGE); ignored where it uses the CPU: backend CPU,
                         or AUTO on a machine without a usable GPU */
  void *cuda_stream;  /* a cudaStream_t the caller owns and keeps alive for the context's life,
                         or NULL for a stream the context creates (synchronizing with the legacy
                         default stream) */
  int check_pointers; /* version 2: 1 (the default) checks on the CUDA backend that the q, out,
                         K/V and read pointers of each call are memory the GPU can address, and
                         refuses others with M40LLM_ERR_INVALID_ARGUMENT before they fault and
                         lose the context; 0 skips the check (it costs about 0.4 us for a call
                         whose pointers are not among the last 8 that passed) */
} m40llm_context_options;
#define M40LLM_CONTEXT_OPTIONS_INIT \
  { M40LLM_CONTEXT_OPTIONS_VERSION, M40LLM_BACKEND_AUTO, 0, NULL, 1 }
/** Fills *opts with the defaults of the given version (1 or 2). */
int m40llm_context_options_init(m40llm_context_options *opts, unsigned version);

/** Creates a context. opts may be NULL for the defaults. The caller owns *out and frees it with
 *  m40llm_context_destroy after destroying every cache made from it. */
int m40llm_context_create(m40llm_context **out, const m40llm_context_options *opts);
/** Waits for the context's stream, destroys its stream (if it created one) and scratch memory.
 *  NULL is a no-op. */
void m40llm_context_destroy(m40llm_context *ctx);
/** Blocks until all work enqueued on the context is done; reports errors raised by that work. */
int m40llm_context_synchronize(m40llm_context *ctx);
/** The context's cudaStream_t (NULL for the CPU backend), for ordering the caller's own work. */
void *m40llm_context_cuda_stream(const m40llm_context *ctx);

/* Version 2 added kernel_arch, native_code and tensor_cores; version-1 structs are still taken
 * (the library writes only the fields of the version a struct says it is). */
#define M40LLM_DEVICE_INFO_VERSION 2
typedef struct m40llm_device_info {
  unsigned version;        /* set by the caller: M40LLM_DEVICE_INFO_VERSION (or 1) */
  int backend;             /* M40LLM_BACKEND_CUDA or M40LLM_BACKEND_CPU, never AUTO */
  int device;              /* CUDA ordinal, -1 for the CPU backend */
  char name[256];          /* GPU name, or "CPU" */
  int compute_major;       /* compute capability; 0 for the CPU backend */
  int compute_minor;
  int multiprocessors;     /* SM count; 0 for the CPU backend */
  size_t total_memory;     /* bytes of device memory; 0 for the CPU backend */
  size_t free_memory;      /* bytes free at the time of the call; 0 for the CPU backend */
  /* Version 2: the code the library runs on this GPU (all 0 for the CPU backend). */
  int kernel_arch;         /* the architecture its kernels were compiled for (see
                              m40llm_build_info): the SASS the GPU runs (e.g. 80 on an sm_86 GPU)
                              or the PTX the driver JIT-compiled (e.g. 52 on an sm_90 GPU) */
  int native_code;         /* 1 if the GPU runs SASS built in for it (an "NN-real" of its major
                              version, at most its own); 0 if the driver JIT-compiled PTX
                              (once per process, or from its disk cache) */
  int tensor_cores;        /* 1 if F16 caches with head_dim 32..128, a multiple of 16, or 192
                              or 256, and quantized and tiered caches with head_dim 32, 64, 96,
                              128, 192 or 256 run the tensor-core attention kernels here
                              (sm_80+ code on an sm_80+
                              GPU; calls that export weights or importance, causal calls over a
                              tiered cache, and causal rows whose sliding window leaves out most
                              of their sequence run FP32 kernels); 0 if every cache runs the FP32
                              kernels */
} m40llm_device_info;
#define M40LLM_DEVICE_INFO_INIT \
  { M40LLM_DEVICE_INFO_VERSION, 0, 0, {0}, 0, 0, 0, 0, 0, 0, 0, 0 }
/** Describes the context's backend and device. out->version must be set (use the INIT macro).
 *  Version 2's fields make the CUDA backend load its kernels for the device (the JIT compile,
 *  where it runs PTX), which a version-1 call does not. */
int m40llm_context_device_info(m40llm_device_info *out, const m40llm_context *ctx);

/* ---- Graphs (CUDA backend): a decode step captured once, launched as one ---------------- */

/** An executable CUDA graph of calls made on one context (see Graphs above for which calls can
 *  be captured and what a captured call bakes in). It borrows the context: destroy it before
 *  the context. Calls on it follow the context's threading rule. */
typedef struct m40llm_graph m40llm_graph;

/** Starts capturing the work the calling thread queues on ctx's stream into a graph (a
 *  thread-local capture: an uncapturable CUDA call made by this thread during it invalidates
 *  it, e.g. m40llm_context_synchronize, m40llm_malloc). Make each call once before capturing it
 *  (the warm-up rule above). The CPU backend fails with M40LLM_ERR_UNSUPPORTED; a stream that is
 *  already being captured with M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_graph_capture_begin(m40llm_context *ctx);

/** Ends the capture begun on ctx and puts the captured calls into *graph: a new graph where
 *  *graph is NULL, else *graph itself, updated in place (cudaGraphExecUpdate: the same kernel
 *  launches with new parameters, e.g. the next decode step's lengths and positions; far cheaper
 *  than instantiating) or, where the launches differ (a sequence grew into needing the combine
 *  kernel, a call more or less), instantiated anew; the handle stays the same. out_updated may
 *  be NULL; else it gets 1 for an update in place, 0 for an instantiation. Graphs already
 *  queued by m40llm_graph_launch run as they were launched. graph NULL ends the capture and
 *  discards it (after a library call failed during it: see Graphs above). On failure *graph is
 *  unchanged and the capture is over (discarded), except where *graph is from another context,
 *  which leaves it running; a capture that an uncapturable CUDA call invalidated fails with
 *  M40LLM_ERR_CUDA. No capture in progress: M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_graph_capture_end(m40llm_graph **graph, m40llm_context *ctx, int *out_updated);

/** Queues the graph on its context's stream (stream-ordered like any call; returns at once).
 *  It repeats the captured calls exactly: the same positions written, the same lengths read. */
int m40llm_graph_launch(m40llm_graph *graph);

/** Releases the graph (launches already queued still run). NULL is a no-op. */
void m40llm_graph_destroy(m40llm_graph *graph);

/* ---- Backend memory ------------------------------------------------------------------------ */

/** Allocates bytes (> 0) of backend memory, aligned to at least 256 bytes. */
int m40llm_malloc(void **out_ptr, m40llm_context *ctx, size_t bytes);
/** Frees memory from m40llm_malloc on the same context (waits for the stream first). NULL is a
 *  no-op. */
int m40llm_free(m40llm_context *ctx, void *ptr);
/** Host -> backend memory; returns once the copy is done. */
int m40llm_memcpy_to_device(m40llm_context *ctx, void *dst, const void *src_host, size_t bytes);
/** Backend memory -> host; waits for earlier work on the stream, returns once the copy is done. */
int m40llm_memcpy_to_host(m40llm_context *ctx, void *dst_host, const void *src, size_t bytes);
/** Backend memory -> backend memory, stream-ordered. */
int m40llm_memcpy_device(m40llm_context *ctx, void *dst, const void *src, size_t bytes);
/** Sets bytes of backend memory to (unsigned char)value, stream-ordered. */
int m40llm_memset(m40llm_context *ctx, void *dst, int value, size_t bytes);

/* ---- Element types of the caller's rows -------------------------------------------------- */

/* The element type of the q, out and K/V rows a caller passes to the calls ending in _ex. The
 * arithmetic is FP32 (float64 on the CPU backend) whatever the type: 16-bit inputs are widened
 * exactly, and outputs are rounded once, to nearest even (a NaN stays a NaN).
 * Any other value fails with M40LLM_ERR_INVALID_ARGUMENT. */
typedef enum m40llm_dtype {
  M40LLM_DTYPE_F32 = 0,  /* IEEE binary32 */
  M40LLM_DTYPE_F16 = 1,  /* IEEE binary16 bit patterns */
  M40LLM_DTYPE_BF16 = 2  /* bfloat16 bit patterns: the high 16 bits of a binary32 */
} m40llm_dtype;

/* ---- KV cache ------------------------------------------------------------------------------ */

/** K and V for n_layers x max_seqs sequences of up to max_seq_len positions each.
 *  Storage layout (per K and per V): [layer][seq][kv_head][pos][dim], 64-bit offsets.
 *  Lengths are kept per (layer, sequence): each layer's append advances only that layer. */
typedef struct m40llm_kvcache m40llm_kvcache;

typedef enum m40llm_kv_format {
  M40LLM_KV_SAME = -1, /* v_format only: the same as format */
  M40LLM_KV_F16 = 0,   /* IEEE binary16, round-to-nearest-even from FP32 (16 bits a value) */
  /* Quantized per group of 32 consecutive dims of one token's K/V head (head_dim a multiple of
   * 32), from the FP32 (or FP16) values appended, rounded once (to nearest even):
   *   Q8: codes c = round(x / d) in -127..127, d = fp16(max|x| / 127): x ~ c d (8.5 bits a value)
   *   Q4: codes c = round((x - m) / d) in 0..15, d = fp16((max - min) / 15), m = fp16(min):
   *       x ~ c d + m (5 bits a value)
   *   Q3: codes c = round((x - m) / d) in 0..7, d = fp16((max - min) / 7), m = fp16(min):
   *       x ~ c d + m (4 bits a value)
   *   Q2: codes c = round((x - m) / d) in 0..3, d = fp16((max - min) / 3), m = fp16(min):
   *       x ~ c d + m (3 bits a value)
   * A group whose scale d is 0 stores codes 0. Q3 and Q2 are V formats only: opts->format (K)
   * naming one fails with M40LLM_ERR_INVALID_ARGUMENT: K is the sensitive half (on a real
   * model, bench/fidelity/results/buckets.md: all-Q3 is twice K Q4 with V Q2's error at the
   * same bytes, KL 1.7e-2 against 8.6e-3, and 2-bit K is unusable, KL 0.15 at best); set
   * format to K's and v_format to Q3/Q2.
   * Storage of one row, per group of 32 dims (byte b, bit i; element e of the group):
   *   Q8: 32 bytes, byte e = c + 128; Q4: 16 bytes, e in bits 4(e % 2).. of byte e / 2;
   *   Q2: 8 bytes, e in bits 2(e % 4).. of byte e / 4;
   *   Q3: 12 bytes, the low 2 bits of c as Q2's 8 bytes, then c's bit 2 in bit e % 8 of byte
   *       8 + e / 8 (8 consecutive codes: 2 bytes and 1 byte, each naturally aligned);
   * the parameters in their own plane, (d) or (d, m) as FP16 per group.
   * The CUDA backend has kernels for F16, Q8 and Q4 each with itself, Q8 K with Q4 V, and Q4 K
   * with Q3 or Q2 V; creating a cache of another pair there fails with M40LLM_ERR_UNSUPPORTED
   * (the CPU backend takes any pair). */
  M40LLM_KV_Q8 = 1,
  M40LLM_KV_Q4 = 2,
  M40LLM_KV_Q3 = 3,
  M40LLM_KV_Q2 = 4
} m40llm_kv_format;

/* How K and V are rotated before they are quantized (m40llm_kvcache_options.rotation). The
 * rotation is the normalized Walsh-Hadamard transform over blocks of b dims (b = the largest
 * power of two dividing head_dim, at most 256: the whole head at 32, 64, 128, 256): it is
 * orthogonal and its own inverse, so q.k and the attention output are unchanged, while outlier
 * channels are spread over the block before the per-32-dim quantizer sees them. Appended K
 * (and V) rows are rotated in FP32 before they are quantized; attention rotates q and, for a
 * rotated V, rotates the output back; read_f16 returns rows rotated back. A tensor stored F16
 * is never rotated. */
typedef enum m40llm_kv_rotation {
  M40LLM_ROTATE_AUTO = 0, /* the library's choice: today every quantized tensor (as KV) */
  M40LLM_ROTATE_NONE = 1,
  M40LLM_ROTATE_K = 2,    /* K where it is quantized */
  M40LLM_ROTATE_KV = 3    /* K and V, each where it is quantized */
} m40llm_kv_rotation;

/* A tier of a tiered cache (m40llm_kvcache_options.tiers, version 4): a (K, V) pair of
 * quantized formats and how many rows it holds per (layer, sequence), every K/V head of a row
 * together. */
#define M40LLM_MAX_TIERS 4
typedef struct m40llm_kv_tier {
  int k_format; /* M40LLM_KV_Q8 or M40LLM_KV_Q4 */
  int v_format; /* M40LLM_KV_Q8, _Q4, _Q3 or _Q2 */
  int rows;     /* >= 0 */
} m40llm_kv_tier;

/* Where a tiered cache puts a row that leaves the window (m40llm_kvcache_options.placement,
 * version 5). */
typedef enum m40llm_tier_placement {
  /* The first tier with a free row: the oldest rows hold the first tiers' formats. */
  M40LLM_PLACE_FIRST_FREE = 0,
  /* By importance (issue 15's policy, measured in bench/fidelity/results/buckets.md): the cache
   * keeps each row's importance, the attention weights its observe calls (its own, every
   * m40llm_kvcache_options.observe_interval-th plain call, and m40llm_kvcache_attn_observe_ex) gave
   * it (the largest over the query heads, summed over the calls), divided by the number of those
   * calls that saw it (ZipCache's normalized score; a row no call saw scores 0). A row leaving the
   * window goes to the first tier that has a free row or whose least important row is less
   * important than it (its importance times 1 + m40llm_kvcache_options.demote_margin, 0 by default,
   * is below the leaving row's); that row moves one tier down (re-quantized from its values, as
   * m40llm_kvcache_tier_move does), and so on down to a tier with a free row. Rows only ever move
   * down, one tier at a time, and only to make room: a row whose importance rises later keeps its
   * tier. Rows appended past the window, never observed, take the first free tier. Tiers of 0 rows
   * are passed over. A row of an equal score does not displace another; of equal scores the earlier
   * position is the less important. The decisions are the host's, from what the GPU ranks: each
   * observe call finds, on the GPU, every tier's 8 least important rows of each sequence it saw and
   * the scores of its window's rows, and copies them to the host behind the stream; the layer's
   * next append waits for that copy (a step later, so normally done). Where an append could need
   * more of a tier's order than that (a tier that is or may become full whose ranking holds fewer
   * rows than leave, or whose order a tier_move, a truncate, a fork or a row appended past the
   * window made unknown), the append first copies the sequence's sums back (a wait for the stream)
   * and ranks on the host. The cascades of a decode step's append (a leaving row a sequence) run in
   * one launch; an append of several leaving rows a sequence takes a launch for each. Measured on
   * an H200 (bench/RESULTS.md, "Placement by importance" and after): a decode step of 8 layers x 8
   * sequences x 8K with observe calls every 4th step took 1.15-1.18x (M40 code) and 1.31-1.33x
   * (sm_90) the default placement's time. */
  M40LLM_PLACE_IMPORTANCE = 1
} m40llm_tier_placement;

/* Version 2 added v_format; version 3 rotation, n_sinks and window; version 4 the tiers;
 * version 5 placement; version 6 observe_interval; version 7 demote_margin.
 * Callers built against an older version keep working, and keep the behaviour of their version:
 * the library reads and writes only the fields of the version a struct says it is, and a
 * version-1 or -2 struct means no rotation and no protected tokens. */
#define M40LLM_KVCACHE_OPTIONS_VERSION 7
typedef struct m40llm_kvcache_options {
  unsigned version; /* M40LLM_KVCACHE_OPTIONS_VERSION (or 1 to 6) */
  int n_layers;     /* >= 1 */
  int n_heads;      /* query heads, >= 1, a multiple of n_kv_heads */
  int n_kv_heads;   /* >= 1; n_heads / n_kv_heads query heads share one K/V head (GQA/MQA) */
  int head_dim;     /* 1..256; the CUDA backend needs a multiple of 8, Q8..Q2 of 32 */
  int max_seqs;     /* sequence slots, >= 1 */
  int max_seq_len;  /* positions per sequence, >= 1 */
  int format;       /* m40llm_kv_format of K, and of V unless v_format names another; any other
                       value: M40LLM_ERR_UNSUPPORTED */
  int v_format;     /* version 2: V's m40llm_kv_format, or M40LLM_KV_SAME (the default) */
  int rotation;     /* version 3: m40llm_kv_rotation (default AUTO) */
  /* Version 3, protected tokens: where K or V is quantized, the first n_sinks positions of a
   * sequence (attention sinks) and its most recent `window` positions (the newest one
   * included) are also kept in FP16, and attention and read_f16 use those FP16 values (rotated
   * as the tensor is), so the first tokens, which draw much of the attention, and the
   * recent ones, which the next token leans on most, stay exact (bench/fidelity measures it on
   * a real model). Defaults: 4 sinks, a window of 128. Every position is quantized when appended; a
   * position leaves the window when `window` newer ones are appended, and its FP16 copy is then
   * gone: after seq_truncate, the positions that had left the window stay quantized until
   * appends refill it. 0 turns either off. Both are capped at max_seq_len; the FP16 copies take
   * (n_sinks + window) x head_dim x 2 bytes per layer, sequence, K/V head and quantized tensor
   * (counted by m40llm_kvcache_bytes_needed). An all-F16 cache ignores them. */
  int n_sinks;
  int window;
  /* Version 4, tiers (mixed precision; the seed of issue 15): with n_tiers (0..M40LLM_MAX_TIERS)
   * above 0, the quantized rows of a (layer, sequence) are not stored at their positions in
   * one format but in tiers[0 .. n_tiers): each tier holds up to tiers[t].rows rows (all K/V
   * heads of a position) in its own (K, V) formats, in slots of no particular order, with a
   * map from slots to positions. format and v_format must name tiers[0]'s formats (the
   * cache's first tier). A position gets its tier when it leaves the window (or when it is
   * appended, where it never enters it): the first tier with a free row, quantized from its
   * FP16 copy in the window (or from the appended values), rotated as the cache's rotation
   * says for quantized tensors; m40llm_kvcache_tier_move moves rows between tiers. So the
   * tiers must hold every row that can leave the window: the sum of tiers[t].rows at least
   * max_seq_len - n_sinks - window (as capped), else M40LLM_ERR_INVALID_ARGUMENT. Sinks and the
   * window stay FP16, as in any quantized cache. Bytes (m40llm_kvcache_bytes_needed): the FP16
   * slots, each tier's rows, and each tier's slot -> position map (4 bytes a tier row); the
   * other maps are host memory, 4 bytes per tier row and per position for every (layer,
   * sequence). Both backends run tiered caches. On CUDA decode attention runs the uniform
   * caches' kernels a launch per tier (on sm_80+ the tensor-core kernels, at the head_dims they
   * have), side by side, and merges them, with exported weights and importance as for a
   * uniform cache (on sm_80+ from the tensor-core kernels' instances that write scores); causal attention runs each query row as a decode row
   * that sees the positions up to its own (FP32 kernels; see m40llm_kvcache_attn_causal_f32q),
   * and with a sliding window (m40llm_causal_options.window) fails with
   * M40LLM_ERR_UNSUPPORTED in this version (nothing written). A CUDA graph captures a call's row writes
   * as the host's maps stood: as with lengths, capture each step anew. */
  int n_tiers;
  m40llm_kv_tier tiers[M40LLM_MAX_TIERS];
  /* Version 5: m40llm_tier_placement (default M40LLM_PLACE_FIRST_FREE, what version 4 does).
   * M40LLM_PLACE_IMPORTANCE needs tiers (n_tiers > 0), on CUDA at most 4096 query heads
   * (M40LLM_ERR_UNSUPPORTED), and holds, besides the tiers, 8 bytes
   * of backend memory a position for every (layer, sequence) (the importance sums and their
   * counts), 16 bytes a sequence (the ranking's counters) and 408 + 8 x window bytes for
   * every (layer, sequence) (the observe calls' rankings), counted
   * by m40llm_kvcache_bytes_needed; on the host 8 bytes a position and 138 bytes for every
   * (layer, sequence), 8 x max_seq_len bytes and a byte a layer, and on CUDA the rankings
   * again, in pinned memory.
   * Other values: M40LLM_ERR_INVALID_ARGUMENT. */
  int placement;
  /* Version 6: >= 0 (else M40LLM_ERR_INVALID_ARGUMENT, whatever the placement); used by
   * M40LLM_PLACE_IMPORTANCE: a plain decode attention call (m40llm_kvcache_attn_batch_f32q and
   * _ex, m40llm_kvcache_attn_last_token_f32q, m40llm_kvcache_append_attn_f32q and _ex) is made
   * as m40llm_kvcache_attn_observe_ex makes it where it is due, so a decode loop of plain calls
   * feeds the placement by itself. Each (layer, sequence) counts the plain calls that name it
   * (once a call) since the last observe call that did; a call is due where one of its
   * sequences has been named observe_interval - 1 times, and an observe call, the caller's or
   * the cache's own, starts the count again for every sequence it names: every
   * observe_interval-th call of a batched loop observes, and so does every sequence's own
   * observe_interval-th call in a loop of calls a sequence. Default 4 (bench/fidelity measured
   * every 4th step against every 16th: 0.71 against 0.97 of the uniform formats' KL at 2K
   * tokens and 6 bits; at 8K every 16th did as well); 0: only the caller's
   * m40llm_kvcache_attn_observe_ex calls observe (what versions up to 5 do). The weights and
   * importance exports and causal calls neither count nor observe; a call that fails counts
   * nothing. A due call that cannot observe is made as a plain call and stays due for its
   * sequences' next call: one that names a sequence twice, or one made while the context's
   * stream is being captured into a CUDA graph (an observe call cannot be captured; see
   * m40llm_kvcache_attn_observe_ex), so a decode step captured whole never observes.
   * m40llm_kvcache_seq_reset, _seq_truncate and _seq_fork leave the counts as they are (a
   * forked sequence keeps its own). A call that observes is an observe call in all else: its
   * output comes from the kernels that export weights (on sm_80+ the tensor-core kernels, as
   * the plain call's, else the FP32 kernels; the two agree within 1e-5), it
   * grows the context's scratch of the scores as an observe call does (append_attn before it
   * appends), failing with M40LLM_ERR_OUT_OF_MEMORY where that fails, and it costs what one
   * costs (see M40LLM_PLACE_IMPORTANCE). */
  int observe_interval;
  /* Version 7: the hysteresis of M40LLM_PLACE_IMPORTANCE, finite and >= 0 (else
   * M40LLM_ERR_INVALID_ARGUMENT, whatever the placement). A row leaving the window takes a
   * tier's place from that tier's least important row only where its importance is more than
   * (1 + demote_margin) times that row's (computed in double); else it goes on to the next
   * tier, as past a tier whose rows all matter more. Default 0: more important at all (what
   * versions up to 6 do). A margin keeps rows whose scores are close from displacing each
   * other (each displacement re-quantizes a row into the next tier's formats, a row op in the
   * append's launch), and leans the placement toward age (the first free tier) as it grows. It
   * never spares a row no observe call saw (importance 0). Rows only move down, so no row can
   * flap between tiers: the margin is the whole of the hysteresis (no count of updates).
   * bench/fidelity/README.md measures it ("Hysteresis"). */
  float demote_margin;
} m40llm_kvcache_options;
#define M40LLM_KVCACHE_OPTIONS_INIT                                                     \
  { M40LLM_KVCACHE_OPTIONS_VERSION, 0, 0, 0, 0, 0, 0, M40LLM_KV_F16, M40LLM_KV_SAME, \
    M40LLM_ROTATE_AUTO, 4, 128, 0, { { 0, 0, 0 } }, M40LLM_PLACE_FIRST_FREE, 4, 0.0f }
/** Fills *opts with the defaults of the given version, 1 to 7 (all sizes zero, FP16; version 3:
 *  rotation AUTO, 4 sinks, a window of 128; version 4: no tiers; version 5: placement
 *  M40LLM_PLACE_FIRST_FREE; version 6: observe_interval 4; version 7: demote_margin 0). */
int m40llm_kvcache_options_init(m40llm_kvcache_options *opts, unsigned version);

/** Bytes of backend memory a cache with these options holds (K plus V), without allocating.
 *  Options whose size overflows size_t fail with M40LLM_ERR_OUT_OF_MEMORY (as does
 *  m40llm_kvcache_create, and m40llm_malloc for any size it cannot allocate); an unknown format
 *  fails with M40LLM_ERR_UNSUPPORTED. On failure *out_bytes is left unchanged. */
int m40llm_kvcache_bytes_needed(size_t *out_bytes, const m40llm_kvcache_options *opts);

/** Allocates a cache on ctx's backend, every sequence empty. The cache borrows ctx: destroy it
 *  before ctx. Contents are not initialised; only positions below a sequence's length are read. */
int m40llm_kvcache_create(m40llm_kvcache **out, m40llm_context *ctx,
                          const m40llm_kvcache_options *opts);
/** Frees the cache (after the stream finishes with it). NULL is a no-op. */
void m40llm_kvcache_destroy(m40llm_kvcache *cache);
/** The options the cache was created with. out->version must be set. */
int m40llm_kvcache_get_options(m40llm_kvcache_options *out, const m40llm_kvcache *cache);

/** Number of positions stored for (layer, seq). */
int m40llm_kvcache_seq_len(int *out_len, const m40llm_kvcache *cache, int layer, int seq);
/** Empties seq in every layer. */
int m40llm_kvcache_seq_reset(m40llm_kvcache *cache, int seq);
/** Keeps the first new_len positions of seq in every layer (layers already shorter keep their
 *  length). new_len >= 0; a negative new_len fails with M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_kvcache_seq_truncate(m40llm_kvcache *cache, int seq, int new_len);
/** Makes dst_seq a copy of src_seq in every layer (contents and lengths); dst's old contents are
 *  dropped. dst_seq != src_seq. */
int m40llm_kvcache_seq_fork(m40llm_kvcache *cache, int dst_seq, int src_seq);

/** Appends n_tokens (>= 1) positions to (layer, seq). k and v are [n_tokens][n_kv_heads][head_dim]
 *  FP32 in backend memory, stored in the cache's K and V formats on the backend (rounded once).
 *  Fails with M40LLM_ERR_CAPACITY, writing nothing, if the length would pass max_seq_len. */
int m40llm_kvcache_append_f32(m40llm_kvcache *cache, int layer, int seq, const float *k,
                              const float *v, int n_tokens);
/** As m40llm_kvcache_append_f32 with k and v already FP16 (binary16 bit patterns); an F16 cache
 *  stores them unchanged: NaN payloads, infinities and subnormals included. The quantized
 *  formats quantize their FP32 values. */
int m40llm_kvcache_append_f16(m40llm_kvcache *cache, int layer, int seq, const uint16_t *k,
                              const uint16_t *v, int n_tokens);
/** Appends to n_seqs (>= 1) sequences of one layer in one call: a decode step's new K/V for a
 *  whole batch, or a ragged prefill. seq_ids and n_tokens are host arrays of n_seqs entries:
 *  sequence seq_ids[i] gets n_tokens[i] (>= 0; 0 leaves it as it is) new positions; n_tokens
 *  NULL means one token each. k and v are [total][n_kv_heads][head_dim] FP32 in backend memory,
 *  total the sum of the counts: seq_ids[0]'s rows first, then seq_ids[1]'s, and so on (NULL
 *  only where the total is 0: a batch of no tokens checks its ids and writes nothing). A batch
 *  names each sequence once (a repeated id fails with M40LLM_ERR_INVALID_ARGUMENT), so n_seqs
 *  <= max_seqs. Every id, count and length is checked before anything is written: one sequence
 *  that would pass max_seq_len fails the whole call with M40LLM_ERR_CAPACITY, and no sequence
 *  changes (nor on any other error). Each sequence then holds exactly what
 *  m40llm_kvcache_append_f32 of its rows would store, bit for bit. The library reads seq_ids
 *  and n_tokens once, into the cache's own copy (no allocation). On the CUDA backend it is one
 *  kernel launch for every 128 sequences with tokens. */
int m40llm_kvcache_append_batch_f32(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                    const int32_t *n_tokens, int n_seqs, const float *k,
                                    const float *v);
/** As m40llm_kvcache_append_batch_f32 with FP16 rows (stored as m40llm_kvcache_append_f16
 *  stores them). */
int m40llm_kvcache_append_batch_f16(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                    const int32_t *n_tokens, int n_seqs, const uint16_t *k,
                                    const uint16_t *v);
/** As m40llm_kvcache_append_batch_f32 with k and v of element type dtype (m40llm_dtype): F32
 *  and F16 rows are stored as the _f32 and _f16 calls store them; BF16 rows are widened to FP32
 *  (exactly) and stored as FP32 rows are. */
int m40llm_kvcache_append_batch_ex(m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                   const int32_t *n_tokens, int n_seqs, const void *k,
                                   const void *v, int dtype);
/** Copies positions [pos, pos + n_tokens) of (layer, seq) out as FP16 into k_out and v_out
 *  (quantized formats: what attention reads: the dequantized values, or a protected position's FP16
 *  copy, rotated back where the tensor is rotated, rounded to FP16),
 *  [n_tokens][n_kv_heads][head_dim] in backend memory. Either output may be NULL to skip it; both
 *  NULL, or n_tokens < 1, fails with M40LLM_ERR_INVALID_ARGUMENT. A range outside
 *  [0, seq_len) fails with M40LLM_ERR_OUT_OF_RANGE. */
int m40llm_kvcache_read_f16(uint16_t *k_out, uint16_t *v_out, const m40llm_kvcache *cache,
                            int layer, int seq, int pos, int n_tokens);

/* ---- Tiers (a cache with opts.n_tiers > 0) ------------------------------------------------- */

/** Moves the quantized rows of (layer, seq) whose positions are in [begin, end) into tier
 *  `tier` (0 .. n_tiers - 1), each re-quantized in the tier's formats from the values it holds
 *  now (in the rotated frame it is stored in); rows already there stay as they are, and
 *  positions still in FP16 slots (sinks, window) are not moved (they get a tier when they
 *  leave the window). 0 <= begin <= end <= the length, else M40LLM_ERR_OUT_OF_RANGE. If the
 *  tier has too few free rows for all of them, fails with M40LLM_ERR_CAPACITY and moves none.
 *  A cache without tiers: M40LLM_ERR_INVALID_ARGUMENT. For tests, and for callers with a
 *  policy of their own (e.g. from m40llm_kvcache_attn_importance_ex's importance). */
int m40llm_kvcache_tier_move(m40llm_kvcache *cache, int layer, int seq, int begin, int end,
                             int tier);
/** Rows each tier holds for (layer, seq): out_rows[t] for t < n_tiers (host memory, n_tiers
 *  entries). A cache without tiers: M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_kvcache_tier_rows(int32_t *out_rows, const m40llm_kvcache *cache, int layer, int seq);
/** The tier of position pos of (layer, seq): 0 .. n_tiers - 1, or -1 for a position read from
 *  its FP16 slot (a sink, or in the window). pos outside [0, length): M40LLM_ERR_OUT_OF_RANGE.
 *  A cache without tiers: M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_kvcache_tier_of(int *out_tier, const m40llm_kvcache *cache, int layer, int seq,
                           int pos);

/** What a tiered cache holds, over all its layers and sequences (m40llm_kvcache_tier_stats).
 *  A row is one position of one (layer, sequence): its K and V, all K/V heads. */
#define M40LLM_TIER_STATS_VERSION 3
typedef struct m40llm_tier_stats {
  unsigned version;                      /* set by the caller: M40LLM_TIER_STATS_VERSION (or 1, 2) */
  int n_tiers;                           /* the cache's */
  int64_t rows[M40LLM_MAX_TIERS];        /* rows each tier holds */
  int64_t free_rows[M40LLM_MAX_TIERS];   /* rows each tier has room for still */
  int64_t kept_rows;                     /* positions read from FP16 slots (sinks, windows) */
  /* stored bits per K/V value over every position held: each tier's codes and parameters and
   * its 4-byte slot map entry a row (the backend's copy: 32 / (2 x n_kv_heads x head_dim) bits
   * a value), 16 for a kept row (its FP16 slot); 0 while the cache holds no position */
  double bits_per_value;
  int64_t moved_rows; /* rows m40llm_kvcache_tier_move has moved since the cache was created */
  /* Version 2: rows M40LLM_PLACE_IMPORTANCE has moved a tier down to make room, since the
   * cache was created. */
  int64_t demoted_rows;
  /* Version 3: observe calls made since the cache was created, a layer's call counting once:
   * the caller's m40llm_kvcache_attn_observe_ex calls and the cache's own
   * (m40llm_kvcache_options.observe_interval). */
  int64_t observe_calls;
} m40llm_tier_stats;
#define M40LLM_TIER_STATS_INIT { M40LLM_TIER_STATS_VERSION, 0, { 0 }, { 0 }, 0, 0.0, 0, 0, 0 }
/** Fills *out (its version, 1 to 3, set by the caller, e.g. from M40LLM_TIER_STATS_INIT) with
 *  what the cache holds now: host bookkeeping only, no backend work and no synchronization. An
 *  unknown version: M40LLM_ERR_INVALID_ARGUMENT. A cache without tiers:
 *  M40LLM_ERR_INVALID_ARGUMENT. */
int m40llm_kvcache_tier_stats(m40llm_tier_stats *out, const m40llm_kvcache *cache);

/* ---- Capacity planning ----------------------------------------------------------------------- */

/** The largest max_seq_len (1..INT_MAX) whose cache, with the other fields of opts, fits in
 *  budget_bytes: a cache of *out_max_seq_len positions a sequence needs at most budget_bytes,
 *  and one of a position more needs more (unless the answer is INT_MAX).
 *  Bytes are those m40llm_kvcache_bytes_needed counts (the call asks it): K and V, every plane
 *  of each (codes, and a quantized format's scales and minimums), for max_seqs sequences of
 *  n_layers layers. Not counted: the attention workspace a cache's creation reserves on the
 *  CUDA backend, the allocator's rounding of each plane, the model's weights and activations.
 *  opts->max_seq_len is ignored (it is the answer); the other fields are checked as
 *  bytes_needed checks them with max_seq_len 1, and options it refuses fail with its status
 *  and message. Tiered options (n_tiers > 0) fail with M40LLM_ERR_INVALID_ARGUMENT: their
 *  rows are given per tier. When not even one position fits, fails with M40LLM_ERR_CAPACITY. On failure
 *  *out_max_seq_len is left unchanged. Host-only: needs no context. */
int m40llm_kvcache_max_seq_len(int *out_max_seq_len, const m40llm_kvcache_options *opts,
                               size_t budget_bytes);

/** Memory to leave free on the device beyond a cache's K/V planes for the library's own use:
 *  the attention workspace m40llm_kvcache_create reserves (split partials; a few MiB for
 *  common shapes), the driver's rounding of each plane's allocation, and kernel code CUDA may
 *  load at first use. A suggestion for reserve_bytes below, to which a caller adds what it
 *  will allocate itself (weights, activations). 256 MiB. */
#define M40LLM_DEVICE_RESERVE_DEFAULT (256u << 20)

/** As m40llm_kvcache_max_seq_len, with the budget ctx's device has free at the time of the call
 *  (m40llm_device_info.free_memory) less reserve_bytes (see M40LLM_DEVICE_RESERVE_DEFAULT), and
 *  opts checked against ctx's backend as m40llm_kvcache_create checks them (the CUDA backend's
 *  head_dim rule: M40LLM_ERR_UNSUPPORTED). A cache of the answer can then be created unless
 *  other allocations take the memory first. Free memory not above reserve_bytes, or too little
 *  for one position: M40LLM_ERR_CAPACITY. The CPU backend has no device memory to plan against:
 *  M40LLM_ERR_UNSUPPORTED (pass a budget to m40llm_kvcache_max_seq_len). On failure
 *  *out_max_seq_len is left unchanged. */
int m40llm_kvcache_max_seq_len_on_device(int *out_max_seq_len, m40llm_context *ctx,
                                         const m40llm_kvcache_options *opts,
                                         size_t reserve_bytes);

/** Sets the rows of a tiered cache's tiers (opts->tiers[t].rows for t < opts->n_tiers; their
 *  formats and every other field as opts gives them) so that the cache stores at most
 *  bits_per_value bits a K/V value, every byte of the stored K/V counted: its size as
 *  m40llm_kvcache_bytes_needed gives it with placement M40LLM_PLACE_FIRST_FREE (the tiers'
 *  codes, parameters and slot maps, the FP16 sinks and window), x 8, is at most
 *  bits_per_value x 2 x n_layers x max_seqs x max_seq_len x n_kv_heads x head_dim, and a full
 *  cache's m40llm_tier_stats.bits_per_value is at most bits_per_value. What
 *  M40LLM_PLACE_IMPORTANCE keeps besides (its sums and rankings, which bytes_needed counts)
 *  comes on top, as the formats' bits leave it out.
 *  The tiers get exactly the rows that can leave the window (max_seq_len - n_sinks - window,
 *  as capped), so every position has a place and no tier row goes unused:
 *  - where the dearest tier holds them all within the target, it does and the others get 0;
 *  - else the two tiers adjacent in cost (bytes a row) whose costs bracket the target share
 *    them, the dearer taking as many as fit, and the others get 0. The error of these formats
 *    falls convexly with their bits (bench/fidelity/results/buckets.md), so a mix of the two
 *    nearest costs errs less than one spanning more at the same bytes; with
 *    M40LLM_PLACE_IMPORTANCE the dearer tier holds the rows attention uses most.
 *  A target below every row in the cheapest tier: M40LLM_ERR_CAPACITY, with the least it can
 *  be in the message. opts->n_tiers outside 1..M40LLM_MAX_TIERS (an options version below 4
 *  has none), or bits_per_value not positive and finite: M40LLM_ERR_INVALID_ARGUMENT. Options
 *  bytes_needed refuses fail with its status and message. On failure opts is left unchanged.
 *  Host-only: needs no context. Measured on a real model (bench/fidelity/README.md, "Tiers
 *  planned for a target"). */
int m40llm_kvcache_plan_tiers(m40llm_kvcache_options *opts, double bits_per_value);

/* ---- Decode attention ------------------------------------------------------------------------ */

/** Attention of one new query token against every cached position of (layer, seq):
 *  out[h] = softmax(scale * q[h] . K[g]^T) V[g] with g = h / (n_heads / n_kv_heads).
 *  q and out are [n_heads][head_dim] FP32 in backend memory and must not overlap (overlapping
 *  buffers fail with M40LLM_ERR_INVALID_ARGUMENT). scale 0 means 1/sqrt(head_dim); any other
 *  finite scale, negative ones included, is used as given; a NaN or infinite scale fails with
 *  M40LLM_ERR_INVALID_ARGUMENT. A sequence with no positions yields zeros.
 *  Masking: K may hold infinities (append_f16 stores any half; append_f32 rounds |x| >= 65520 to
 *  inf). A position whose score is -inf (e.g. K -inf in a dim where q > 0, the rest finite) has
 *  weight 0 wherever it falls, on every backend and kernel; a head whose every score is -inf
 *  yields zeros. Its V is still multiplied by that 0, so it must be finite. A score of +inf or
 *  NaN (NaN in K, 0 x inf, infinities of both signs) makes the head's output NaN. The CUDA backend
 *  accumulates in FP32. Its arithmetic is FP32 too (Q8/Q4 codes are exact in FP32), except for
 *  F16 caches with head_dim 32, 48, 64, 80, 96, 112, 128, 192 or 256, and quantized and tiered
 *  caches with head_dim 32, 64, 96, 128, 192 or 256, on sm_80+ GPUs, when the library was built
 *  with an sm_80+ architecture:
 *  there, tensor cores multiply FP16 K/V (or the codes, as exact FP16 integers, with the scales
 *  applied in FP32) by q and by the softmax weights, each passed as two FP16 terms (hi + lo, 22
 *  significant bits; scaled by powers of two so that neither is an FP16 subnormal), with the
 *  products exact and the sums in FP32 (an MMA's sum keeps about 24 bits of its largest term).
 *  Both paths agree with the reference to about 1e-6 (relative L2), and within 1e-5 on peaked
 *  rows (a few heavy weights, thousands of light ones) and on logits up to about 2^27. The CPU
 *  backend (the reference) accumulates in float64 and rounds the result to FP32. */
int m40llm_kvcache_attn_last_token_f32q(float *out, m40llm_kvcache *cache, int layer, int seq,
                                        const float *q, float scale);

/** The same for n_seqs (>= 1) sequences at once, one launch over their ragged lengths.
 *  seq_ids is a host array of n_seqs sequence indices (repeats allowed); q and out are
 *  [n_seqs][n_heads][head_dim] FP32 in backend memory, row i belonging to seq_ids[i]; the whole
 *  of q and the whole of out must not overlap. The library reads seq_ids once, into its own
 *  copy, before it writes anything: seq_ids may share memory with out (e.g. host memory on the
 *  CPU backend, managed memory on CUDA), and row i still belongs to the id passed. A copy of
 *  more than 64 ids is allocated on the host (M40LLM_ERR_OUT_OF_MEMORY if that fails). Scale and
 *  errors as for the single call. */
int m40llm_kvcache_attn_batch_f32q(float *out, m40llm_kvcache *cache, int layer,
                                   const int32_t *seq_ids, int n_seqs, const float *q,
                                   float scale);
/** As m40llm_kvcache_attn_batch_f32q with q and out of element type dtype (m40llm_dtype), so
 *  that an FP16 or BF16 model passes its activations as they are. On the CUDA backend a 16-bit
 *  q is widened into FP32 rows of the context's own staging buffer by a small kernel, the FP32
 *  attention runs on them, and a second small kernel rounds its output into out (on every GPU;
 *  the M40 converts with integer and FP32 operations), so the output is the FP32 call's,
 *  rounded once; the staging buffer (8 bytes per element of q) is allocated at the first such
 *  call and grown by a larger one (not during a graph capture: see Graphs). With an F32 dtype
 *  it is m40llm_kvcache_attn_batch_f32q.
 *  Overlap of q and out is checked over their bytes in that type. */
int m40llm_kvcache_attn_batch_ex(void *out, m40llm_kvcache *cache, int layer,
                                 const int32_t *seq_ids, int n_seqs, const void *q, int dtype,
                                 float scale);

/** As m40llm_kvcache_attn_batch_ex, and also the attention weights the output is made of:
 *  weights[(i * n_heads + h) * weights_stride + p] = the softmax weight that query head h of
 *  row i gives position p of sequence seq_ids[i] (this layer's), for p below that sequence's
 *  length; the entries from its length to weights_stride are not written. weights is FP32 in
 *  backend memory: n_seqs x n_heads rows of weights_stride floats, weights_stride at least
 *  the longest length of the batch (else M40LLM_ERR_INVALID_ARGUMENT); it must not overlap q
 *  or out. A head's weights sum to 1 (to FP32 rounding), and its output is the sum of its
 *  weights times V; a head whose every score is -inf (or an empty sequence) has weights 0 and
 *  output zeros. All checks come first: on any error nothing is written.
 *  For policies that keep, evict or re-quantize tokens by the attention they draw (H2O,
 *  SnapKV; ZipCache's normalized score: each position's weights accumulated over the steps
 *  and divided by the number of queries that saw it; the largest over a K/V head's query
 *  heads for that K/V row). Cost on top of the call: 4 bytes a position and query head
 *  written by the attention kernel (its scores), then read and written once more by a small
 *  kernel that turns them into weights when the call's softmax sums are known. The CUDA
 *  backend runs instances of their own for it (the plain calls' kernels are unchanged): on
 *  sm_80+ the tensor-core kernels' where the plain call has them, else the FP32 kernels'.
 *  Measured against the plain call: on an H100, the M40's code path 1.1-1.4x at head_dim 128
 *  and 256, 1.7x on calls of a few us (bench/RESULTS.md, "Attention weights"); on an H200, the
 *  sm_90 build 1.2-1.7x for F16 and 1.3-1.5x for Q4 with its defaults (bench/RESULTS.md,
 *  "Observe calls on tensor cores"). */
int m40llm_kvcache_attn_weights_ex(void *out, float *weights, size_t weights_stride,
                                   m40llm_kvcache *cache, int layer, const int32_t *seq_ids,
                                   int n_seqs, const void *q, int dtype, float scale);

/** As m40llm_kvcache_attn_batch_ex, and also each K/V row's importance, accumulated: for row i,
 *  K/V head g and each position p below seq_ids[i]'s length,
 *    importance[(i * n_kv_heads + g) * importance_stride + p] =
 *        decay * (its value before the call) + (the largest weight a query head of g gives p),
 *  the weights of m40llm_kvcache_attn_weights_ex. The entries from the length to
 *  importance_stride are not read or written: zero a buffer once, and after
 *  m40llm_kvcache_seq_truncate zero what lies past the new length, so that positions appended
 *  later start from 0. decay in [0, 1]: 1 sums the weights over the calls (divide by the number
 *  of calls that saw a position for ZipCache's normalized score), below 1 the older calls count
 *  less, 0 keeps the last call's. importance is FP32 in backend memory, n_seqs x n_kv_heads
 *  rows of importance_stride floats, importance_stride at least the longest length of the
 *  batch; it must not overlap q or out. It is the signal a keep, evict or re-quantize policy
 *  reads per token (one float a position and K/V head, n_heads / n_kv_heads times less than
 *  the weights). Errors as for m40llm_kvcache_attn_weights_ex, and a decay outside [0, 1] (or
 *  NaN) fails with M40LLM_ERR_INVALID_ARGUMENT; on any error nothing is written. The CUDA
 *  backend computes the weights as m40llm_kvcache_attn_weights_ex does, into a scratch buffer
 *  of the context's own (4 bytes a query head, row and position of the longest sequence, up to
 *  128 rows; allocated by the first call and grown by a larger one, not during a graph
 *  capture: see Graphs), then a small kernel reduces them into importance. Measured against
 *  the plain call: on an H100, the M40's code path 1.1-1.25x at head_dim 128 and 256 (1.4x on
 *  calls of a few us; bench/RESULTS.md, "Importance"); on an H200, the sm_90 build 1.2-1.8x
 *  for F16 and 1.3-1.5x for Q4 with its defaults ("Observe calls on tensor cores"). */
int m40llm_kvcache_attn_importance_ex(void *out, float *importance, size_t importance_stride,
                                      float decay, m40llm_kvcache *cache, int layer,
                                      const int32_t *seq_ids, int n_seqs, const void *q,
                                      int dtype, float scale);

/** As m40llm_kvcache_attn_batch_ex, and also adds the call's attention weights to the cache's
 *  own importance of each row (the largest weight a query head of the layer gives the position,
 *  one sum a position of each (layer, sequence)), and counts one call for every position below
 *  each sequence's length: what M40LLM_PLACE_IMPORTANCE places rows by. The cache's options
 *  must say M40LLM_PLACE_IMPORTANCE (else M40LLM_ERR_INVALID_ARGUMENT); seq_ids must name each
 *  sequence once (M40LLM_ERR_INVALID_ARGUMENT). Errors as for m40llm_kvcache_attn_batch_ex; on
 *  an error of the arguments nothing is written and nothing counted (a device fault once the
 *  call's kernels are queued may leave some sums counted: the cache then copies them back
 *  before it places a row by them). The CUDA backend takes at most 4096 query heads for
 *  M40LLM_PLACE_IMPORTANCE (M40LLM_ERR_UNSUPPORTED at create). The cache makes its own
 *  observe calls: a plain call observes where one of its sequences is due, on its every
 *  m40llm_kvcache_options.observe_interval-th plain call (4 by default); call this one where
 *  the caller chooses the steps (with observe_interval 0), or for a call the count would not
 *  make; it starts the count again for the sequences it names.
 *  The weights are m40llm_kvcache_attn_importance_ex's (decay 0); a small kernel adds each
 *  position's largest over the query heads to its sum and counts the call, another ranks each
 *  sequence's tiers (M40LLM_PLACE_IMPORTANCE), whose result is copied to pinned host memory
 *  without a wait (bench/RESULTS.md, "Placement by importance"). On CUDA
 *  the call cannot be captured in a graph (M40LLM_ERR_UNSUPPORTED before anything is queued:
 *  the host reads the ranking after the copy): capture the plain call, and make the observe
 *  calls outside graphs. The next append of a sequence the call saw waits for that copy (one
 *  wait a layer), and an append that takes rows out of the window may copy a sequence's sums
 *  back (a wait for the stream) where a tier's ranking is not known (see
 *  M40LLM_PLACE_IMPORTANCE): do not capture the appends of such a cache. */
int m40llm_kvcache_attn_observe_ex(void *out, m40llm_kvcache *cache, int layer,
                                   const int32_t *seq_ids, int n_seqs, const void *q, int dtype,
                                   float scale);

/** A decode step of one layer in one call: appends one token to each of n_seqs (>= 1)
 *  sequences, then attends each sequence's q row over all its positions, the new one included.
 *  The same as m40llm_kvcache_append_batch_f32(cache, layer, seq_ids, NULL, n_seqs, k, v)
 *  followed by m40llm_kvcache_attn_batch_f32q(out, cache, layer, seq_ids, n_seqs, q, scale),
 *  with the same results bit for bit, and the checks of both made before anything is written:
 *  seq_ids names each sequence once; k and v are [n_seqs][n_kv_heads][head_dim], q and out
 *  [n_seqs][n_heads][head_dim] (q and out must not overlap; out may overlap k or v, which are
 *  read first); seq_ids may share memory with out (it is read once, first). No allocation (but
 *  an observe call's scratch where the call observes: observe_interval). On
 *  the CUDA backend, for an F16 cache (K and V) whose head_dim is a multiple of 16 and an out
 *  that overlaps neither k nor v, it is the attention's launches alone: the blocks that read a
 *  sequence's last position write its new row first (a launch fewer than the two calls). Else
 *  it is the append's launch followed by the attention's on the context's stream (with sm_90
 *  code on an sm_90 GPU, the attention is launched as a programmatic dependent of the append,
 *  its launch overlapping the append's end). q and out are checked, and a 16-bit call's
 *  staging buffer readied, before anything is written: a failure of the backend's attention
 *  after the append's launch (a device fault) is what leaves the tokens appended; a failed
 *  call of one launch leaves the lengths as they were. */
int m40llm_kvcache_append_attn_f32q(float *out, m40llm_kvcache *cache, int layer,
                                    const int32_t *seq_ids, int n_seqs, const float *k,
                                    const float *v, const float *q, float scale);
/** As m40llm_kvcache_append_attn_f32q with k, v, q and out all of element type dtype
 *  (m40llm_dtype): the append of m40llm_kvcache_append_batch_ex, then the attention of
 *  m40llm_kvcache_attn_batch_ex. */
int m40llm_kvcache_append_attn_ex(void *out, m40llm_kvcache *cache, int layer,
                                  const int32_t *seq_ids, int n_seqs, const void *k,
                                  const void *v, const void *q, int dtype, float scale);

/* ---- Causal attention over the cache: prefill, speculative verification ---------------- */

/* Options of m40llm_kvcache_attn_causal_f32q. Later versions may add fields (initialise with
 * M40LLM_CAUSAL_OPTIONS_INIT or m40llm_causal_options_init). */
#define M40LLM_CAUSAL_OPTIONS_VERSION 1
typedef struct m40llm_causal_options {
  unsigned version; /* M40LLM_CAUSAL_OPTIONS_VERSION */
  float scale;      /* as the decode call's: 0 means 1/sqrt(head_dim); NaN or infinite fails */
  int window;       /* sliding window: 0 (the default) off; W >= 1: a query row at position p
                       sees positions max(0, p - W + 1) .. p only (Mistral-style local
                       attention, the row's own position included); negative fails */
} m40llm_causal_options;
#define M40LLM_CAUSAL_OPTIONS_INIT { M40LLM_CAUSAL_OPTIONS_VERSION, 0.0f, 0 }
/** Fills *opts with the defaults of the given version (1). */
int m40llm_causal_options_init(m40llm_causal_options *opts, unsigned version);

/** Causal attention of several new query rows per sequence over the cache, for n_seqs (>= 1)
 *  sequences of one layer in one call: a prompt's prefill (ragged prompt batches included) or
 *  the verification of speculative draft tokens. The new tokens' K/V must already be appended
 *  (e.g. by m40llm_kvcache_append_batch_f32 with the same ids and counts): sequence seq_ids[s]
 *  of cached length L (this layer's) with T = q_counts[s] rows has them at positions
 *  L - T .. L - 1, and its query row i (0 <= i < T) attends over positions 0 .. L - T + i
 *  (with opts->window W >= 1, only the last W of them), each query head h over K/V head
 *  h / (n_heads / n_kv_heads) as in the decode call. A row with T = 1 and no window is
 *  m40llm_kvcache_attn_batch_f32q's row for that sequence, bit for bit on the CPU backend.
 *  seq_ids and q_counts are host arrays of n_seqs entries; q_counts NULL means one row each.
 *  Each count is 1 .. L (fails with M40LLM_ERR_INVALID_ARGUMENT otherwise); each sequence is
 *  named once (a repeat fails with M40LLM_ERR_INVALID_ARGUMENT), so n_seqs <= max_seqs.
 *  q and out are [rows][n_heads][head_dim] FP32 in backend memory, rows the sum of the counts:
 *  seq_ids[0]'s T rows first (row i at index i), then seq_ids[1]'s, and so on; the whole of q
 *  and the whole of out must not overlap. opts may be NULL for the defaults. K/V are read as
 *  the cache holds them at the time of the call: a quantized cache's protected positions (its
 *  sinks and the newest `window` positions of m40llm_kvcache_options) from their FP16 copies,
 *  the others dequantized, for every row alike. Arithmetic, masking rules (-inf scores, V
 *  finite), accuracy and the CPU backend's float64 as for the decode call. The CUDA backend
 *  runs the decode call's kernels where m40llm_device_info.tensor_cores says they run on tensor
 *  cores (sm_80+; the cache's formats and head_dim as there): the query rows of a sequence are
 *  packed into the kernel's tiles with its query heads (a tile: 8 (row, head) pairs of one K/V
 *  head), so that a tile's rows share each read of the K/V; rows 1 .. 64 of a sequence in one
 *  item (more: in items of 64), one launch per run of sequences with the same count (a ragged
 *  batch: a launch per change of count), rows of T = 1 without a window as the decode call's.
 *  They read every position before a sequence's last row, a window masking those a row does
 *  not see, so a sequence whose windows leave out more than three quarters of its positions
 *  takes the FP32 causal kernel, which reads only what its rows see; so does every sequence
 *  on GPUs before sm_80 (the M40's path) and at head_dims without tensor-core kernels. On a
 *  tiered cache
 *  (m40llm_kvcache_options.n_tiers) the CUDA backend runs each query row as a decode row of its
 *  sequence, masking the tier rows past it by their positions: it reads the tiers once per
 *  row (fine for verification's few rows, T times a decode call's reads for T rows), and it
 *  refuses a window (opts->window >= 1) with M40LLM_ERR_UNSUPPORTED. The library reads seq_ids
 *  and q_counts once, into the cache's own copy, before it writes anything (they may share
 *  memory with out), and checks everything first: on any error nothing is written. No
 *  allocation. Threading and ordering as for every call on the cache (stream-ordered on CUDA). */
int m40llm_kvcache_attn_causal_f32q(float *out, m40llm_kvcache *cache, int layer,
                                    const int32_t *seq_ids, const int32_t *q_counts,
                                    int n_seqs, const float *q,
                                    const m40llm_causal_options *opts);
/** As m40llm_kvcache_attn_causal_f32q with q and out of element type dtype (m40llm_dtype),
 *  converted as m40llm_kvcache_attn_batch_ex converts them. */
int m40llm_kvcache_attn_causal_ex(void *out, m40llm_kvcache *cache, int layer,
                                  const int32_t *seq_ids, const int32_t *q_counts, int n_seqs,
                                  const void *q, int dtype, const m40llm_causal_options *opts);

#ifdef __cplusplus
}
#endif

#endif /* M40LLM_H */
