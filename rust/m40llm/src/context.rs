//! Contexts: one backend (CPU, or one CUDA device and stream).

use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, MutexGuard};

use m40llm_sys as sys;

use crate::error::{check, Error, Result};

/// Which backend a [`Context`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// CUDA when a usable GPU exists, else the CPU, without a word: the library logs nothing.
    /// Ask [`Context::backend`] which one a context got (it never reports `Auto`), and
    /// [`build_info`](crate::build_info) whether the library has the CUDA backend at all (a
    /// build without a CUDA toolkit has the CPU backend only). A program that needs the GPU
    /// should ask for [`Backend::Cuda`], which fails with the reason instead.
    #[default]
    Auto,
    /// The CUDA backend: buffers live in GPU memory and work is queued on a CUDA stream.
    /// Creating a context fails with [`Status::NoDevice`](crate::Status) where there is no
    /// usable GPU, or the library was built without CUDA; the message says which, and how to
    /// fix it.
    Cuda,
    /// The CPU backend: buffers live in host memory and every call completes before returning.
    Cpu,
}

impl Backend {
    fn to_raw(self) -> i32 {
        (match self {
            Backend::Auto => sys::M40LLM_BACKEND_AUTO,
            Backend::Cuda => sys::M40LLM_BACKEND_CUDA,
            Backend::Cpu => sys::M40LLM_BACKEND_CPU,
        }) as i32
    }

    fn from_raw(raw: i32) -> Backend {
        match raw as u32 {
            sys::M40LLM_BACKEND_CUDA => Backend::Cuda,
            sys::M40LLM_BACKEND_CPU => Backend::Cpu,
            _ => Backend::Auto,
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Auto => "auto",
            Backend::Cuda => "cuda",
            Backend::Cpu => "cpu",
        })
    }
}

/// Options for creating a [`Context`]; see [`Context::builder`].
#[derive(Debug, Clone)]
pub struct ContextBuilder {
    backend: Backend,
    device: u32,
    stream: *mut c_void,
    /// A cudarc stream the context runs on and keeps alive (feature `cudarc`).
    #[cfg(feature = "cudarc")]
    pub(crate) cudarc_stream: Option<Arc<cudarc::driver::CudaStream>>,
}

impl Default for ContextBuilder {
    fn default() -> Self {
        ContextBuilder {
            backend: Backend::Auto,
            device: 0,
            stream: ptr::null_mut(),
            #[cfg(feature = "cudarc")]
            cudarc_stream: None,
        }
    }
}

impl ContextBuilder {
    /// Defaults: [`Backend::Auto`], device 0, a stream the context creates.
    pub fn new() -> Self {
        Self::default()
    }

    /// Picks the backend.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Picks the CUDA device ordinal (ignored by the CPU backend).
    pub fn device(mut self, device: u32) -> Self {
        self.device = device;
        self
    }

    /// Makes the context queue its work on the caller's `cudaStream_t` instead of one it creates
    /// (null restores the default). Only valid with the CUDA backend.
    ///
    /// # Safety
    /// `stream` must be null or a valid `cudaStream_t` of the chosen device that stays alive
    /// until the context (and every cache and buffer made from it) has been dropped. With the
    /// `cudarc` feature, `Context::from_cudarc_stream` does this safely.
    pub unsafe fn cuda_stream(mut self, stream: *mut c_void) -> Self {
        self.stream = stream;
        self
    }

    /// Creates the context.
    pub fn build(self) -> Result<Context> {
        let device = i32::try_from(self.device)
            .map_err(|_| Error::out_of_range(format!("device {} is too large", self.device)))?;
        let mut opts = sys::m40llm_context_options::default();
        // SAFETY: opts is a valid, writable options struct.
        check(unsafe {
            sys::m40llm_context_options_init(&mut opts, sys::M40LLM_CONTEXT_OPTIONS_VERSION)
        })?;
        opts.backend = self.backend.to_raw();
        opts.device = device;
        opts.cuda_stream = self.stream;
        let mut raw = ptr::null_mut();
        // SAFETY: valid out pointer and options; the stream's validity is the caller's promise
        // (ContextBuilder::cuda_stream is unsafe).
        check(unsafe { sys::m40llm_context_create(&mut raw, &opts) })?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::invalid("m40llm_context_create returned null"))?;
        let mut inner = ContextInner {
            raw,
            lock: Mutex::new(()),
            backend: Backend::Auto,
            device: None,
            #[cfg(feature = "cudarc")]
            cudarc_stream: self.cudarc_stream,
        };
        // The context is not shared yet; if this fails, dropping `inner` destroys it. Version 1:
        // the backend and device only, without loading the GPU's kernels.
        let info = device_info_raw(raw.as_ptr(), 1)?;
        inner.backend = info.backend;
        inner.device = info.device;
        Ok(Context {
            inner: Arc::new(inner),
        })
    }
}

