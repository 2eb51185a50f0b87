//! Typed buffers in a context's backend memory (GPU memory for CUDA, host memory for the CPU).

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::ops::{Bound, RangeBounds};
use std::ptr;

use half::{bf16, f16};
use m40llm_sys as sys;

use crate::context::Context;
use crate::error::{check, Error, Result};

pub(crate) mod private {
    pub trait Sealed {}
}

/// Element types a [`DeviceBuffer`] can hold: `f32`, [`half::f16`], [`half::bf16`] and `u16`
/// (raw binary16 bit patterns). Every bit pattern is a valid value of each, so device memory
/// can always be copied back into them. Sealed.
pub trait Element: private::Sealed + Copy + Default + Send + Sync + fmt::Debug + 'static {
    /// A short name for messages (`"f32"`, `"f16"`, `"bf16"`, `"u16"`).
    const NAME: &'static str;
}

/// The FP16 element types (`f16` and its bit pattern `u16`): what the cache stores and reads.
pub trait HalfElement: Element {}

impl private::Sealed for f32 {}
impl Element for f32 {
    const NAME: &'static str = "f32";
}
impl private::Sealed for f16 {}
impl Element for f16 {
    const NAME: &'static str = "f16";
}
impl HalfElement for f16 {}
impl private::Sealed for u16 {}
impl Element for u16 {
    const NAME: &'static str = "u16";
}
impl HalfElement for u16 {}
impl private::Sealed for bf16 {}
impl Element for bf16 {
    const NAME: &'static str = "bf16";
}

/// Element types of the attention calls' `q` and `out` (and of
/// [`KvCache::append_attention_batch`](crate::KvCache::append_attention_batch)'s K/V rows):
/// `f32`, [`half::f16`] and [`half::bf16`], so that an FP16 or BF16 model passes its
/// activations as they are. The arithmetic is FP32 whatever the type: 16-bit `q` is widened
/// exactly on the device and the output rounded once, to nearest even (see
/// `m40llm_kvcache_attn_batch_ex` in `m40llm.h`). Sealed.
pub trait IoElement: Element {
    /// The library's `m40llm_dtype` of this type.
    #[doc(hidden)]
    const DTYPE: std::ffi::c_int;
}
impl IoElement for f32 {
    const DTYPE: std::ffi::c_int = sys::M40LLM_DTYPE_F32 as std::ffi::c_int;
}
impl IoElement for f16 {
    const DTYPE: std::ffi::c_int = sys::M40LLM_DTYPE_F16 as std::ffi::c_int;
}
impl IoElement for bf16 {
    const DTYPE: std::ffi::c_int = sys::M40LLM_DTYPE_BF16 as std::ffi::c_int;
}

/// Read access to a run of `T` in a context's backend memory: implemented by [`DeviceBuffer`],
/// [`DeviceSlice`] and [`DeviceSliceMut`]. Sealed; the pointer is only handed to the library.
pub trait DeviceRead<T: Element>: private::Sealed {
    /// Start of the elements in backend memory (null when empty).
    fn device_ptr(&self) -> *const T;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The context whose memory this is.
    fn context(&self) -> &Context;
}

/// Write access to a run of `T` in backend memory: [`DeviceBuffer`] and [`DeviceSliceMut`].
pub trait DeviceWrite<T: Element>: DeviceRead<T> {
    /// Mutable start of the elements in backend memory (null when empty).
    fn device_ptr_mut(&mut self) -> *mut T;
}

