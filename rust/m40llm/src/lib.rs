//! Safe Rust API for **m40llm**: a GPU-resident FP16 KV cache and decode-time attention for LLM
//! inference, tuned for the Tesla M40 (sm_52) and running on any newer NVIDIA GPU (through PTX)
//! or on the CPU backend.
//!
//! * [`Context`]: a backend (CUDA device + stream, or CPU). A cheap, clonable handle; caches
//!   and buffers keep one.
//! * [`DeviceBuffer`]: a typed allocation in the context's memory (`f32`, `f16`, `u16`), with
//!   host copies, device copies, memset and sub-[`slice`](DeviceBuffer::slice)s.
//! * [`KvCache`]: K/V for `layers x sequences`, shaped by a [`KvCacheConfig`]; append (FP32 or
//!   FP16, one or many tokens, with the token count checked exactly by
//!   [`append_tokens`](KvCache::append_tokens)/[`append_token`](KvCache::append_token); many
//!   sequences in one call with [`append_batch`](KvCache::append_batch)/
//!   [`append_token_batch`](KvCache::append_token_batch)), attention for one or many sequences
//!   (a decode step's append and attention in one call:
//!   [`append_attention_batch`](KvCache::append_attention_batch)), and sequence operations
//!   (length, reset, truncate, fork, read back).
//! * [`Graph`] (CUDA backend): a decode step's calls captured into a CUDA graph, launched as one,
//!   and re-captured for the next step (updated in place where the kernels are the same).
//! * With the `cudarc` feature, `cudarc_interop`: a context on a cudarc stream and cudarc
//!   memory as K, V, q and out.
//! * With the `candle` feature, `candle_interop`: a context for a candle `Device` and cache
//!   calls on candle `Tensor`s (CUDA tensors with `candle-cuda`, without host copies).
//!
//! Every fallible call returns [`Result`]; an [`Error`] carries the library's [`Status`] and its
//! detail message. Buffer lengths and indices are checked in Rust before the C library is
//! called, so a wrong-sized buffer is an error, never a GPU fault.
//!
//! # Example (runs on the CPU backend; use [`Backend::Auto`] or [`Backend::Cuda`] for the GPU)
//! ```
//! use m40llm::{Backend, Context, DeviceBuffer, KvCache, KvCacheConfig};
//!
//! let ctx = Context::new(Backend::Cpu)?;
//! let cfg = KvCacheConfig::new(2, 4, 8).kv_heads(2).max_seqs(3).max_seq_len(64);
//! let mut kv = KvCache::new(&ctx, &cfg)?;
//!
//! // One decode step for sequences 0 and 2, in layer 0: one token of K/V each, in one call
//! // (row i of k and v for the i-th id).
//! let k = DeviceBuffer::from_slice(&ctx, &vec![0.25f32; 2 * cfg.kv_row_len()])?;
//! let v = DeviceBuffer::from_slice(&ctx, &vec![2.0f32; 2 * cfg.kv_row_len()])?;
//! kv.append_token_batch(0, &[0, 2], &k, &v)?;
//! let q = DeviceBuffer::from_slice(&ctx, &vec![1.0f32; 2 * cfg.q_row_len()])?;
//! let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * cfg.q_row_len())?;
//! kv.attention_batch(0, &[0, 2], &q, &mut out, None)?;
//! assert!(out.to_vec()?.iter().all(|&x| x == 2.0));
//! # Ok::<(), m40llm::Error>(())
//! ```
//!
//! # K/V formats, rotation and protected tokens
//! [`KvCacheConfig::format`] (and [`v_format`](KvCacheConfig::v_format) for V apart) picks
//! how K and V are stored: [`KvFormat::F16`] (16 bits a value), [`KvFormat::Q8`] (8.5),
//! [`KvFormat::Q4`] (5), and for V only [`KvFormat::Q3`] (4) and [`KvFormat::Q2`] (3; on the
//! CUDA backend with K in Q4), the quantized ones per 32 dims of a token's head. Two
//! options make a quantized cache more accurate:
//!
//! * [`KvRotation`] ([`KvCacheConfig::rotation`]): quantized rows are rotated by a normalized
//!   Walsh-Hadamard transform before they are quantized, spreading outlier channels over the
//!   block; attention and reads rotate back, so results keep their meaning. No memory.
//! * Protected tokens ([`KvCacheConfig::sinks`], [`KvCacheConfig::window`]): the first
//!   `n_sinks` positions of each sequence and its most recent `window` are also kept in FP16,
//!   and attention reads those. They cost `(n_sinks + window) × head_dim × 2` bytes per layer,
//!   sequence, K/V head and quantized tensor. A backend without kernels for them refuses them
//!   at creation with [`Status::Unsupported`].
//!
//! Unset, both take the C library's defaults (`m40llm_kvcache_options_init`), read at run
//! time; [`KvCache::config`] says what a cache was created with.
//!
//! ```
//! use m40llm::{Context, KvCache, KvCacheConfig, KvFormat, KvRotation, Status};
//!
//! let ctx = Context::cpu()?;
//! let cfg = KvCacheConfig::new(2, 8, 64)
//!     .kv_heads(2)
//!     .max_seq_len(1024)
//!     .format(KvFormat::Q8) // K in 8 bits
//!     .v_format(KvFormat::Q4) // V in 4
//!     .rotation(KvRotation::KV)
//!     .sinks(4)
//!     .window(128);
//! // Where the backend has no kernels for protected tokens, do without them.
//! let kv = match KvCache::new(&ctx, &cfg) {
//!     Err(e) if e.status() == Status::Unsupported => {
//!         KvCache::new(&ctx, &cfg.sinks(0).window(0))?
//!     }
//!     created => created?,
//! };
//! assert_eq!(kv.config().rotation, KvRotation::KV);
//! # Ok::<(), m40llm::Error>(())
//! ```
//!
//! # Ownership and threads
//! A [`Context`] is a handle to a reference-counted context (like cudarc's `Arc<CudaContext>`):
//! cloning it is cheap and gives another handle to the same context. [`KvCache`] and
//! [`DeviceBuffer`] keep a handle, so they have no lifetime parameter and the context is
//! destroyed only after the last of them, in whatever order they are dropped. A model can own
//! its context, caches and buffers in one plain struct, move it to a worker thread, or hold it
//! across `.await` in a multi-threaded async runtime:
//!
//! ```
//! use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
//!
//! struct Model {
//!     ctx: Context,
//!     kv: KvCache,
//!     q: DeviceBuffer<f32>,
//!     out: DeviceBuffer<f32>,
//! }
//!
//! let ctx = Context::cpu()?;
//! let cfg = KvCacheConfig::new(1, 2, 8).max_seq_len(16);
//! let model = Model {
//!     kv: KvCache::new(&ctx, &cfg)?,
//!     q: DeviceBuffer::from_slice(&ctx, &[1.0f32; 16])?,
//!     out: DeviceBuffer::zeros(&ctx, 16)?,
//!     ctx,
//! };
//! let worker = std::thread::spawn(move || -> m40llm::Result<Vec<f32>> {
//!     let mut m = model;
//!     let kv_row = DeviceBuffer::from_slice(&m.ctx, &[0.5f32; 16])?;
//!     m.kv.append_token(0, 0, &kv_row, &kv_row)?;
//!     m.kv.attention(0, 0, &m.q, &mut m.out, None)?;
//!     m.out.to_vec()
//! });
//! assert_eq!(worker.join().unwrap()?, [0.5; 16]);
//! # Ok::<(), m40llm::Error>(())
//! ```
//!
//! The C library's rule is that calls on one context and on the caches made from it must not
//! run concurrently (distinct contexts are independent). This crate enforces it with a lock:
//! all handles to one context share a mutex, and every library call, whether made through the
//! context, a cache, a buffer or a view, holds it for that call. So:
//!
//! | Type | `Send` | `Sync` | Why |
//! |---|---|---|---|
//! | [`Context`] | yes | yes | A handle to an `Arc`; every call takes the context's lock. |
//! | [`KvCache`], [`DeviceBuffer`] | yes | yes | Own their handle and a [`Context`]; every call takes the lock; changes need `&mut self` (share a cache that others append to as `Mutex<KvCache>`). |
//! | [`DeviceSlice`], [`DeviceSliceMut`] | yes | yes | Borrowed views, like `&[T]` and `&mut [T]`. |
//! | `CudarcView`, `CudarcViewMut` (feature `cudarc`) | no | no | Short-lived views that record cudarc's events on drop. |
//! | [`Error`], [`Status`], [`KvCacheConfig`], [`KvFormat`], [`KvRotation`], [`DeviceInfo`], [`BuildInfo`], [`Backend`] | yes | yes | Plain data. |
//!
//! Threads that share one context take turns call by call (on the GPU each call only queues
//! work, so the lock is held briefly); for parallel work use one context per thread. The lock
//! costs an uncontended mutex per call, next to calls that take microseconds. Raw
//! `m40llm_sys` calls should be made inside [`Context::with_raw`], which holds the lock.
//!
//! ## Why the borrowing API was replaced
//! Earlier versions had `KvCache<'ctx>` and `DeviceBuffer<'ctx, T>` borrowing `&Context`, with
//! `Context: Send + !Sync` so that the compiler kept everything on one thread. That made the
//! common application shapes impossible: a struct owning its context and its caches is
//! self-referential, and nothing could move to a worker thread or be held across `.await`.
//! Handles make both work, still prevent use-after-free (the caches keep the context alive)
//! and turn the threading rule into a lock instead of a type-level restriction. Keeping both
//! forms would have doubled every type for no safety gain, so the borrowing form is gone;
//! `KvCache::new(&ctx, ..)` and `DeviceBuffer::from_slice(&ctx, ..)` keep their signatures and
//! clone the handle. Views ([`DeviceSlice`], [`DeviceSliceMut`]) still borrow what they view.
//!
//! ## What does not compile
//! Mutation still needs exclusive access; sharing a cache between threads does not let them
//! append without a lock of their own:
//! ```compile_fail,E0596
//! use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
//! let ctx = Context::cpu().unwrap();
//! let cfg = KvCacheConfig::new(1, 1, 8);
//! let kv = std::sync::Arc::new(KvCache::new(&ctx, &cfg).unwrap());
//! let k = DeviceBuffer::from_slice(&ctx, &[0.0f32; 8]).unwrap();
//! kv.append_token(0, 0, &k, &k).unwrap(); // needs &mut KvCache: use Arc<Mutex<KvCache>>
//! ```
//! q and out of one attention call cannot be the same buffer:
//! ```compile_fail,E0502
//! use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
//! let ctx = Context::cpu().unwrap();
//! let kv = KvCache::new(&ctx, &KvCacheConfig::new(1, 1, 8)).unwrap();
//! let mut buf = DeviceBuffer::<f32>::zeros(&ctx, 8).unwrap();
//! kv.attention(0, 0, &buf, &mut buf, None).unwrap(); // `buf` borrowed mutably while shared
//! ```
//! A view cannot outlive its buffer (the buffer frees its memory on drop):
//! ```compile_fail,E0597
//! use m40llm::{Context, DeviceBuffer};
//! let ctx = Context::cpu().unwrap();
//! let view = {
//!     let buf = DeviceBuffer::<f32>::zeros(&ctx, 8).unwrap();
//!     buf.slice(2..4) // borrows `buf`, which is dropped here
//! };
//! view.to_vec().unwrap();
//! ```
//! A borrowed view cannot be sent to a thread that may outlive the buffer (move the buffer,
//! or use a scoped thread):
//! ```compile_fail,E0597
//! use m40llm::{Context, DeviceBuffer};
//! let ctx = Context::cpu().unwrap();
//! let buf = DeviceBuffer::<f32>::zeros(&ctx, 8).unwrap();
//! let view = buf.slice(..);
//! std::thread::spawn(move || view.to_vec().unwrap()); // `buf` does not live for 'static
//! ```
//! A cache moved to another thread is no longer usable here:
//! ```compile_fail,E0382
//! use m40llm::{Context, KvCache, KvCacheConfig};
//! let ctx = Context::cpu().unwrap();
//! let kv = KvCache::new(&ctx, &KvCacheConfig::new(1, 1, 8)).unwrap();
//! let t = std::thread::spawn(move || kv.seq_len(0, 0).unwrap());
//! kv.seq_len(0, 0).unwrap(); // use after move
//! ```
//!
//! # Building, and which backend you got
//! `m40llm-sys` compiles the C/CUDA library. The CUDA backend is built when `nvcc` is found
//! (`NVCC`, `CUDA_PATH`, `/usr/local/cuda`, `PATH`), else a CPU-only library with a cargo
//! warning (which cargo shows only for path dependencies); the `cuda` feature makes a missing
//! toolkit an error. `M40LLM_CUDA_ARCHS`, or candle's `CUDA_COMPUTE_CAP`, picks the GPU
//! architectures (default `52,sm_80,sm_90`, each where the toolkit builds it: sm_52 SASS and
//! compute_52 PTX for the M40 and, through the driver's JIT, any newer GPU; native code with
//! the tensor-core path for Ampere and Hopper). The CUDA runtime is linked statically, so
//! binaries need only the NVIDIA driver.
//!
//! At run time, [`build_info`] says what the library carries, [`Context::backend`] which
//! backend a context got ([`Backend::Auto`] takes the CPU, quietly, where no GPU is usable; the
//! library logs nothing), and [`Context::device_info`] whether the GPU runs native code or
//! JIT-compiled PTX and whether it takes the tensor-core path. Ask for [`Backend::Cuda`] where
//! the GPU is required: it fails with the reason.
//!
//! Features: `cuda` (require the CUDA backend), `cudarc` (the `cudarc_interop` module; cudarc
//! is built with its driver API loaded at run time, so building needs no CUDA toolkit),
//! `candle` (the `candle_interop` module, CPU tensors; candle 0.11 needs Rust 1.89) and
//! `candle-cuda` (`candle` + `cudarc` + candle's CUDA backend, whose kernels need nvcc).

#![deny(missing_docs)]
#![warn(rust_2018_idioms)]

mod buffer;
mod build_info;
#[cfg(feature = "candle")]
pub mod candle_interop;
mod context;
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;
mod error;
mod graph;
mod kvcache;

pub use buffer::{
    DeviceBuffer, DeviceRead, DeviceSlice, DeviceSliceMut, DeviceWrite, Element, HalfElement,
    IoElement,
};
pub use build_info::{build_info, BuildInfo};
pub use context::{
    built_with_cuda, cuda_device_count, library_version, Backend, Context, ContextBuilder,
    DeviceInfo,
};
#[cfg(feature = "cudarc")]
pub use cudarc_interop::{CudarcView, CudarcViewMut};
pub use error::{Error, Result, Status};
pub use graph::Graph;
pub use half::{bf16, f16};
pub use kvcache::{
    KvCache, KvCacheConfig, KvFormat, KvInput, KvRotation, KvTier, TierPlacement, TierStats,
    MAX_TIERS,
};
/// The raw FFI bindings this crate wraps.
pub use m40llm_sys as sys;