/// A backend plus, for CUDA, one device and one stream. Owns the scratch memory of attention.
///
/// A `Context` is a cheap handle: [`Clone`] makes another handle to the same context (an
/// [`Arc`] count), not a new context. Caches and buffers made from it keep a handle, so the
/// context lives until the last of them is dropped, in any order; none of them carries a
/// lifetime, so a model struct can own its context, caches and buffers together.
///
/// # Threads
/// `Context` is [`Send`] and [`Sync`], and so are [`KvCache`](crate::KvCache) and
/// [`DeviceBuffer`](crate::DeviceBuffer). The C library requires that calls on a context and
/// on everything made from it never run concurrently; every handle to one context shares one
/// lock, and every call into the library (through the context, a cache, a buffer or a view)
/// holds it for the duration of that call. Threads sharing a context therefore take turns,
/// call by call; distinct contexts never wait for each other. For parallel work on one GPU,
/// use one context per thread.
///
/// # Ordering
/// With the CUDA backend, appends, attention, reads into device buffers, memsets and
/// device-to-device copies are queued on the context's stream and may return before the GPU
/// has finished; copies to or from host memory wait. Errors raised by queued work surface at
/// the next call that synchronizes ([`Context::synchronize`] or a host copy).
///
/// ```
/// use m40llm::{Backend, Context};
/// let ctx = Context::new(Backend::Cpu)?;
/// assert_eq!(ctx.backend(), Backend::Cpu);
/// println!("{}", ctx.device_info()?);
/// ctx.synchronize()?;
/// let same = ctx.clone(); // another handle to the same context
/// assert_eq!(same, ctx);
/// assert_ne!(Context::cpu()?, ctx); // a new context
/// # Ok::<(), m40llm::Error>(())
/// ```
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

/// What every handle to one context shares.
struct ContextInner {
    raw: NonNull<sys::m40llm_context>,
    /// Held for every call into the library on this context or anything made from it.
    lock: Mutex<()>,
    backend: Backend,
    device: Option<u32>,
    /// The cudarc stream the context runs on, kept alive until the context is destroyed
    /// (fields drop after `Drop::drop` has destroyed the context).
    #[cfg(feature = "cudarc")]
    cudarc_stream: Option<Arc<cudarc::driver::CudaStream>>,
}

// SAFETY: the C library allows a context to be used from any thread as long as calls on it (and
// on its caches) do not run concurrently; every call through this crate holds `lock`, and the
// raw handle is only destroyed in `drop`, when no handle is left.
unsafe impl Send for ContextInner {}
// SAFETY: as above; `&ContextInner` only gives access to the handle under `lock` (or to
// `Context::as_raw`, whose users must take the lock themselves).
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed once; every cache and buffer holds a handle to this
        // inner value, so all of them are gone.
        unsafe { sys::m40llm_context_destroy(self.raw.as_ptr()) }
    }
}