/// An owned, typed allocation of `len` elements in `ctx`'s backend memory, freed on drop.
///
/// It keeps a handle to its [`Context`] (so the context lives at least as long as the buffer)
/// and has no lifetime parameter. It is [`Send`] and [`Sync`]: every library call it makes holds
/// the context's lock, and writes need `&mut self`.
///
/// Host copies ([`copy_from_host`](Self::copy_from_host), [`copy_to_host`](Self::copy_to_host),
/// [`to_vec`](Self::to_vec)) block until done; [`memset`](Self::memset) and
/// [`copy_from_device`](Self::copy_from_device) are ordered on the context's stream.
///
/// ```
/// use m40llm::{Context, DeviceBuffer};
/// let ctx = Context::cpu()?;
/// let mut buf = DeviceBuffer::from_slice(&ctx, &[1.0f32, 2.0, 3.0])?;
/// buf.slice_mut(1..).copy_from_host(&[5.0, 6.0])?;
/// assert_eq!(buf.to_vec()?, [1.0, 5.0, 6.0]);
/// buf.memset(0)?;
/// assert_eq!(buf.to_vec()?, [0.0; 3]);
/// # Ok::<(), m40llm::Error>(())
/// ```
pub struct DeviceBuffer<T: Element> {
    ptr: *mut T,
    len: usize,
    ctx: Context,
}

// SAFETY: the buffer owns its allocation (like a Box<[T]>); every library call on it holds the
// context's lock, and mutation needs `&mut self`.
unsafe impl<T: Element> Send for DeviceBuffer<T> {}
// SAFETY: `&self` methods only read the memory, through library calls that hold the lock.
unsafe impl<T: Element> Sync for DeviceBuffer<T> {}

fn bytes_for<T>(len: usize) -> Result<usize> {
    len.checked_mul(size_of::<T>()).ok_or_else(|| {
        Error::new(
            crate::Status::OutOfMemory,
            format!("{len} elements overflow usize bytes"),
        )
    })
}

impl<T: Element> DeviceBuffer<T> {
    /// Allocates `len` elements whose contents are unspecified.
    ///
    /// # Safety
    /// Reading the buffer (copying it to the host, or passing it as an input) before writing
    /// it yields whatever bytes the memory held. Every bit pattern is a valid `T`, so this
    /// cannot produce invalid values, but on the CPU backend it is a read of uninitialized host
    /// memory through C, which Rust does not define. Write the buffer before reading it.
    pub unsafe fn uninit(ctx: &Context, len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(DeviceBuffer {
                ptr: ptr::null_mut(),
                len: 0,
                ctx: ctx.clone(),
            });
        }
        let bytes = bytes_for::<T>(len)?;
        let mut p: *mut c_void = ptr::null_mut();
        {
            let _lock = ctx.lock();
            // SAFETY: valid out pointer and context; bytes > 0; the lock is held.
            check(unsafe { sys::m40llm_malloc(&mut p, ctx.as_raw(), bytes) })?;
        }
        Ok(DeviceBuffer {
            ptr: p.cast(),
            len,
            ctx: ctx.clone(),
        })
    }

    /// Allocates `len` elements set to all-zero bytes (`0.0` for floats).
    pub fn zeros(ctx: &Context, len: usize) -> Result<Self> {
        // SAFETY: the memset below initializes every byte before anyone can read it.
        let mut buf = unsafe { Self::uninit(ctx, len)? };
        buf.memset(0)?;
        Ok(buf)
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_slice(ctx: &Context, data: &[T]) -> Result<Self> {
        // SAFETY: the copy below initializes every element.
        let mut buf = unsafe { Self::uninit(ctx, data.len())? };
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The context whose memory this is.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Start of the allocation in backend memory (a device pointer for CUDA; null when empty).
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// Mutable start of the allocation in backend memory (null when empty).
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// A view of `range` of the elements.
    ///
    /// # Panics
    /// If the range is out of bounds or decreasing, as slicing a Rust slice would.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceSlice<'_, T> {
        DeviceSlice::of(self.ptr, self.len, &self.ctx, range)
    }

    /// A mutable view of `range` of the elements.
    ///
    /// # Panics
    /// If the range is out of bounds or decreasing.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut::of(self.ptr, self.len, &self.ctx, range)
    }
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            let _lock = self.ctx.lock();
            // SAFETY: allocated by m40llm_malloc on this context, freed once; the lock is held.
            // An error here (e.g. after a device fault) cannot be reported from drop.
            unsafe { sys::m40llm_free(self.ctx.as_raw(), self.ptr.cast()) };
        }
    }
}

