//! Interop with [cudarc](https://docs.rs/cudarc) (feature `cudarc`): a [`Context`] on a cudarc
//! stream, and cudarc device memory ([`CudaSlice`](cudarc::driver::CudaSlice),
//! [`CudaView`](cudarc::driver::CudaView), [`CudaViewMut`](cudarc::driver::CudaViewMut)) used
//! directly as K, V, q and out, without copies and without `unsafe`.
//!
//! 1. [`Context::from_cudarc_stream`] makes an m40llm context that queues its work on a cudarc
//!    stream (and keeps that stream alive). The stream must belong to the device's *primary*
//!    context (what [`CudaContext::new`](cudarc::driver::CudaContext::new) returns), the one the
//!    CUDA runtime inside m40llm uses.
//! 2. [`CudarcView::new`] / [`CudarcViewMut::new`] (or [`Context::cudarc_view`] /
//!    [`Context::cudarc_view_mut`]) borrow cudarc memory of the same CUDA context as a
//!    [`DeviceRead`](crate::DeviceRead) / [`DeviceWrite`](crate::DeviceWrite) of that m40llm context, so every cache method takes
//!    them. Lengths are checked by the cache methods as for any buffer.
//!
//! Ordering follows cudarc's own rules: creating a view makes the context's stream wait for
//! cudarc's last write of the memory (when cudarc tracks events, i.e. in multi-stream mode), and
//! dropping the view records m40llm's use of it on that stream, so later cudarc work on other
//! streams waits for the m40llm calls made while the view lived. Drop a view after the calls
//! that use it (the borrow checker keeps it alive while a call needs it).
//!
//! With cudarc's default (null, legacy) stream, the m40llm context gets a stream of its own that
//! synchronizes with the legacy default stream, so work on both stays ordered. cudarc's
//! per-thread stream is refused: a context may move between threads.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudarc::driver::CudaContext;
//! use m40llm::{Context, KvCache, KvCacheConfig};
//!
//! let cuda = CudaContext::new(0)?;
//! let stream = cuda.new_stream()?;
//! let ctx = Context::from_cudarc_stream(&stream)?;
//! let cfg = KvCacheConfig::new(1, 8, 64).kv_heads(2).max_seq_len(128);
//! let mut kv = KvCache::new(&ctx, &cfg)?;
//!
//! let k = stream.clone_htod(&vec![0.5f32; cfg.kv_row_len()])?;
//! let v = stream.clone_htod(&vec![1.0f32; cfg.kv_row_len()])?;
//! let q = stream.clone_htod(&vec![0.1f32; cfg.q_row_len()])?;
//! let mut out = stream.alloc_zeros::<f32>(cfg.q_row_len())?;
//! kv.append_token(0, 0, &ctx.cudarc_view(&k)?, &ctx.cudarc_view(&v)?)?;
//! kv.attention(0, 0, &ctx.cudarc_view(&q)?, &mut ctx.cudarc_view_mut(&mut out)?, None)?;
//! let host: Vec<f32> = stream.clone_dtoh(&out)?;
//! assert!(host.iter().all(|&x| (x - 1.0).abs() < 1e-6));
//! # Ok(()) }
//! ```

use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::align_of;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::buffer::{device_view, Element};
use crate::context::{Backend, Context};
use crate::error::{Error, Result, Status};

/// cudarc's handle of the per-thread default stream (`CU_STREAM_PER_THREAD`).
pub(crate) const PER_THREAD_STREAM: usize = 0x2;

impl Context {
    /// A CUDA context that queues its work on `stream` (a cudarc stream) and keeps it alive:
    /// the device is the stream's, and the stream is released only after the m40llm context
    /// (and every cache and buffer made from it) is gone.
    ///
    /// Fails with [`Status::InvalidArgument`] when the stream belongs to a non-primary CUDA
    /// context (m40llm's CUDA runtime works in the device's primary context) and with
    /// [`Status::Unsupported`] for cudarc's per-thread stream; with
    /// [`Status::NoDevice`] when m40llm was built without CUDA. A null (legacy default) stream
    /// gives the context a stream of its own, synchronized with the legacy default stream.
    pub fn from_cudarc_stream(stream: &Arc<CudaStream>) -> Result<Context> {
        let cuda = stream.context();
        check_stream(cuda.is_primary(), stream.cu_stream() as usize)?;
        let device = u32::try_from(cuda.ordinal())
            .map_err(|_| Error::out_of_range(format!("device {} is too large", cuda.ordinal())))?;
        let raw: *mut c_void = stream.cu_stream().cast();
        // SAFETY: `raw` is null or a live stream of device `device`'s primary context (checked
        // above); the context keeps `stream` (an Arc) until the C context is destroyed.
        let mut builder = unsafe {
            Context::builder()
                .backend(Backend::Cuda)
                .device(device)
                .cuda_stream(raw)
        };
        builder.cudarc_stream = Some(stream.clone());
        builder.build()
    }

