//! Interop with [candle](https://docs.rs/candle-core) (feature `candle`; CUDA tensors with
//! `candle-cuda`): a [`Context`] for a candle [`Device`], and [`KvCache`] calls that take and
//! return candle [`Tensor`]s, without `unsafe` and, on CUDA, without host copies.
//!
//! 1. [`Context::from_candle_device`] gives the context for a device: the CPU backend for
//!    [`Device::Cpu`]; for a CUDA device a context on candle's own stream (through
//!    `Context::from_cudarc_stream`), so m40llm's work and candle's are ordered on one stream.
//!    candle's default CUDA device (`Device::new_cuda`) uses the per-thread stream, which a
//!    context that may move between threads cannot take: that one gets a new stream of
//!    candle's CUDA context, and each call orders the two streams with an event each way.
//! 2. The cache's `*_tensor` methods read K, V and q from tensors on the cache's device and
//!    return attention outputs as new tensors there, shaped like `q`:
//!    [`append_tensor`](KvCache::append_tensor) (`[tokens, n_kv_heads, head_dim]`),
//!    [`append_tensor_batch`](KvCache::append_tensor_batch) (explicit counts, any shape),
//!    [`attention_tensor`](KvCache::attention_tensor),
//!    [`attention_batch_tensor`](KvCache::attention_batch_tensor),
//!    [`attention_causal_tensor`](KvCache::attention_causal_tensor) and
//!    [`append_attention_batch_tensor`](KvCache::append_attention_batch_tensor).
//!
//! Tensors must be contiguous (a view with a start offset is fine: [`Layout::start_offset`] is
//! honoured) and on the cache's device; otherwise the call fails with
//! [`Status::InvalidArgument`] and writes nothing. dtypes: K/V and q `F32`, `F16` or `BF16`
//! (the output has q's dtype; the arithmetic is FP32 whatever they are); any other is
//! [`Status::Unsupported`]. Element counts are checked as
//! by the buffer methods. While a call runs it holds each input tensor's storage read lock,
//! so candle cannot write them meanwhile.
//!
//! CUDA tensors go through `CudarcView`s; where a tensor's stream is not
//! the context's, the context's stream waits for the tensor's before the call and the tensor's
//! for the context's after it. Outputs are allocated on the tensor's device stream. Without the
//! `candle-cuda` feature a CUDA tensor is an [`Status::Unsupported`] error. Don't write a tensor
//! from another thread while a call reads it: the call holds its storage's read lock (more than
//! once where k, v and q share storage), so such a writer waits, and may block the call.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use candle_core::{Device, Tensor};
//! use m40llm::{Context, KvCache, KvCacheConfig};
//!
//! let device = Device::Cpu; // or Device::new_cuda(0)? with the `candle-cuda` feature
//! let ctx = Context::from_candle_device(&device)?;
//! let cfg = KvCacheConfig::new(1, 8, 64).kv_heads(2).max_seq_len(128);
//! let mut kv = KvCache::new(&ctx, &cfg)?;
//!
//! // A 3-token prompt of layer 0, sequence 0, then a decode step's attention.
//! let k = Tensor::randn(0f32, 1., (3, 2, 64), &device)?;
//! let v = Tensor::ones((3, 2, 64), candle_core::DType::F32, &device)?;
//! assert_eq!(kv.append_tensor(0, 0, &k, &v)?, 3);
//! let q = Tensor::randn(0f32, 1., (8, 64), &device)?;
//! let out = kv.attention_tensor(0, 0, &q, None)?; // [8, 64] on `device`
//! assert_eq!(out.dims(), [8, 64]);
//! assert!(out.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| (x - 1.0).abs() < 1e-6));
//! # Ok(()) }
//! ```

use candle_core::{CpuStorage, DType, Device, Layout, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};

use crate::buffer::{DeviceSlice, DeviceSliceMut, Element, IoElement};
use crate::context::{Backend, Context};
use crate::error::{Error, Result, Status};
use crate::kvcache::{KvCache, KvInput};

