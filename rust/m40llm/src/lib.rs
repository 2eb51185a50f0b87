//! Safe Rust API for **m40llm**: a GPU-resident FP16 KV cache and decode-time attention for LLM
//! inference, tuned for the Tesla M40 (sm_52) and running on any newer NVIDIA GPU (through PTX)
//! or on the CPU backend.
//!
//! * [`Context`]: a backend (CUDA device + stream, or CPU). Everything else borrows it.
//! * [`DeviceBuffer`]: a typed allocation in the context's memory (`f32`, `f16`, `u16`), with
//!   host copies, device copies, memset and sub-[`slice`](DeviceBuffer::slice)s.
//! * [`KvCache`]: K/V for `layers x sequences`, shaped by a [`KvCacheConfig`]; append (FP32 or
//!   FP16, one or many tokens), attention for one or many sequences, and sequence operations
//!   (length, reset, truncate, fork, read back).
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
//! // One decode step for sequences 0 and 2, in layer 0.
//! let k = DeviceBuffer::from_slice(&ctx, &vec![0.25f32; cfg.kv_row_len()])?;
//! let v = DeviceBuffer::from_slice(&ctx, &vec![2.0f32; cfg.kv_row_len()])?;
//! for seq in [0, 2] {
//!     kv.append(0, seq, &k, &v)?;
//! }
//! let q = DeviceBuffer::from_slice(&ctx, &vec![1.0f32; 2 * cfg.q_row_len()])?;
//! let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * cfg.q_row_len())?;
//! kv.attention_batch(0, &[0, 2], &q, &mut out, None)?;
//! assert!(out.to_vec()?.iter().all(|&x| x == 2.0));
//! # Ok::<(), m40llm::Error>(())
//! ```
//!
//! # Threads
//! The C library's rule: calls on one context and on the caches made from it must not run
//! concurrently; distinct contexts are independent. The types encode it:
//!
//! | Type | `Send` | `Sync` | Why |
//! |---|---|---|---|
//! | [`Context`] | yes | no | Owning it means no one else can call into it, so it may move to another thread (the library selects its device on every call); sharing `&Context` would allow concurrent calls. |
//! | [`KvCache`], [`DeviceBuffer`], [`DeviceSlice`], [`DeviceSliceMut`] | no | no | Each holds a `&Context` (not `Send`, since `Context` is not `Sync`) and a raw handle used through that context, so it stays on the context's thread. |
//! | [`Error`], [`Status`], [`KvCacheConfig`], [`DeviceInfo`], [`Backend`] | yes | yes | Plain data. |
//!
//! Use one context per thread to work in parallel. The compiler enforces all of it:
//!
//! ```compile_fail
//! fn needs_sync<T: Sync>() {}
//! needs_sync::<m40llm::Context>(); // a context cannot be shared between threads
//! ```
//! ```compile_fail
//! fn needs_send<T: Send>() {}
//! needs_send::<m40llm::KvCache<'static>>(); // a cache stays on its context's thread
//! ```
//! ```compile_fail
//! fn needs_send<T: Send>() {}
//! needs_send::<m40llm::DeviceBuffer<'static, f32>>(); // so does a buffer
//! ```
//! ```compile_fail
//! use m40llm::{Context, KvCache, KvCacheConfig};
//! let kv = {
//!     let ctx = Context::cpu().unwrap();
//!     KvCache::new(&ctx, &KvCacheConfig::new(1, 1, 8)).unwrap() // cannot outlive `ctx`
//! };
//! ```
//!
//! # Building
//! `m40llm-sys` compiles the C/CUDA library. The CUDA backend is built when `nvcc` is found
//! (`NVCC`, `CUDA_PATH`, `/usr/local/cuda`, `PATH`), else a CPU-only library with a warning;
//! the `cuda` feature makes a missing toolkit an error. `M40LLM_CUDA_ARCHS` picks GPU
//! architectures (default `52`: sm_52 SASS + compute_52 PTX). The CUDA runtime is linked
//! statically, so binaries need only the NVIDIA driver.

#![deny(missing_docs)]
#![warn(rust_2018_idioms)]

mod buffer;
mod context;
mod error;
mod kvcache;

pub use buffer::{
    DeviceBuffer, DeviceRead, DeviceSlice, DeviceSliceMut, DeviceWrite, Element, HalfElement,
};
pub use context::{
    built_with_cuda, cuda_device_count, library_version, Backend, Context, ContextBuilder,
    DeviceInfo,
};
pub use error::{Error, Result, Status};
pub use half::f16;
pub use kvcache::{KvCache, KvCacheConfig, KvFormat, KvInput};
/// The raw FFI bindings this crate wraps.
pub use m40llm_sys as sys;
