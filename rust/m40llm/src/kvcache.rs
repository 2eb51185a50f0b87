//! The FP16 KV cache and decode-time attention.

use std::ffi::c_int;
use std::fmt;
use std::ptr::{self, NonNull};

use half::f16;
use m40llm_sys as sys;

use crate::buffer::{overlaps, DeviceBuffer, DeviceRead, DeviceWrite, Element, HalfElement};
use crate::context::Context;
use crate::error::{check, Error, Result};

/// How K and V are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum KvFormat {
    /// IEEE binary16, rounded to nearest even from FP32 (16 bits a value).
    #[default]
    F16,
    /// 8-bit codes, one FP16 scale per 32 dims of a token's head (8.5 bits a value): `x ≈ c·d`,
    /// `c = round(x / d)` in -127..=127, `d = fp16(max|x| / 127)`. Needs `head_dim % 32 == 0`.
    Q8,
    /// 4-bit codes, one FP16 (scale, min) pair per 32 dims (5 bits a value): `x ≈ c·d + m`,
    /// `c = round((x − m) / d)` in 0..=15, `d = fp16((max − min) / 15)`, `m = fp16(min)`.
    /// Needs `head_dim % 32 == 0`.
    Q4,
}

impl KvFormat {
    fn to_c(self) -> c_int {
        (match self {
            KvFormat::F16 => sys::M40LLM_KV_F16,
            KvFormat::Q8 => sys::M40LLM_KV_Q8,
            KvFormat::Q4 => sys::M40LLM_KV_Q4,
        }) as c_int
    }
}

/// The shape of a [`KvCache`]: built with [`KvCacheConfig::new`] and the setter methods.
///
/// ```
/// use m40llm::KvCacheConfig;
/// // 32 layers, 32 query heads sharing 8 K/V heads (GQA), head_dim 128, 4 sequences of 4096.
/// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).max_seqs(4).max_seq_len(4096);
/// assert_eq!(cfg.bytes_needed()?, 32 * 4 * 8 * 4096 * 128 * 2 * 2);
/// # Ok::<(), m40llm::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct KvCacheConfig {
    /// Layers (>= 1).
    pub n_layers: usize,
    /// Query heads (>= 1, a multiple of `n_kv_heads`).
    pub n_heads: usize,
    /// K/V heads (>= 1); `n_heads / n_kv_heads` query heads share one (GQA/MQA).
    pub n_kv_heads: usize,
    /// Elements per head, 1..=256; the CUDA backend needs a multiple of 8.
    pub head_dim: usize,
    /// Sequence slots (>= 1).
    pub max_seqs: usize,
    /// Positions per sequence (>= 1).
    pub max_seq_len: usize,
    /// Storage format of K, and of V unless `v_format` is set.
    pub format: KvFormat,
    /// Storage format of V, where it differs from K's (e.g. K [`KvFormat::Q8`], V
    /// [`KvFormat::Q4`]). The CPU backend takes any pair; the CUDA backend each format with
    /// itself and Q8 K with Q4 V.
    pub v_format: Option<KvFormat>,
}

impl KvCacheConfig {
    /// A config for multi-head attention (`n_kv_heads = n_heads`), one sequence of up to 2048
    /// positions. Adjust with the setters.
    pub fn new(n_layers: usize, n_heads: usize, head_dim: usize) -> Self {
        KvCacheConfig {
            n_layers,
            n_heads,
            n_kv_heads: n_heads,
            head_dim,
            max_seqs: 1,
            max_seq_len: 2048,
            format: KvFormat::F16,
            v_format: None,
        }
    }

    /// Sets the number of K/V heads (GQA when fewer than `n_heads`, MQA when 1).
    pub fn kv_heads(mut self, n_kv_heads: usize) -> Self {
        self.n_kv_heads = n_kv_heads;
        self
    }

    /// Sets the number of sequence slots.
    pub fn max_seqs(mut self, max_seqs: usize) -> Self {
        self.max_seqs = max_seqs;
        self
    }