impl<T: Element> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>({} elements at {:p})",
            T::NAME,
            self.len,
            self.ptr
        )
    }
}

/// A borrowed, read-only view of elements in backend memory; see [`DeviceBuffer::slice`].
///
/// Like `&[T]` it borrows what it views, and it is [`Send`] and [`Sync`].
pub struct DeviceSlice<'a, T: Element> {
    ptr: *const T,
    len: usize,
    ctx: &'a Context,
    _marker: PhantomData<&'a [T]>,
}

// SAFETY: a shared view, like `&[T]` (T is Send + Sync); library calls hold the context's lock.
unsafe impl<T: Element> Send for DeviceSlice<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Element> Sync for DeviceSlice<'_, T> {}

impl<T: Element> Clone for DeviceSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Element> Copy for DeviceSlice<'_, T> {}

impl<'a, T: Element> DeviceSlice<'a, T> {
    /// The view of `range` within `len` elements at `ptr` (panics like slicing a Rust slice).
    fn of(ptr: *const T, len: usize, ctx: &'a Context, range: impl RangeBounds<usize>) -> Self {
        let (start, len) = sub_range(range, len);
        DeviceSlice {
            ptr: ptr.wrapping_add(start),
            len,
            ctx,
            _marker: PhantomData,
        }
    }

    /// A view of memory that this crate did not allocate (e.g. your own `cudaMalloc`).
    ///
    /// # Safety
    /// `ptr` must be null with `len == 0`, or point to `len` initialized elements of `T` in
    /// `ctx`'s backend memory (device memory of its CUDA device and context, or host memory for
    /// the CPU backend) that stay valid and unwritten by others for `'a`.
    pub unsafe fn from_raw_parts(ctx: &'a Context, ptr: *const T, len: usize) -> Self {
        DeviceSlice {
            ptr,
            len,
            ctx,
            _marker: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the view in backend memory.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// The context whose memory this is.
    pub fn context(&self) -> &'a Context {
        self.ctx
    }

    /// A narrower view.
    ///
    /// # Panics
    /// If the range is out of bounds or decreasing.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceSlice<'a, T> {
        DeviceSlice::of(self.ptr, self.len, self.ctx, range)
    }
}

/// A borrowed, writable view of elements in backend memory; see [`DeviceBuffer::slice_mut`].
///
/// Like `&mut [T]` it borrows what it views exclusively, and it is [`Send`] and [`Sync`].
pub struct DeviceSliceMut<'a, T: Element> {
    ptr: *mut T,
    len: usize,
    ctx: &'a Context,
    _marker: PhantomData<&'a mut [T]>,
}

// SAFETY: an exclusive view, like `&mut [T]`; library calls hold the context's lock.
unsafe impl<T: Element> Send for DeviceSliceMut<'_, T> {}
// SAFETY: `&self` methods only read, through library calls that hold the lock.
unsafe impl<T: Element> Sync for DeviceSliceMut<'_, T> {}

impl<'a, T: Element> DeviceSliceMut<'a, T> {
    /// The writable view of `range` within `len` elements at `ptr` (panics like slicing).
    fn of(ptr: *mut T, len: usize, ctx: &'a Context, range: impl RangeBounds<usize>) -> Self {
        let (start, len) = sub_range(range, len);
        DeviceSliceMut {
            ptr: ptr.wrapping_add(start),
            len,
            ctx,
            _marker: PhantomData,
        }
    }

    /// A writable view of memory that this crate did not allocate.
    ///
    /// # Safety
    /// As [`DeviceSlice::from_raw_parts`], and nothing else may access the memory for `'a`.
    pub unsafe fn from_raw_parts(ctx: &'a Context, ptr: *mut T, len: usize) -> Self {
        DeviceSliceMut {
            ptr,
            len,
            ctx,
            _marker: PhantomData,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the view in backend memory.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// The context whose memory this is.
    pub fn context(&self) -> &'a Context {
        self.ctx
    }

    /// A read-only view of part of this one.
    ///
    /// # Panics
    /// If the range is out of bounds or decreasing.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceSlice<'_, T> {
        DeviceSlice::of(self.ptr, self.len, self.ctx, range)
    }