impl Context {
    /// The context for a candle device: the CPU backend for [`Device::Cpu`], and for a CUDA
    /// device a CUDA context on that device's stream (see `Context::from_cudarc_stream`), or on
    /// a stream of its own for candle's per-thread stream (see the [module docs](self)).
    ///
    /// Fails with [`Status::Unsupported`] for Metal, and for CUDA when m40llm was built
    /// without its `candle-cuda` feature; CUDA failures as `Context::from_cudarc_stream`.
    pub fn from_candle_device(device: &Device) -> Result<Context> {
        match device {
            Device::Cpu => Context::cpu(),
            Device::Cuda(dev) => cuda::context(dev),
            Device::Metal(_) => Err(metal()),
        }
    }
}

/// Element types of tensors this module hands to the library: a candle dtype that is also a
/// buffer element (and, with CUDA, a cudarc device type).
pub(crate) trait TensorElement: Element + WithDType + cuda::CudaElement {}
impl TensorElement for f32 {}
impl TensorElement for f16 {}
impl TensorElement for bf16 {}

/// Which attention call, with its arguments other than q and out.
enum Attend<'a> {
    One {
        layer: usize,
        seq: usize,
        scale: Option<f32>,
    },
    Batch {
        layer: usize,
        seq_ids: &'a [usize],
        scale: Option<f32>,
    },
    Causal {
        layer: usize,
        seq_ids: &'a [usize],
        q_counts: &'a [usize],
        scale: Option<f32>,
        window: Option<usize>,
    },
}

impl Attend<'_> {
    fn run<T: IoElement>(
        &self,
        cache: &KvCache,
        q: &DeviceSlice<'_, T>,
        out: &mut DeviceSliceMut<'_, T>,
    ) -> Result<()> {
        match *self {
            Attend::One { layer, seq, scale } => cache.attention(layer, seq, q, out, scale),
            Attend::Batch {
                layer,
                seq_ids,
                scale,
            } => cache.attention_batch(layer, seq_ids, q, out, scale),
            Attend::Causal {
                layer,
                seq_ids,
                q_counts,
                scale,
                window,
            } => cache.attention_causal(layer, seq_ids, q_counts, q, out, scale, window),
        }
    }
}

/// Which append call, with its arguments other than K and V.
enum Append<'a> {
    Tokens {
        layer: usize,
        seq: usize,
        n_tokens: usize,
    },
    Batch {
        layer: usize,
        seq_ids: &'a [usize],
        n_tokens: &'a [usize],
    },
}