    /// Sets the positions per sequence.
    pub fn max_seq_len(mut self, max_seq_len: usize) -> Self {
        self.max_seq_len = max_seq_len;
        self
    }

    /// Sets the storage format of K and V.
    pub fn format(mut self, format: KvFormat) -> Self {
        self.format = format;
        self
    }

    /// Sets V's storage format apart from K's.
    pub fn v_format(mut self, format: KvFormat) -> Self {
        self.v_format = Some(format);
        self
    }

    /// Elements of one query row, `n_heads * head_dim` (the length of `q` and `out` for one
    /// sequence in attention).
    pub fn q_row_len(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Elements of K (or V) for one token, `n_kv_heads * head_dim`.
    pub fn kv_row_len(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of backend memory a cache with this config holds (K plus V), without allocating.
    /// Validates the config like [`KvCache::new`] (except the CUDA head_dim rule).
    pub fn bytes_needed(&self) -> Result<usize> {
        let opts = self.to_raw()?;
        let mut bytes = 0usize;
        // SAFETY: valid pointers.
        check(unsafe { sys::m40llm_kvcache_bytes_needed(&mut bytes, &opts) })?;
        Ok(bytes)
    }

    /// Memory to leave free on the device beyond a cache's K/V planes for the library's own use
    /// (the attention workspace, the allocator's rounding, kernel code loaded at first use):
    /// a starting point for the `reserve` of
    /// [`max_seq_len_on_device`](Self::max_seq_len_on_device), to which you add what you will
    /// allocate yourself. 256 MiB.
    pub const DEVICE_RESERVE_DEFAULT: usize = sys::M40LLM_DEVICE_RESERVE_DEFAULT as usize;

    /// The largest `max_seq_len` (at most `i32::MAX`) whose cache, with the rest of this config,
    /// fits in `budget` bytes as [`bytes_needed`](Self::bytes_needed) counts them (K and V,
    /// every plane; not the attention workspace, weights or activations). `self.max_seq_len`
    /// is ignored. Fails with [`Status::Capacity`](crate::Status) when not even one position
    /// fits, and as `bytes_needed` does for a config it refuses.
    ///
    /// ```
    /// use m40llm::{KvCacheConfig, KvFormat};
    /// // Llama-3-8B's shape, K/V in Q8, one sequence, in 6 GiB.
    /// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).format(KvFormat::Q8);
    /// let len = cfg.max_seq_len_for_budget(6 << 30)?;
    /// assert_eq!(len, 92_521);
    /// assert!(cfg.max_seq_len(len).bytes_needed()? <= 6 << 30);
    /// assert!(cfg.max_seq_len(len + 1).bytes_needed()? > 6 << 30);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn max_seq_len_for_budget(&self, budget: usize) -> Result<usize> {
        let opts = self.planned().to_raw()?;
        let mut len: c_int = 0;
        // SAFETY: valid pointers.
        check(unsafe { sys::m40llm_kvcache_max_seq_len(&mut len, &opts, budget) })?;
        Ok(len as usize)
    }

    /// As [`max_seq_len_for_budget`](Self::max_seq_len_for_budget) with the budget `ctx`'s
    /// device has free now less `reserve` bytes (see
    /// [`DEVICE_RESERVE_DEFAULT`](Self::DEVICE_RESERVE_DEFAULT)), and the config checked against
    /// the backend as [`KvCache::new`] checks it. On the CPU backend, which has no device
    /// memory to plan against, fails with [`Status::Unsupported`](crate::Status).
    pub fn max_seq_len_on_device(&self, ctx: &Context, reserve: usize) -> Result<usize> {
        let opts = self.planned().to_raw()?;
        let mut len: c_int = 0;
        ctx.with_raw(|raw| {
            // SAFETY: valid pointers and context; with_raw holds the lock.
            check(unsafe {
                sys::m40llm_kvcache_max_seq_len_on_device(&mut len, raw, &opts, reserve)
            })
        })?;
        Ok(len as usize)
    }

    /// This config with a `max_seq_len` the planner ignores but the conversion to C accepts.
    fn planned(&self) -> KvCacheConfig {
        self.max_seq_len(1)
    }

    fn to_raw(self) -> Result<sys::m40llm_kvcache_options> {
        let mut o = sys::m40llm_kvcache_options::default();
        // SAFETY: valid out struct.
        check(unsafe {
            sys::m40llm_kvcache_options_init(&mut o, sys::M40LLM_KVCACHE_OPTIONS_VERSION)
        })?;
        o.n_layers = to_c(self.n_layers, "n_layers")?;
        o.n_heads = to_c(self.n_heads, "n_heads")?;
        o.n_kv_heads = to_c(self.n_kv_heads, "n_kv_heads")?;
        o.head_dim = to_c(self.head_dim, "head_dim")?;
        o.max_seqs = to_c(self.max_seqs, "max_seqs")?;
        o.max_seq_len = to_c(self.max_seq_len, "max_seq_len")?;
        o.format = self.format.to_c();
        o.v_format = self
            .v_format
            .map_or(sys::M40LLM_KV_SAME as c_int, KvFormat::to_c);
        Ok(o)
    }
}

fn to_c(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid(format!("{what} = {v} does not fit in a C int")))
}