    /// A narrower writable view (reborrowing this one).
    ///
    /// # Panics
    /// If the range is out of bounds or decreasing.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut::of(self.ptr, self.len, self.ctx, range)
    }
}

fn sub_range(range: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.checked_add(1).expect("range start overflows"),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1).expect("range end overflows"),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end,
        "slice index starts at {start} but ends at {end}"
    );
    assert!(
        end <= len,
        "range end index {end} out of range for device slice of length {len}"
    );
    (start, end - start)
}

// ---- trait impls and the shared copy operations ----

/// `Sealed` and [`DeviceRead`] (and [`DeviceWrite`] with `mut`) for a borrowed view type with
/// fields `ptr` (`*const T` or `*mut T`), `len` and `ctx: &Context`.
macro_rules! device_view {
    ($ty:ty) => {
        impl<T: $crate::buffer::Element> $crate::buffer::private::Sealed for $ty {}
        impl<T: $crate::buffer::Element> $crate::buffer::DeviceRead<T> for $ty {
            fn device_ptr(&self) -> *const T {
                let p: *const T = self.ptr;
                p
            }
            fn len(&self) -> usize {
                self.len
            }
            fn context(&self) -> &$crate::context::Context {
                self.ctx
            }
        }
    };
    ($ty:ty, mut) => {
        device_view!($ty);
        impl<T: $crate::buffer::Element> $crate::buffer::DeviceWrite<T> for $ty {
            fn device_ptr_mut(&mut self) -> *mut T {
                self.ptr
            }
        }
    };
}
#[cfg(feature = "cudarc")]
pub(crate) use device_view;