    /// [`CudarcView::new`]: cudarc memory read by this context's calls.
    pub fn cudarc_view<'a, T: Element, S: DevicePtr<T> + ?Sized>(
        &'a self,
        src: &'a S,
    ) -> Result<CudarcView<'a, T>> {
        CudarcView::new(self, src)
    }

    /// [`CudarcViewMut::new`]: cudarc memory written by this context's calls.
    pub fn cudarc_view_mut<'a, T: Element, S: DevicePtrMut<T> + ?Sized>(
        &'a self,
        dst: &'a mut S,
    ) -> Result<CudarcViewMut<'a, T>> {
        CudarcViewMut::new(self, dst)
    }
}

/// The stream a context may run on: one of a primary context, not the per-thread stream.
fn check_stream(is_primary: bool, handle: usize) -> Result<()> {
    if !is_primary {
        return Err(Error::invalid(
            "the cudarc stream belongs to a non-primary CUDA context; m40llm's CUDA runtime \
             works in the device's primary context (use cudarc's CudaContext::new)",
        ));
    }
    if handle == PER_THREAD_STREAM {
        return Err(Error::new(
            Status::Unsupported,
            "cudarc's per-thread default stream names a different stream on every thread, and \
             an m40llm context may move between threads: use CudaContext::new_stream or the \
             default stream",
        ));
    }
    Ok(())
}

/// The cudarc stream of a context that views may use.
fn view_stream(backend: Backend, stream: Option<&Arc<CudaStream>>) -> Result<&Arc<CudaStream>> {
    match (backend, stream) {
        (Backend::Cuda, Some(s)) => Ok(s),
        (Backend::Cuda, None) => Err(Error::invalid(
            "the m40llm context was not made from a cudarc stream: create it with \
             Context::from_cudarc_stream to use cudarc memory",
        )),
        _ => Err(Error::invalid(format!(
            "the m40llm context uses the {backend} backend: cudarc memory needs a CUDA context \
             made by Context::from_cudarc_stream"
        ))),
    }
}

/// The memory must live in the context's CUDA context (same device, primary context).
fn check_same_device(
    memory: (usize, bool),
    context: (usize, bool),
    same_cuda_context: bool,
) -> Result<()> {
    if same_cuda_context {
        return Ok(());
    }
    let describe = |(ordinal, primary): (usize, bool)| {
        format!(
            "CUDA device {ordinal} ({} context)",
            if primary { "primary" } else { "non-primary" }
        )
    };
    Err(Error::invalid(format!(
        "the cudarc memory lives on {} but the m40llm context runs on {}",
        describe(memory),
        describe(context)
    )))
}

/// A device pointer as a `*const T`: non-null unless empty, aligned for `T`.
fn check_ptr<T>(ptr: u64, len: usize) -> Result<*const T> {
    let p = usize::try_from(ptr)
        .map_err(|_| Error::invalid(format!("device pointer {ptr:#x} does not fit a pointer")))?;
    if len > 0 && p == 0 {
        return Err(Error::invalid(
            "the cudarc memory has a null device pointer",
        ));
    }
    if p % align_of::<T>() != 0 {
        return Err(Error::invalid(format!(
            "device pointer {p:#x} is not aligned to {} bytes",
            align_of::<T>()
        )));
    }
    Ok(p as *const T)
}

fn checked_stream<'a>(ctx: &'a Context, memory: &Arc<CudaContext>) -> Result<&'a Arc<CudaStream>> {
    let stream = view_stream(ctx.backend(), ctx.cudarc_stream())?;
    let ours = stream.context();
    check_same_device(
        (memory.ordinal(), memory.is_primary()),
        (ours.ordinal(), ours.is_primary()),
        **memory == **ours,
    )?;
    Ok(stream)
}

/// cudarc device memory read by an m40llm [`Context`]'s calls (K, V, q): a [`DeviceRead`](crate::DeviceRead) that
/// every cache method accepts. Borrows the cudarc memory and the context; see the
/// [module docs](self) for ordering.
pub struct CudarcView<'a, T: Element> {
    ptr: *const T,
    len: usize,
    ctx: &'a Context,
    _sync: SyncOnDrop<'a>,
    _marker: PhantomData<&'a [T]>,
}