/// Input element types for [`KvCache::append`]: `f32` (stored in the cache's formats on the
/// backend, rounded once), and `f16`/`u16` (an F16 cache stores them as is). Sealed.
pub trait KvInput: Element {
    /// Calls the library's append for this element type (used by [`KvCache::append`]).
    ///
    /// # Safety
    /// `cache` must be a live cache handle; `k` and `v` must each point to `n_tokens` rows of
    /// K/V in the backend memory of the cache's context.
    #[doc(hidden)]
    unsafe fn append_raw(
        cache: *mut sys::m40llm_kvcache,
        layer: c_int,
        seq: c_int,
        k: *const Self,
        v: *const Self,
        n_tokens: c_int,
    ) -> c_int;
}

impl KvInput for f32 {
    unsafe fn append_raw(
        cache: *mut sys::m40llm_kvcache,
        layer: c_int,
        seq: c_int,
        k: *const f32,
        v: *const f32,
        n_tokens: c_int,
    ) -> c_int {
        sys::m40llm_kvcache_append_f32(cache, layer, seq, k, v, n_tokens)
    }
}

impl KvInput for f16 {
    unsafe fn append_raw(
        cache: *mut sys::m40llm_kvcache,
        layer: c_int,
        seq: c_int,
        k: *const f16,
        v: *const f16,
        n_tokens: c_int,
    ) -> c_int {
        // f16 is #[repr(transparent)] over u16 (its bit pattern).
        sys::m40llm_kvcache_append_f16(cache, layer, seq, k.cast(), v.cast(), n_tokens)
    }
}

impl KvInput for u16 {
    unsafe fn append_raw(
        cache: *mut sys::m40llm_kvcache,
        layer: c_int,
        seq: c_int,
        k: *const u16,
        v: *const u16,
        n_tokens: c_int,
    ) -> c_int {
        sys::m40llm_kvcache_append_f16(cache, layer, seq, k, v, n_tokens)
    }
}