impl KvCache {
    /// Appends the tokens of `k` and `v` to `(layer, seq)`: tensors shaped
    /// `[tokens, n_kv_heads, head_dim]` (leading dimensions of size 1 allowed, e.g. a batch of
    /// one) or `[n_kv_heads, head_dim]` for one token, `F32`, `F16` or `BF16`, both the same. Returns
    /// the token count. Any other shape fails with [`Status::InvalidArgument`], a query-shaped
    /// `[n_heads, head_dim]` included (the GQA mix-up); for K/V laid out otherwise (e.g.
    /// `[tokens, n_kv_heads × head_dim]`) give the count:
    /// [`append_tensor_batch`](Self::append_tensor_batch)`(layer, &[seq], &[tokens], ..)`.
    /// Capacity and errors as [`append_tokens`](Self::append_tokens).
    pub fn append_tensor(
        &mut self,
        layer: usize,
        seq: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<usize> {
        let n_tokens = self.tokens_of("k", k.dims())?;
        if v.dims() != k.dims() {
            return Err(Error::invalid(format!(
                "v has shape {:?} but k has {:?}",
                v.dims(),
                k.dims()
            )));
        }
        self.append_tensors(
            &Append::Tokens {
                layer,
                seq,
                n_tokens,
            },
            k,
            v,
        )?;
        Ok(n_tokens)
    }

    /// [`append_batch`](Self::append_batch) from tensors: sequence `seq_ids[i]` gets
    /// `n_tokens[i]` tokens, whose rows `k` and `v` hold one after the other
    /// (`Σ n_tokens × n_kv_heads × head_dim` elements each, in any shape). dtypes and device as
    /// [`append_tensor`](Self::append_tensor).
    pub fn append_tensor_batch(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        n_tokens: &[usize],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        self.append_tensors(
            &Append::Batch {
                layer,
                seq_ids,
                n_tokens,
            },
            k,
            v,
        )
    }

    /// [`attention`](Self::attention) of `q` (`n_heads × head_dim` elements, `F32`, `F16` or `BF16`, any shape)
    /// over `(layer, seq)`: a new tensor shaped like `q` on its device.
    pub fn attention_tensor(
        &self,
        layer: usize,
        seq: usize,
        q: &Tensor,
        scale: Option<f32>,
    ) -> Result<Tensor> {
        self.attend_tensor(&Attend::One { layer, seq, scale }, q)
    }

    /// [`attention_batch`](Self::attention_batch): row `i` of `q` (rows of
    /// `n_heads × head_dim`, e.g. `[seq_ids.len(), n_heads, head_dim]`) belongs to
    /// `seq_ids[i]`. Returns a new tensor shaped like `q`.
    pub fn attention_batch_tensor(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &Tensor,
        scale: Option<f32>,
    ) -> Result<Tensor> {
        self.attend_tensor(
            &Attend::Batch {
                layer,
                seq_ids,
                scale,
            },
            q,
        )
    }

    /// [`attention_causal`](Self::attention_causal): `q` holds `Σ q_counts` rows of
    /// `n_heads × head_dim` (e.g. a prompt's `[tokens, n_heads, head_dim]`), whose K/V are
    /// already appended. Returns a new tensor shaped like `q`.
    pub fn attention_causal_tensor(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q_counts: &[usize],
        q: &Tensor,
        scale: Option<f32>,
        window: Option<usize>,
    ) -> Result<Tensor> {
        self.attend_tensor(
            &Attend::Causal {
                layer,
                seq_ids,
                q_counts,
                scale,
                window,
            },
            q,
        )
    }

    /// [`append_attention_batch`](Self::append_attention_batch) from tensors (a decode step
    /// in one call): row `i` of `k`/`v` (q's dtype) is appended to `seq_ids[i]`, then row `i` of
    /// `q` attends over it. Returns a new tensor shaped like `q`.
    pub fn append_attention_batch_tensor(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        scale: Option<f32>,
    ) -> Result<Tensor> {
        for (what, t) in [("k", k), ("v", v)] {
            if t.dtype() != q.dtype() {
                return Err(Error::invalid(format!(
                    "{what} is {:?} but q is {:?}: the fused call takes one dtype",
                    t.dtype(),
                    q.dtype()
                )));
            }
        }
        match q.dtype() {
            DType::F32 => self.append_attend_as::<f32>(layer, seq_ids, k, v, q, scale),
            DType::F16 => self.append_attend_as::<f16>(layer, seq_ids, k, v, q, scale),
            DType::BF16 => self.append_attend_as::<bf16>(layer, seq_ids, k, v, q, scale),
            other => Err(unsupported_dtype("q", other, "F32, F16 or BF16")),
        }
    }

    fn append_attend_as<T: TensorElement + IoElement + KvInput>(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        k: &Tensor,
        v: &Tensor,
        q: &Tensor,
        scale: Option<f32>,
    ) -> Result<Tensor> {
        let ctx = self.context().clone();
        with_tensor::<T, _>(&ctx, "k", k, |k| {
            with_tensor::<T, _>(&ctx, "v", v, |v| {
                with_tensor::<T, _>(&ctx, "q", q, |qs| {
                    new_tensor::<T>(&ctx, qs.len(), q, |mut out| {
                        self.append_attention_batch(layer, seq_ids, &k, &v, &qs, &mut out, scale)
                    })
                })
            })
        })
    }

    /// Tokens in a K/V tensor of shape `dims` (see [`append_tensor`](Self::append_tensor)).
    fn tokens_of(&self, what: &str, dims: &[usize]) -> Result<usize> {
        let cfg = self.config();
        let (g, d) = (cfg.n_kv_heads, cfg.head_dim);
        let n = dims.len();
        if n >= 2 && dims[n - 2..] == [g, d] && dims[..n.saturating_sub(3)].iter().all(|&x| x == 1)
        {
            return Ok(if n == 2 { 1 } else { dims[n - 3] });
        }
        let hint = if n >= 2 && dims[n - 2..] == [cfg.n_heads, d] && cfg.n_heads != g {
            format!(" (n_heads = {}: a query's shape, not K/V's)", cfg.n_heads)
        } else {
            String::new()
        };
        Err(Error::invalid(format!(
            "{what} has shape {dims:?}{hint}: expected [tokens, n_kv_heads, head_dim] = \
             [_, {g}, {d}], or [{g}, {d}] for one token (n_kv_heads × head_dim = {g} × {d}); \
             for another layout give the token count to append_tensor_batch"
        )))
    }

    fn append_tensors(&mut self, op: &Append<'_>, k: &Tensor, v: &Tensor) -> Result<()> {
        if v.dtype() != k.dtype() {
            return Err(Error::invalid(format!(
                "k is {:?} but v is {:?}",
                k.dtype(),
                v.dtype()
            )));
        }
        match k.dtype() {
            DType::F32 => self.append_as::<f32>(op, k, v),
            DType::F16 => self.append_as::<f16>(op, k, v),
            DType::BF16 => self.append_as::<bf16>(op, k, v),
            other => Err(unsupported_dtype("k and v", other, "F32, F16 or BF16")),
        }
    }

    fn append_as<T: TensorElement + KvInput>(
        &mut self,
        op: &Append<'_>,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let ctx = self.context().clone();
        with_tensor::<T, _>(&ctx, "k", k, |k| {
            with_tensor::<T, _>(&ctx, "v", v, |v| match *op {
                Append::Tokens {
                    layer,
                    seq,
                    n_tokens,
                } => self.append_tokens(layer, seq, n_tokens, &k, &v),
                Append::Batch {
                    layer,
                    seq_ids,
                    n_tokens,
                } => self.append_batch(layer, seq_ids, n_tokens, &k, &v),
            })
        })
    }

    fn attend_tensor(&self, op: &Attend<'_>, q: &Tensor) -> Result<Tensor> {
        match q.dtype() {
            DType::F32 => self.attend_as::<f32>(op, q),
            DType::F16 => self.attend_as::<f16>(op, q),
            DType::BF16 => self.attend_as::<bf16>(op, q),
            other => Err(unsupported_dtype("q", other, "F32, F16 or BF16")),
        }
    }

    fn attend_as<T: TensorElement + IoElement>(
        &self,
        op: &Attend<'_>,
        q: &Tensor,
    ) -> Result<Tensor> {
        let ctx = self.context();
        with_tensor::<T, _>(ctx, "q", q, |qs| {
            new_tensor::<T>(ctx, qs.len(), q, |mut out| op.run(self, &qs, &mut out))
        })
    }
}

/// Calls `f` with a view of `t`'s elements in `ctx`'s memory, holding `t`'s storage read lock.
fn with_tensor<T: TensorElement, R>(
    ctx: &Context,
    what: &str,
    t: &Tensor,
    f: impl FnOnce(DeviceSlice<'_, T>) -> Result<R>,
) -> Result<R> {
    expect_dtype(what, t, T::DTYPE, T::NAME)?;
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = contiguous_range(what, layout)?;
    match &*storage {
        Storage::Cpu(cpu) => {
            cpu_context(ctx, what, "the CPU")?;
            let data = cpu_slice::<T>(what, cpu)?
                .get(start..end)
                .ok_or_else(|| Error::invalid(format!("{what}'s layout passes its storage")))?;
            // SAFETY: a CPU context's backend memory is host memory; `data` is `T`s of the
            // tensor, kept alive and unwritten by candle while `storage` (a read lock) lives.
            f(unsafe { DeviceSlice::from_raw_parts(ctx, data.as_ptr(), data.len()) })
        }
        Storage::Cuda(cuda) => cuda::with_input(ctx, what, cuda, start, end - start, f),
        Storage::Metal(_) => Err(metal()),
    }
}

/// A new contiguous tensor of `like`'s shape on its device, `len` elements written by `f`.
fn new_tensor<T: TensorElement>(
    ctx: &Context,
    len: usize,
    like: &Tensor,
    f: impl FnOnce(DeviceSliceMut<'_, T>) -> Result<()>,
) -> Result<Tensor> {
    let shape: Shape = like.shape().clone();
    debug_assert_eq!(shape.elem_count(), len);
    match like.device() {
        Device::Cpu => {
            cpu_context(ctx, "the output", "the CPU")?;
            let mut data = vec![T::default(); len];
            // SAFETY: a CPU context's backend memory is host memory; `data` is ours alone.
            f(unsafe { DeviceSliceMut::from_raw_parts(ctx, data.as_mut_ptr(), len) })?;
            Tensor::from_vec(data, shape, &Device::Cpu).map_err(|e| candle_error("the output", e))
        }
        Device::Cuda(dev) => {
            let storage = cuda::new_output::<T>(ctx, dev, len, f)?;
            Ok(Tensor::from_storage(
                storage,
                shape,
                candle_core::op::BackpropOp::none(),
                false,
            ))
        }
        Device::Metal(_) => Err(metal()),
    }
}

fn contiguous_range(what: &str, layout: &Layout) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| {
        Error::invalid(format!(
            "{what} is not contiguous (shape {:?}, strides {:?}): call .contiguous() first",
            layout.dims(),
            layout.stride()
        ))
    })
}

fn cpu_slice<'a, T: TensorElement>(what: &str, cpu: &'a CpuStorage) -> Result<&'a [T]> {
    cpu.as_slice::<T>().map_err(|e| candle_error(what, e))
}