impl PartialEq for Context {
    /// Whether both are handles to the same context.
    fn eq(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Context {}

impl Context {
    /// A context on the given backend (CUDA device 0 for CUDA or Auto). [`Backend::Auto`]
    /// quietly takes the CPU where no GPU is usable; check [`backend`](Self::backend):
    ///
    /// ```
    /// use m40llm::{Backend, Context};
    /// let ctx = Context::new(Backend::Auto)?;
    /// if ctx.backend() == Backend::Cpu {
    ///     eprintln!("no usable GPU; m40llm build: {}", m40llm::build_info()?);
    /// }
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn new(backend: Backend) -> Result<Context> {
        ContextBuilder::new().backend(backend).build()
    }

    /// A context on the CPU backend (always available).
    pub fn cpu() -> Result<Context> {
        Context::new(Backend::Cpu)
    }

    /// A context on CUDA device `device`. Fails with [`Status::NoDevice`](crate::Status) when
    /// there is no usable GPU or the library was built without CUDA.
    pub fn cuda(device: u32) -> Result<Context> {
        ContextBuilder::new()
            .backend(Backend::Cuda)
            .device(device)
            .build()
    }

    /// Options beyond [`Context::new`]: device ordinal, caller-owned CUDA stream.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::new()
    }

    /// The backend in use ([`Backend::Cuda`] or [`Backend::Cpu`], never `Auto`).
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// The CUDA device ordinal, or `None` for the CPU backend.
    pub fn device(&self) -> Option<u32> {
        self.inner.device
    }

    /// Describes the backend and device (free memory is read at the time of the call), and
    /// the code the library runs on the GPU. The first call on a GPU that runs PTX makes the
    /// driver JIT-compile the library's kernels (as the first attention call would).
    pub fn device_info(&self) -> Result<DeviceInfo> {
        let _lock = self.lock();
        device_info_raw(self.as_raw(), sys::M40LLM_DEVICE_INFO_VERSION)
    }

    /// Blocks until all work queued on the context is done and reports errors raised by it.
    pub fn synchronize(&self) -> Result<()> {
        let _lock = self.lock();
        // SAFETY: valid context; the lock is held.
        check(unsafe { sys::m40llm_context_synchronize(self.as_raw()) })
    }

    /// The context's `cudaStream_t` (null for the CPU backend), for ordering your own CUDA work
    /// with the context's.
    pub fn cuda_stream(&self) -> *mut c_void {
        let _lock = self.lock();
        // SAFETY: valid context; the lock is held.
        unsafe { sys::m40llm_context_cuda_stream(self.as_raw()) }
    }

    /// The raw handle, for calling `m40llm_sys` directly. It stays owned by the context. The C
    /// library forbids concurrent calls on a context: make raw calls inside
    /// [`with_raw`](Self::with_raw), which holds the context's lock, whenever another thread may
    /// hold a handle to this context (or to a cache or buffer made from it).
    pub fn as_raw(&self) -> *mut sys::m40llm_context {
        self.inner.raw.as_ptr()
    }

    /// Runs `f` with the raw handle while holding the context's lock, so that raw `m40llm_sys`
    /// calls on the context, its caches ([`KvCache::as_raw`](crate::KvCache::as_raw)) and its
    /// memory cannot run concurrently with calls made through this crate. `f` must not call
    /// this crate's methods on the same context: the lock is not reentrant (that would
    /// deadlock).
    ///
    /// ```
    /// let ctx = m40llm::Context::cpu()?;
    /// let stream = ctx.with_raw(|raw| unsafe { m40llm::sys::m40llm_context_cuda_stream(raw) });
    /// assert!(stream.is_null());
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn with_raw<R>(&self, f: impl FnOnce(*mut sys::m40llm_context) -> R) -> R {
        let _lock = self.lock();
        f(self.as_raw())
    }

    /// Takes the context's lock (held for every library call on the context, its caches and
    /// its memory). The lock guards no Rust data, so a panic while holding it (which poisons a
    /// `std` mutex) leaves nothing inconsistent: poisoning is ignored.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.inner
            .lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn same_as(&self, other: &Context) -> bool {
        self == other
    }

    /// The cudarc stream the context runs on, if it was made by
    /// [`Context::from_cudarc_stream`].
    #[cfg(feature = "cudarc")]
    pub fn cudarc_stream(&self) -> Option<&Arc<cudarc::driver::CudaStream>> {
        self.inner.cudarc_stream.as_ref()
    }
}

/// `m40llm_context_device_info` of the given struct version (version 1 leaves the code facts
/// unset); the caller holds the lock (or owns the only handle).
fn device_info_raw(raw: *mut sys::m40llm_context, version: u32) -> Result<DeviceInfo> {
    let mut info = sys::m40llm_device_info {
        version,
        ..Default::default()
    };
    // SAFETY: valid out struct with its version set; valid context, not used concurrently.
    check(unsafe { sys::m40llm_context_device_info(&mut info, raw) })?;
    // SAFETY: the library NUL-terminates name; the array is 256 chars and we bound the read.
    let name_bytes: Vec<u8> = info
        .name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let name = String::from_utf8_lossy(&name_bytes).into_owned();
    let backend = Backend::from_raw(info.backend);
    let kernel_arch = info.kernel_arch.max(0) as u32;
    Ok(DeviceInfo {
        backend,
        device: u32::try_from(info.device).ok(),
        name,
        compute_capability: (backend == Backend::Cuda).then_some((
            info.compute_major.max(0) as u32,
            info.compute_minor.max(0) as u32,
        )),
        multiprocessors: info.multiprocessors.max(0) as u32,
        total_memory: info.total_memory,
        free_memory: info.free_memory,
        kernel_arch: (kernel_arch > 0).then_some((kernel_arch / 10, kernel_arch % 10)),
        native_code: info.native_code != 0,
        tensor_cores: info.tensor_cores != 0,
    })
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("backend", &self.inner.backend)
            .field("device", &self.inner.device)
            .field("raw", &self.inner.raw)
            .finish()
    }
}