/// K and V for `n_layers x max_seqs` sequences of up to `max_seq_len` positions, in the
/// context's backend memory, with decode-time attention over them.
///
/// Storage layout (per K and per V): `[layer][seq][kv_head][pos][dim]`. Lengths are kept per
/// `(layer, sequence)`: an append to one layer advances only that layer. All buffers passed in
/// must belong to the same context as the cache; every length is checked before the library is
/// called, so a wrong-sized buffer is an [`Error`] with
/// [`Status::InvalidArgument`](crate::Status), never a GPU fault.
///
/// The cache keeps a handle to its [`Context`] (so the context lives at least as long as the
/// cache, whatever the drop order) and has no lifetime parameter. It is [`Send`] and [`Sync`]:
/// every library call holds the context's lock (the C library forbids concurrent calls on a
/// context and its caches), and methods that change contents or lengths take `&mut self`, so
/// share a cache between threads that append as `Mutex<KvCache>` (or `RwLock`: attention and
/// reads take `&self`).
///
/// ```
/// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
/// let ctx = Context::cpu()?;
/// let cfg = KvCacheConfig::new(1, 2, 4).max_seqs(2).max_seq_len(16);
/// let mut kv = KvCache::new(&ctx, &cfg)?;
/// // Append 3 tokens of K and V ([token][kv_head][dim], FP32) to layer 0, sequence 1.
/// let k = DeviceBuffer::from_slice(&ctx, &[0.5f32; 3 * 2 * 4])?;
/// let v = DeviceBuffer::from_slice(&ctx, &[1.0f32; 3 * 2 * 4])?;
/// kv.append_tokens(0, 1, 3, &k, &v)?;
/// assert_eq!(kv.seq_len(0, 1)?, 3);
/// // Attention of one query row ([head][dim]) against those 3 positions.
/// let q = DeviceBuffer::from_slice(&ctx, &[0.1f32; 2 * 4])?;
/// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * 4)?;
/// kv.attention(0, 1, &q, &mut out, None)?;
/// assert_eq!(out.to_vec()?, [1.0; 8]); // every V row is 1.0
/// // A wrong-sized buffer is an error, not a crash.
/// let short = DeviceBuffer::<f32>::zeros(&ctx, 3)?;
/// assert!(kv.attention(0, 1, &short, &mut out, None).is_err());
/// # Ok::<(), m40llm::Error>(())
/// ```
pub struct KvCache {
    raw: NonNull<sys::m40llm_kvcache>,
    ctx: Context,
    config: KvCacheConfig,
}

// SAFETY: the cache handle may be used from any thread as long as calls on its context do not
// run concurrently; every call through `KvCache` holds the context's lock, and the handle is
// destroyed once, in `drop`, under that lock.
unsafe impl Send for KvCache {}
// SAFETY: as above; `&self` methods only read the cache, and they also hold the lock.
unsafe impl Sync for KvCache {}