/// A tensor in host memory needs a CPU context.
fn cpu_context(ctx: &Context, what: &str, place: &str) -> Result<()> {
    match ctx.backend() {
        Backend::Cpu => Ok(()),
        other => Err(Error::invalid(format!(
            "{what} is on {place} but the cache's context uses the {other} backend: \
             make the context with Context::from_candle_device(tensor.device())"
        ))),
    }
}

fn expect_dtype(what: &str, t: &Tensor, want: DType, name: &str) -> Result<()> {
    if t.dtype() == want {
        Ok(())
    } else {
        Err(unsupported_dtype(what, t.dtype(), name))
    }
}

fn unsupported_dtype(what: &str, got: DType, want: &str) -> Error {
    Error::new(
        Status::Unsupported,
        format!("{what}: dtype {got:?} is not supported here (expected {want})"),
    )
}

fn candle_error(what: &str, e: candle_core::Error) -> Error {
    Error::invalid(format!("{what}: candle: {e}"))
}

fn metal() -> Error {
    Error::new(
        Status::Unsupported,
        "candle's Metal device: m40llm runs on CUDA or the CPU",
    )
}

#[cfg(feature = "candle-cuda")]
mod cuda {
    //! CUDA tensors: cudarc slices of candle's CUDA storage, seen through cudarc views.
    use std::sync::Arc;