/// What [`Context::device_info`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// [`Backend::Cuda`] or [`Backend::Cpu`].
    pub backend: Backend,
    /// CUDA device ordinal; `None` for the CPU backend.
    pub device: Option<u32>,
    /// GPU name, or `"CPU"`.
    pub name: String,
    /// Compute capability `(major, minor)`; `None` for the CPU backend.
    pub compute_capability: Option<(u32, u32)>,
    /// Streaming multiprocessor count; 0 for the CPU backend.
    pub multiprocessors: u32,
    /// Bytes of device memory; 0 for the CPU backend.
    pub total_memory: usize,
    /// Bytes of device memory free when queried; 0 for the CPU backend.
    pub free_memory: usize,
    /// The architecture, `(major, minor)`, the library's kernels on this GPU were compiled for:
    /// the SASS it runs (e.g. `(8, 0)` on an sm_86 GPU) or the PTX the driver JIT-compiled
    /// (e.g. `(5, 2)` on an H100 with a build for the M40 only); `None` for the CPU backend.
    pub kernel_arch: Option<(u32, u32)>,
    /// Whether the GPU runs SASS built in for it; `false` where the driver JIT-compiled PTX
    /// (once per process, or from its disk cache), and for the CPU backend. See
    /// [`BuildInfo::cuda_architectures`](crate::BuildInfo::cuda_architectures).
    pub native_code: bool,
    /// Whether F16 caches with head_dim 32..=128, a multiple of 16, or 192 or 256, and
    /// quantized caches with head_dim 32, 64, 96, 128, 192 or 256 run the tensor-core attention
    /// kernels here (sm_80+ code on an sm_80+ GPU); `false` where every cache runs the FP32
    /// kernels.
    pub tensor_cores: bool,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.device, self.compute_capability) {
            (Some(dev), Some((major, minor))) => {
                write!(
                    f,
                    "CUDA device {dev}: {} (sm_{major}{minor}, {} SMs, {:.1}/{:.1} GiB free)",
                    self.name,
                    self.multiprocessors,
                    self.free_memory as f64 / (1u64 << 30) as f64,
                    self.total_memory as f64 / (1u64 << 30) as f64
                )?;
                if let Some((kmajor, kminor)) = self.kernel_arch {
                    let (code, how) = if self.native_code {
                        ("sm", "SASS")
                    } else {
                        ("compute", "PTX, JIT-compiled")
                    };
                    write!(f, ", runs {code}_{kmajor}{kminor} {how}")?;
                    if self.tensor_cores {
                        f.write_str(", tensor cores")?;
                    }
                }
                Ok(())
            }
            _ => write!(f, "{} backend", self.name),
        }
    }
}

/// Number of usable CUDA devices: 0 when the library was built without CUDA or when no
/// driver or GPU is present (not an error).
pub fn cuda_device_count() -> Result<usize> {
    let mut n = 0;
    // SAFETY: valid out pointer.
    check(unsafe { sys::m40llm_cuda_device_count(&mut n) })?;
    Ok(n.max(0) as usize)
}

/// Whether the linked library was built with the CUDA backend.
pub fn built_with_cuda() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { sys::m40llm_built_with_cuda() != 0 }
}

/// Version of the linked C library, `"MAJOR.MINOR.PATCH"`.
pub fn library_version() -> &'static str {
    // SAFETY: static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::m40llm_version_string()) }
        .to_str()
        .unwrap_or("")
}