impl<'a, T: Element> CudarcView<'a, T> {
    /// Views `src` (a `CudaSlice<T>`, `CudaView<T>` or `CudaViewMut<T>`) for reading by `ctx`.
    ///
    /// Fails with [`Status::InvalidArgument`] unless `ctx` was made by
    /// [`Context::from_cudarc_stream`] and `src` lives in the same CUDA context (device).
    pub fn new<S: DevicePtr<T> + ?Sized>(ctx: &'a Context, src: &'a S) -> Result<Self> {
        let stream = checked_stream(ctx, src.stream().context())?;
        let len = cudarc::driver::DeviceSlice::len(src);
        let (ptr, sync) = src.device_ptr(stream);
        Ok(CudarcView {
            ptr: check_ptr(ptr, len)?,
            len,
            ctx,
            _sync: sync,
            _marker: PhantomData,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// cudarc device memory written by an m40llm [`Context`]'s calls (out, read-backs): a
/// [`DeviceWrite`](crate::DeviceWrite) that every cache method accepts. Borrows the cudarc memory exclusively; see
/// the [module docs](self) for ordering.
pub struct CudarcViewMut<'a, T: Element> {
    ptr: *mut T,
    len: usize,
    ctx: &'a Context,
    _sync: SyncOnDrop<'a>,
    _marker: PhantomData<&'a mut [T]>,
}

impl<'a, T: Element> CudarcViewMut<'a, T> {
    /// Views `dst` (a `CudaSlice<T>` or `CudaViewMut<T>`) for writing by `ctx`; fails as
    /// [`CudarcView::new`].
    pub fn new<S: DevicePtrMut<T> + ?Sized>(ctx: &'a Context, dst: &'a mut S) -> Result<Self> {
        let stream = checked_stream(ctx, dst.stream().context())?;
        let len = cudarc::driver::DeviceSlice::len(dst);
        let (ptr, sync) = dst.device_ptr_mut(stream);
        Ok(CudarcViewMut {
            ptr: check_ptr::<T>(ptr, len)?.cast_mut(),
            len,
            ctx,
            _sync: sync,
            _marker: PhantomData,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

device_view!(CudarcView<'_, T>);
device_view!(CudarcViewMut<'_, T>, mut);

impl<T: Element> std::fmt::Debug for CudarcView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudarcView<{}>({} elements at {:p})",
            T::NAME,
            self.len,
            self.ptr
        )
    }
}

impl<T: Element> std::fmt::Debug for CudarcViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudarcViewMut<{}>({} elements at {:p})",
            T::NAME,
            self.len,
            self.ptr
        )
    }
}

#[cfg(test)]
mod tests {
    //! The argument checks, without a GPU or a CUDA driver (the GPU side is in tests/gpu.rs).
    use super::*;

    #[test]
    fn streams_of_non_primary_contexts_and_the_per_thread_stream_are_refused() {
        assert!(check_stream(true, 0).is_ok()); // the legacy default stream
        assert!(check_stream(true, 0x7f00_1234_5000).is_ok());
        let e = check_stream(false, 0x7f00_1234_5000).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("primary"), "{e}");
        let e = check_stream(true, PER_THREAD_STREAM).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        assert!(e.message().contains("per-thread"), "{e}");
    }

    #[test]
    fn views_need_a_cuda_context_made_from_a_cudarc_stream() {
        let cpu = Context::cpu().unwrap();
        assert!(cpu.cudarc_stream().is_none());
        let e = view_stream(cpu.backend(), cpu.cudarc_stream()).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("cpu backend"), "{e}");
        let e = view_stream(Backend::Cuda, None).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("from_cudarc_stream"), "{e}");
    }

    #[test]
    fn memory_of_another_device_or_context_is_refused() {
        assert!(check_same_device((0, true), (0, true), true).is_ok());
        let e = check_same_device((1, true), (0, true), false).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert!(e.message().contains("CUDA device 1"), "{e}");
        assert!(e.message().contains("CUDA device 0"), "{e}");
        let e = check_same_device((0, false), (0, true), false).unwrap_err();
        assert!(e.message().contains("non-primary"), "{e}");
    }

    #[test]
    fn device_pointers_are_checked() {
        assert_eq!(check_ptr::<f32>(0x1000, 4).unwrap() as usize, 0x1000);
        assert!(check_ptr::<f32>(0, 0).unwrap().is_null());
        assert_eq!(
            check_ptr::<f32>(0, 4).unwrap_err().status(),
            Status::InvalidArgument
        );
        assert_eq!(
            check_ptr::<f32>(0x1002, 4).unwrap_err().status(),
            Status::InvalidArgument
        );
        assert!(check_ptr::<u16>(0x1002, 4).is_ok());
    }
}