impl KvCache {
    /// Allocates a cache on `ctx`'s backend with every sequence empty. The cache keeps a handle
    /// to `ctx` (a clone).
    pub fn new(ctx: &Context, config: &KvCacheConfig) -> Result<Self> {
        let opts = config.to_raw()?;
        let mut raw = ptr::null_mut();
        {
            let _lock = ctx.lock();
            // SAFETY: valid out pointer, context and options; the lock is held.
            check(unsafe { sys::m40llm_kvcache_create(&mut raw, ctx.as_raw(), &opts) })?;
        }
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::invalid("m40llm_kvcache_create returned null"))?;
        Ok(KvCache {
            raw,
            ctx: ctx.clone(),
            config: *config,
        })
    }

    /// Runs one library call on the cache with the context's lock held and checks its status.
    fn call(&self, f: impl FnOnce(*mut sys::m40llm_kvcache) -> c_int) -> Result<()> {
        let _lock = self.ctx.lock();
        check(f(self.raw.as_ptr()))
    }

    /// The cache's shape.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The context the cache lives in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The raw handle, for calling `m40llm_sys` directly. It stays owned by `self`. Make raw
    /// calls inside [`Context::with_raw`] on [`context`](Self::context), which holds the lock.
    pub fn as_raw(&self) -> *mut sys::m40llm_kvcache {
        self.raw.as_ptr()
    }

    fn layer(&self, layer: usize) -> Result<c_int> {
        if layer >= self.config.n_layers {
            return Err(Error::out_of_range(format!(
                "layer {layer} is outside 0..{}",
                self.config.n_layers
            )));
        }
        Ok(layer as c_int)
    }

    fn seq(&self, what: &str, seq: usize) -> Result<c_int> {
        if seq >= self.config.max_seqs {
            return Err(Error::out_of_range(format!(
                "{what} {seq} is outside 0..{}",
                self.config.max_seqs
            )));
        }
        Ok(seq as c_int)
    }

    fn same_context<T: Element>(&self, what: &str, buf: &impl DeviceRead<T>) -> Result<()> {
        if buf.context().same_as(&self.ctx) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what} belongs to a different context than the cache"
            )))
        }
    }

    /// Number of positions stored for `(layer, seq)`.
    pub fn seq_len(&self, layer: usize, seq: usize) -> Result<usize> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let mut len: c_int = 0;
        // SAFETY: valid out pointer and cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_seq_len(&mut len, c, l, s) })?;
        Ok(len.max(0) as usize)
    }

    /// Empties `seq` in every layer.
    pub fn reset(&mut self, seq: usize) -> Result<()> {
        let s = self.seq("seq", seq)?;
        // SAFETY: valid cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_seq_reset(c, s) })
    }

    /// Keeps the first `new_len` positions of `seq` in every layer (shorter layers keep their
    /// length).
    pub fn truncate(&mut self, seq: usize, new_len: usize) -> Result<()> {
        let s = self.seq("seq", seq)?;
        // Lengths never exceed max_seq_len, which fits a C int, so clamping keeps the meaning.
        let n = new_len.min(c_int::MAX as usize) as c_int;
        // SAFETY: valid cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_seq_truncate(c, s, n) })
    }

    /// Makes `dst` a copy of `src` in every layer (contents and lengths), e.g. to branch a
    /// shared prompt. `dst`'s old contents are dropped; `dst != src`.
    pub fn fork(&mut self, dst: usize, src: usize) -> Result<()> {
        let (d, s) = (self.seq("dst", dst)?, self.seq("src", src)?);
        if d == s {
            return Err(Error::invalid(format!("fork: dst and src are both {dst}")));
        }
        // SAFETY: valid cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_seq_fork(c, d, s) })
    }

    /// Appends tokens to `(layer, seq)` and returns how many. `k` and `v` hold
    /// `[n_tokens][n_kv_heads][head_dim]` elements, `f32` (rounded to FP16) or `f16`/`u16`
    /// (stored as is); `n_tokens` is inferred as their length divided by
    /// [`KvCacheConfig::kv_row_len`] (`n_kv_heads × head_dim`), and a length that is not a
    /// positive whole multiple of it is an error. Fails with [`Status::Capacity`](crate::Status),
    /// writing nothing, if the sequence would pass `max_seq_len`.
    ///
    /// Inferring the count cannot catch every mistake: with GQA, a K row of
    /// `n_heads × head_dim` values (a query-shaped row) is a whole multiple of the K/V row and
    /// would be stored as `n_heads / n_kv_heads` tokens. When you know the token count, prefer
    /// [`append_tokens`](Self::append_tokens) or [`append_token`](Self::append_token), which
    /// check the length exactly.
    pub fn append<T: KvInput>(
        &mut self,
        layer: usize,
        seq: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<usize> {
        let row = self.config.kv_row_len();
        self.check_kv_pair(k, v)?;
        if k.is_empty() || k.len() % row != 0 {
            return Err(Error::invalid(format!(
                "k and v have {} elements, not a positive whole multiple of one token's K/V row, \
                 n_kv_heads × head_dim = {} × {} = {row}",
                k.len(),
                self.config.n_kv_heads,
                self.config.head_dim
            )));
        }
        let n_tokens = k.len() / row;
        self.append_raw(layer, seq, n_tokens, k, v)?;
        Ok(n_tokens)
    }

    /// Appends exactly `n_tokens` tokens to `(layer, seq)`: `k` and `v` must each hold
    /// `n_tokens × n_kv_heads × head_dim` elements (`[n_tokens][n_kv_heads][head_dim]`), else
    /// the call fails with [`Status::InvalidArgument`](crate::Status) and a message naming
    /// `n_kv_heads × head_dim` (and the GQA mix-up, when the buffer is `n_heads × head_dim`
    /// per token). Element types and capacity as [`append`](Self::append).
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig, Status};
    /// let ctx = Context::cpu()?;
    /// // GQA: 8 query heads share 2 K/V heads of 4 elements.
    /// let cfg = KvCacheConfig::new(1, 8, 4).kv_heads(2).max_seq_len(16);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.5f32; 2 * 2 * 4])?; // 2 tokens
    /// kv.append_tokens(0, 0, 2, &k, &k)?;
    /// // A query-shaped row (n_heads × head_dim = 32 values) is not one token of K.
    /// let wrong = DeviceBuffer::from_slice(&ctx, &[0.5f32; 8 * 4])?;
    /// let e = kv.append_token(0, 0, &wrong, &wrong).unwrap_err();
    /// assert_eq!(e.status(), Status::InvalidArgument);
    /// assert!(e.message().contains("n_kv_heads × head_dim"), "{e}");
    /// assert_eq!(kv.seq_len(0, 0)?, 2);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn append_tokens<T: KvInput>(
        &mut self,
        layer: usize,
        seq: usize,
        n_tokens: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        let cfg = &self.config;
        let row = cfg.kv_row_len();
        if n_tokens == 0 {
            return Err(Error::invalid("n_tokens must be >= 1"));
        }
        let want = n_tokens
            .checked_mul(row)
            .ok_or_else(|| Error::invalid(format!("n_tokens = {n_tokens} is too large")))?;
        for (what, got) in [("k", k.len()), ("v", v.len())] {
            if got != want {
                let mut msg = format!(
                    "{what} has {got} elements, expected {n_tokens} token(s) × n_kv_heads × \
                     head_dim = {n_tokens} × {} × {} = {want}",
                    cfg.n_kv_heads, cfg.head_dim
                );
                if cfg.n_kv_heads != cfg.n_heads
                    && Some(got) == n_tokens.checked_mul(cfg.q_row_len())
                {
                    msg.push_str(&format!(
                        " ({got} is n_tokens × n_heads × head_dim: K and V rows have n_kv_heads = \
                         {} heads, not n_heads = {})",
                        cfg.n_kv_heads, cfg.n_heads
                    ));
                }
                return Err(Error::invalid(msg));
            }
        }
        self.check_kv_pair(k, v)?;
        self.append_raw(layer, seq, n_tokens, k, v)
    }

    /// Appends one token to `(layer, seq)`: [`append_tokens`](Self::append_tokens) with
    /// `n_tokens = 1`, so `k` and `v` must each hold exactly `n_kv_heads × head_dim` elements
    /// (the usual decode step).
    pub fn append_token<T: KvInput>(
        &mut self,
        layer: usize,
        seq: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        self.append_tokens(layer, seq, 1, k, v)
    }

    /// Same context, same length.
    fn check_kv_pair<T: KvInput>(
        &self,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        self.same_context("k", k)?;
        self.same_context("v", v)?;
        if k.len() != v.len() {
            return Err(Error::invalid(format!(
                "k has {} elements but v has {}",
                k.len(),
                v.len()
            )));
        }
        Ok(())
    }

    /// The library's append; `k` and `v` hold exactly `n_tokens` rows (checked by the caller).
    fn append_raw<T: KvInput>(
        &mut self,
        layer: usize,
        seq: usize,
        n_tokens: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        debug_assert_eq!(k.len(), n_tokens * self.config.kv_row_len());
        debug_assert_eq!(v.len(), k.len());
        let n = to_c(n_tokens, "n_tokens")?;
        let (kp, vp) = (k.device_ptr(), v.device_ptr());
        // SAFETY: k and v each cover n_tokens rows of backend memory of this cache's context.
        self.call(|c| unsafe { T::append_raw(c, l, s, kp, vp, n) })
    }

    fn check_read_out<T: HalfElement>(
        &self,
        what: &str,
        out: &impl DeviceRead<T>,
    ) -> Result<usize> {
        self.same_context(what, out)?;
        let row = self.config.kv_row_len();
        if out.is_empty() || out.len() % row != 0 {
            return Err(Error::invalid(format!(
                "{what} has {} elements: expected a positive multiple of n_kv_heads * head_dim = {row}",
                out.len()
            )));
        }
        Ok(out.len() / row)
    }

    fn read_raw(
        &self,
        k: *mut u16,
        v: *mut u16,
        layer: usize,
        seq: usize,
        pos: usize,
        n_tokens: usize,
    ) -> Result<()> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let p = to_c(pos, "pos")?;
        let n = to_c(n_tokens, "n_tokens")?;
        // SAFETY: each non-null output covers n_tokens rows of backend memory of this context;
        // the library checks pos + n_tokens against the sequence length.
        self.call(|c| unsafe { sys::m40llm_kvcache_read_f16(k, v, c, l, s, p, n) })
    }

    /// Copies positions `pos..pos + n` of `(layer, seq)` out as FP16 (for Q8/Q4 the dequantized
    /// values) into `k_out` and `v_out`
    /// (`[n][n_kv_heads][head_dim]` each, same length; `n` follows from it). The positions must
    /// be below the sequence's length.
    pub fn read_f16<T: HalfElement>(
        &self,
        layer: usize,
        seq: usize,
        pos: usize,
        k_out: &mut impl DeviceWrite<T>,
        v_out: &mut impl DeviceWrite<T>,
    ) -> Result<()> {
        let n = self.check_read_out("k_out", k_out)?;
        if v_out.len() != k_out.len() {
            return Err(Error::invalid(format!(
                "k_out has {} elements but v_out has {}",
                k_out.len(),
                v_out.len()
            )));
        }
        self.same_context("v_out", v_out)?;
        if overlaps(k_out, v_out) {
            return Err(Error::invalid("k_out and v_out overlap"));
        }
        self.read_raw(
            k_out.device_ptr_mut().cast(),
            v_out.device_ptr_mut().cast(),
            layer,
            seq,
            pos,
            n,
        )
    }

    /// As [`read_f16`](Self::read_f16) for K only.
    pub fn read_k_f16<T: HalfElement>(
        &self,
        layer: usize,
        seq: usize,
        pos: usize,
        k_out: &mut impl DeviceWrite<T>,
    ) -> Result<()> {
        let n = self.check_read_out("k_out", k_out)?;
        self.read_raw(
            k_out.device_ptr_mut().cast(),
            ptr::null_mut(),
            layer,
            seq,
            pos,
            n,
        )
    }

    /// As [`read_f16`](Self::read_f16) for V only.
    pub fn read_v_f16<T: HalfElement>(
        &self,
        layer: usize,
        seq: usize,
        pos: usize,
        v_out: &mut impl DeviceWrite<T>,
    ) -> Result<()> {
        let n = self.check_read_out("v_out", v_out)?;
        self.read_raw(
            ptr::null_mut(),
            v_out.device_ptr_mut().cast(),
            layer,
            seq,
            pos,
            n,
        )
    }

    /// Reads positions `pos..pos + n_tokens` of `(layer, seq)` into host vectors `(K, V)`,
    /// each `[n_tokens][n_kv_heads][head_dim]` (for tests and debugging; allocates).
    pub fn read_to_host(
        &self,
        layer: usize,
        seq: usize,
        pos: usize,
        n_tokens: usize,
    ) -> Result<(Vec<f16>, Vec<f16>)> {
        let len = n_tokens
            .checked_mul(self.config.kv_row_len())
            .ok_or_else(|| Error::invalid("n_tokens is too large"))?;
        if len == 0 {
            return Err(Error::invalid("n_tokens must be >= 1"));
        }
        // SAFETY: read_f16 writes every element before they are copied out; if it fails the
        // buffers are dropped unread.
        let (mut k, mut v) = unsafe {
            (
                DeviceBuffer::<f16>::uninit(&self.ctx, len)?,
                DeviceBuffer::<f16>::uninit(&self.ctx, len)?,
            )
        };
        self.read_f16(layer, seq, pos, &mut k, &mut v)?;
        Ok((k.to_vec()?, v.to_vec()?))
    }

    /// Attention of one new query token against every cached position of `(layer, seq)`:
    /// `out[h] = softmax(scale * q[h] · K[g]ᵀ) V[g]` with `g = h / (n_heads / n_kv_heads)`.
    ///
    /// `q` and `out` are `[n_heads][head_dim]` FP32 ([`KvCacheConfig::q_row_len`] elements)
    /// and must not overlap. `scale` `None` means `1/sqrt(head_dim)`; a given scale must be
    /// finite and non-zero. A sequence with no positions yields zeros. Sums are FP32; on sm_80+
    /// builds (head_dim a multiple of 16 up to 128) the products run on tensor cores with q
    /// split into two FP16 terms (see `m40llm_kvcache_attn_last_token_f32q` in `m40llm.h`).
    pub fn attention(
        &self,
        layer: usize,
        seq: usize,
        q: &impl DeviceRead<f32>,
        out: &mut impl DeviceWrite<f32>,
        scale: Option<f32>,
    ) -> Result<()> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let scale = self.check_attention(1, q, out, scale)?;
        // SAFETY: q and out cover one query row each in this context's memory and don't overlap.
        let out = out.device_ptr_mut();
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_last_token_f32q(out, c, l, s, q.device_ptr(), scale)
        })
    }

    /// [`attention`](Self::attention) for several sequences at once (one launch over their
    /// ragged lengths): row `i` of `q` and `out` (`[seq_ids.len()][n_heads][head_dim]`) belongs
    /// to `seq_ids[i]`. Repeated ids are allowed.
    pub fn attention_batch(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &impl DeviceRead<f32>,
        out: &mut impl DeviceWrite<f32>,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        if seq_ids.is_empty() {
            return Err(Error::invalid("seq_ids is empty"));
        }
        let ids = seq_ids
            .iter()
            .map(|&s| self.seq("seq id", s))
            .collect::<Result<Vec<c_int>>>()?;
        let n = to_c(ids.len(), "seq_ids.len()")?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        // SAFETY: q and out cover ids.len() query rows each in this context's memory and don't
        // overlap; ids is a host array of n valid sequence indices.
        let out = out.device_ptr_mut();
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_batch_f32q(out, c, l, ids.as_ptr(), n, q.device_ptr(), scale)
        })
    }

    fn check_attention(
        &self,
        rows: usize,
        q: &impl DeviceRead<f32>,
        out: &impl DeviceRead<f32>,
        scale: Option<f32>,
    ) -> Result<f32> {
        self.same_context("q", q)?;
        self.same_context("out", out)?;
        let want = rows
            .checked_mul(self.config.q_row_len())
            .ok_or_else(|| Error::invalid("too many rows"))?;
        for (what, got) in [("q", q.len()), ("out", out.len())] {
            if got != want {
                return Err(Error::invalid(format!(
                    "{what} has {got} elements, expected {want} ({rows} row(s) of n_heads {} x head_dim {})",
                    self.config.n_heads, self.config.head_dim
                )));
            }
        }
        if overlaps(q, out) {
            return Err(Error::invalid("q and out overlap"));
        }
        match scale {
            None => Ok(0.0),
            Some(s) if s.is_finite() && s != 0.0 => Ok(s),
            Some(s) => Err(Error::invalid(format!(
                "scale {s} must be finite and non-zero (None means 1/sqrt(head_dim))"
            ))),
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        let _lock = self.ctx.lock();
        // SAFETY: owned handle, destroyed once, before its context (the cache holds a handle
        // to it); the lock is held.
        unsafe { sys::m40llm_kvcache_destroy(self.raw.as_ptr()) }
    }
}

impl fmt::Debug for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCache")
            .field("config", &self.config)
            .field("raw", &self.raw)
            .finish()
    }
}