    use candle_core::{CudaDevice, CudaStorage, Storage};
    use cudarc::driver::CudaStream;

    use super::{candle_error, TensorElement};
    use crate::buffer::{DeviceRead, DeviceSlice, DeviceSliceMut, DeviceWrite};
    use crate::context::{Backend, Context};
    use crate::cudarc_interop::{CudarcView, CudarcViewMut, PER_THREAD_STREAM};
    use crate::error::{Error, Result, Status};

    /// What a CUDA tensor's elements must be, besides a candle dtype.
    pub(crate) trait CudaElement:
        candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr
    {
    }
    impl<T: candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr> CudaElement for T {}

    pub(super) fn context(dev: &CudaDevice) -> Result<Context> {
        let stream = dev.cuda_stream();
        if stream.cu_stream() as usize != PER_THREAD_STREAM {
            return Context::from_cudarc_stream(&stream);
        }
        // candle's default (Device::new_cuda) is the per-thread stream, which a context that
        // may move between threads cannot take: a stream of its own, ordered per call.
        let own = stream
            .context()
            .new_stream()
            .map_err(|e| cuda_error("a stream", e))?;
        Context::from_cudarc_stream(&own)
    }

    fn cuda_error(what: &str, e: cudarc::driver::DriverError) -> Error {
        Error::new(Status::Cuda, format!("{what}: {e}"))
    }

    /// Orders `later` after the work queued on `earlier` so far (nothing on one stream).
    /// Needed besides cudarc's per-slice events, which exist only in its multi-stream mode and
    /// only for memory allocated after it began.
    fn order(later: &CudaStream, earlier: &CudaStream) -> Result<()> {
        if later.cu_stream() == earlier.cu_stream() {
            return Ok(());
        }
        later
            .join(earlier)
            .map_err(|e| cuda_error("ordering candle's stream and m40llm's", e))
    }

    /// The context's cudarc stream (the views made before have checked that it has one).
    fn ours(ctx: &Context) -> Result<&Arc<CudaStream>> {
        ctx.cudarc_stream().ok_or_else(|| {
            Error::invalid("the context was not made by Context::from_candle_device")
        })
    }