impl<T: Element> private::Sealed for DeviceBuffer<T> {}
device_view!(DeviceSlice<'_, T>);
device_view!(DeviceSliceMut<'_, T>, mut);

impl<T: Element> DeviceRead<T> for DeviceBuffer<T> {
    fn device_ptr(&self) -> *const T {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn context(&self) -> &Context {
        &self.ctx
    }
}
impl<T: Element> DeviceWrite<T> for DeviceBuffer<T> {
    fn device_ptr_mut(&mut self) -> *mut T {
        self.ptr
    }
}

fn length_mismatch(what: &str, got: usize, want: usize) -> Error {
    Error::invalid(format!(
        "{what} has {got} elements, the device memory has {want}"
    ))
}

fn to_host<T: Element>(src: &impl DeviceRead<T>, dst: &mut [T]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(length_mismatch("the host slice", dst.len(), src.len()));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let ctx = src.context();
    let _lock = ctx.lock();
    // SAFETY: src covers len elements of backend memory of its context; dst is a host slice of
    // the same byte length; T accepts any bit pattern; the lock is held.
    check(unsafe {
        sys::m40llm_memcpy_to_host(
            ctx.as_raw(),
            dst.as_mut_ptr().cast(),
            src.device_ptr().cast(),
            std::mem::size_of_val(dst),
        )
    })
}

fn from_host<T: Element>(dst: &mut impl DeviceWrite<T>, src: &[T]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(length_mismatch("the host slice", src.len(), dst.len()));
    }
    if src.is_empty() {
        return Ok(());
    }
    let ctx = dst.context().clone();
    let _lock = ctx.lock();
    let ctx = ctx.as_raw();
    // SAFETY: dst covers len writable elements of backend memory; src is a host slice of the
    // same byte length; the lock is held.
    check(unsafe {
        sys::m40llm_memcpy_to_device(
            ctx,
            dst.device_ptr_mut().cast(),
            src.as_ptr().cast(),
            std::mem::size_of_val(src),
        )
    })
}

fn from_device<T: Element>(dst: &mut impl DeviceWrite<T>, src: &impl DeviceRead<T>) -> Result<()> {
    if !dst.context().same_as(src.context()) {
        return Err(Error::invalid(
            "the source and destination belong to different contexts",
        ));
    }
    if src.len() != dst.len() {
        return Err(length_mismatch("the source", src.len(), dst.len()));
    }
    if src.is_empty() {
        return Ok(());
    }
    let ctx = dst.context().clone();
    let _lock = ctx.lock();
    let ctx = ctx.as_raw();
    let bytes = src.len() * size_of::<T>();
    // SAFETY: both ranges lie in the context's backend memory and are len elements long. (They
    // cannot overlap unless created unsafely; the library copies with memmove semantics on the
    // CPU and cudaMemcpyAsync on the GPU.)
    check(unsafe {
        sys::m40llm_memcpy_device(
            ctx,
            dst.device_ptr_mut().cast(),
            src.device_ptr().cast(),
            bytes,
        )
    })
}

fn memset_bytes<T: Element>(dst: &mut impl DeviceWrite<T>, value: u8) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let ctx = dst.context().clone();
    let _lock = ctx.lock();
    let ctx = ctx.as_raw();
    let bytes = dst.len() * size_of::<T>();
    // SAFETY: dst covers len writable elements of backend memory; the lock is held.
    check(unsafe { sys::m40llm_memset(ctx, dst.device_ptr_mut().cast(), i32::from(value), bytes) })
}

macro_rules! read_ops {
    ($ty:ty) => {
        impl<T: Element> $ty {
            /// Copies the elements into `dst`, which must have the same length; waits for
            /// earlier work on the context's stream.
            pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
                to_host(self, dst)
            }

            /// Copies the elements into a new `Vec`; waits for earlier work on the stream.
            pub fn to_vec(&self) -> Result<Vec<T>> {
                let mut v = vec![T::default(); DeviceRead::len(self)];
                to_host(self, &mut v)?;
                Ok(v)
            }
        }
    };
}

macro_rules! write_ops {
    ($ty:ty) => {
        impl<T: Element> $ty {
            /// Copies `src` (same length) from host memory; returns when done.
            pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
                from_host(self, src)
            }

            /// Copies `src` (same length, same context) within backend memory, ordered on the
            /// context's stream.
            pub fn copy_from_device(&mut self, src: &impl DeviceRead<T>) -> Result<()> {
                from_device(self, src)
            }

            /// Sets every byte to `value` (so `memset(0)` zeroes), ordered on the stream.
            pub fn memset(&mut self, value: u8) -> Result<()> {
                memset_bytes(self, value)
            }
        }
    };
}

read_ops!(DeviceBuffer<T>);
read_ops!(DeviceSlice<'_, T>);
read_ops!(DeviceSliceMut<'_, T>);
write_ops!(DeviceBuffer<T>);
write_ops!(DeviceSliceMut<'_, T>);

impl<T: Element> fmt::Debug for DeviceSlice<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceSlice<{}>({} elements at {:p})",
            T::NAME,
            self.len,
            self.ptr
        )
    }
}

impl<T: Element> fmt::Debug for DeviceSliceMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceSliceMut<{}>({} elements at {:p})",
            T::NAME,
            self.len,
            self.ptr
        )
    }
}

/// Whether two runs of backend memory overlap (used to reject aliasing inputs and outputs).
pub(crate) fn overlaps<A: Element, B: Element>(
    a: &impl DeviceRead<A>,
    b: &impl DeviceRead<B>,
) -> bool {
    if a.is_empty() || b.is_empty() {
        return false;
    }
    let a0 = a.device_ptr() as usize;
    let a1 = a0 + a.len() * size_of::<A>();
    let b0 = b.device_ptr() as usize;
    let b1 = b0 + b.len() * size_of::<B>();
    a0 < b1 && b0 < a1
}