    fn cuda_context(ctx: &Context, what: &str) -> Result<()> {
        match ctx.backend() {
            Backend::Cuda => Ok(()),
            other => Err(Error::invalid(format!(
                "{what} is on a CUDA device but the cache's context uses the {other} backend: \
                 make the context with Context::from_candle_device(tensor.device())"
            ))),
        }
    }

    pub(super) fn with_input<T: TensorElement, R>(
        ctx: &Context,
        what: &str,
        storage: &CudaStorage,
        start: usize,
        len: usize,
        f: impl FnOnce(DeviceSlice<'_, T>) -> Result<R>,
    ) -> Result<R> {
        cuda_context(ctx, what)?;
        let slice = storage
            .as_cuda_slice::<T>()
            .map_err(|e| candle_error(what, e))?;
        let view = slice
            .try_slice(start..start + len)
            .ok_or_else(|| Error::invalid(format!("{what}'s layout passes its storage")))?;
        let cv = CudarcView::new(ctx, &view)?;
        let theirs = slice.stream();
        order(ours(ctx)?, theirs)?;
        // SAFETY: `cv` covers `len` elements of `T` in the context's CUDA context (checked by
        // CudarcView::new), kept alive by the caller's storage read lock; the context's stream
        // runs after the work queued on the tensor's stream, which waits for the call below
        // before anything of candle's can reuse the memory.
        let r = f(unsafe { DeviceSlice::from_raw_parts(ctx, cv.device_ptr(), len) });
        order(theirs, ours(ctx)?)?;
        drop(cv);
        r
    }

    pub(super) fn new_output<T: TensorElement>(
        ctx: &Context,
        dev: &CudaDevice,
        len: usize,
        f: impl FnOnce(DeviceSliceMut<'_, T>) -> Result<()>,
    ) -> Result<Storage> {
        cuda_context(ctx, "the output")?;
        if len == 0 {
            return Err(Error::invalid("the output would have no elements"));
        }
        let stream = dev.cuda_stream();
        // SAFETY: the memory is read only after `f` succeeded, and every call that `f` makes
        // writes all of `out` when it succeeds; on failure the slice is dropped unread.
        let mut slice = unsafe { stream.alloc::<T>(len) }
            .map_err(|e| Error::new(Status::Cuda, format!("allocating the output: {e}")))?;
        {
            let mut cv = CudarcViewMut::new(ctx, &mut slice)?;
            // The allocation is ordered on candle's stream.
            order(ours(ctx)?, &stream)?;
            // SAFETY: `cv` covers `len` elements of `T` in the context's CUDA context, ours
            // alone, alive until it is dropped after `f`.
            let r = f(unsafe { DeviceSliceMut::from_raw_parts(ctx, cv.device_ptr_mut(), len) });
            order(&stream, ours(ctx)?)?;
            r?;
        }
        Ok(Storage::Cuda(CudaStorage::wrap_cuda_slice(
            slice,
            dev.clone(),
        )))
    }
}

#[cfg(not(feature = "candle-cuda"))]
mod cuda {
    //! Without `candle-cuda`: CUDA tensors are refused with the feature to enable.
    use candle_core::{CudaDevice, CudaStorage, Storage};

    use crate::buffer::{DeviceSlice, DeviceSliceMut};
    use crate::context::Context;
    use crate::error::{Error, Result, Status};

    pub(crate) trait CudaElement {}
    impl<T> CudaElement for T {}

    fn no_cuda() -> Error {
        Error::new(
            Status::Unsupported,
            "a candle CUDA device or tensor needs m40llm's `candle-cuda` feature",
        )
    }

    pub(super) fn context(_: &CudaDevice) -> Result<Context> {
        Err(no_cuda())
    }

    pub(super) fn with_input<T, R>(
        _: &Context,
        _: &str,
        _: &CudaStorage,
        _: usize,
        _: usize,
        _: impl FnOnce(DeviceSlice<'_, T>) -> Result<R>,
    ) -> Result<R>
    where
        T: crate::buffer::Element,
    {
        Err(no_cuda())
    }

    pub(super) fn new_output<T: crate::buffer::Element>(
        _: &Context,
        _: &CudaDevice,
        _: usize,
        _: impl FnOnce(DeviceSliceMut<'_, T>) -> Result<()>,
    ) -> Result<Storage> {
        Err(no_cuda())
    }
}
