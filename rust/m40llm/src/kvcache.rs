//! The FP16 KV cache and decode-time attention.

use std::ffi::c_int;
use std::fmt;
use std::ptr::{self, NonNull};

use half::{bf16, f16};
use m40llm_sys as sys;

use crate::buffer::{
    overlaps, DeviceBuffer, DeviceRead, DeviceWrite, Element, HalfElement, IoElement,
};
use crate::context::Context;
use crate::error::{check, Error, Result, Status};

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
    /// V only: 3-bit codes, one FP16 (scale, min) pair per 32 dims (4 bits a value), as
    /// [`KvFormat::Q4`] with codes in 0..=7 and `d = fp16((max − min) / 7)`. K may not use it
    /// (K is the sensitive half: 3-bit K costs more than it saves against V in 3 or 2 bits at
    /// the same bytes, see the C header): a config whose `format` is Q3 is refused with
    /// [`Status::InvalidArgument`]; set it as [`KvCacheConfig::v_format`]. The CUDA backend
    /// has kernels for it with K in [`KvFormat::Q4`] (other K formats: [`Status::Unsupported`]
    /// at creation).
    Q3,
    /// V only: 2-bit codes, one FP16 (scale, min) pair per 32 dims (3 bits a value), as
    /// [`KvFormat::Q4`] with codes in 0..=3 and `d = fp16((max − min) / 3)`. K may not use it;
    /// the CUDA backend has it with K in Q4, as [`KvFormat::Q3`].
    Q2,
}

impl KvFormat {
    fn to_c(self) -> c_int {
        (match self {
            KvFormat::F16 => sys::M40LLM_KV_F16,
            KvFormat::Q8 => sys::M40LLM_KV_Q8,
            KvFormat::Q4 => sys::M40LLM_KV_Q4,
            KvFormat::Q3 => sys::M40LLM_KV_Q3,
            KvFormat::Q2 => sys::M40LLM_KV_Q2,
        }) as c_int
    }

    fn from_c(raw: c_int) -> Option<KvFormat> {
        [
            KvFormat::F16,
            KvFormat::Q8,
            KvFormat::Q4,
            KvFormat::Q3,
            KvFormat::Q2,
        ]
        .into_iter()
        .find(|f| f.to_c() == raw)
    }
}

/// How K and V are rotated before they are quantized (`m40llm_kv_rotation`).
///
/// The rotation is the normalized Walsh-Hadamard transform over blocks of `b` dims, `b` the
/// largest power of two dividing `head_dim` (the whole head at 32, 64, 128, 256): butterfly
/// stages `(x[i], x[i + h]) → (x[i] + x[i + h], x[i] − x[i + h])` for `h = 1, 2, 4, ..`, then
/// every element times `1/√b`, in FP32. It is orthogonal and its own inverse, so `q·k` and the
/// attention output are unchanged, while outlier channels are spread over the block before the
/// per-32-dim quantizer sees them: a smaller quantization error for the same bits.
///
/// Appended K (and V) rows are rotated in FP32 before they are quantized; attention rotates `q`
/// and, for a rotated V, rotates its output back; [`KvCache::read_f16`] returns rows rotated
/// back. A tensor stored [`KvFormat::F16`] is never rotated. Rotation takes no memory.
///
/// ```
/// use m40llm::{KvCacheConfig, KvFormat, KvRotation};
/// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).format(KvFormat::Q4);
/// // The library's default, read from m40llm_kvcache_options_init at run time.
/// println!("default rotation: {:?}", cfg.rotation);
/// let unrotated = cfg.rotation(KvRotation::None);
/// assert_eq!(unrotated.bytes_needed()?, cfg.bytes_needed()?);
/// # Ok::<(), m40llm::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvRotation {
    /// The library's choice (`M40LLM_ROTATE_AUTO`): today every quantized tensor, as
    /// [`KvRotation::KV`].
    Auto,
    /// No rotation (`M40LLM_ROTATE_NONE`): what caches made before rotation existed do.
    None,
    /// K where it is quantized; V is not rotated (`M40LLM_ROTATE_K`).
    K,
    /// K and V, each where it is quantized (`M40LLM_ROTATE_KV`).
    KV,
    /// A raw `m40llm_kv_rotation` value this crate does not name ([`from_raw`](Self::from_raw)
    /// never gives it for a value it names). It is passed to the library as is, which refuses
    /// values it does not know with [`Status::InvalidArgument`](crate::Status) and its message.
    Unknown(i32),
}

impl KvRotation {
    /// The library's value (`m40llm_kv_rotation`).
    pub fn to_raw(self) -> i32 {
        match self {
            KvRotation::Auto => sys::M40LLM_ROTATE_AUTO as i32,
            KvRotation::None => sys::M40LLM_ROTATE_NONE as i32,
            KvRotation::K => sys::M40LLM_ROTATE_K as i32,
            KvRotation::KV => sys::M40LLM_ROTATE_KV as i32,
            KvRotation::Unknown(raw) => raw,
        }
    }

    /// The rotation of a library value; [`KvRotation::Unknown`] for values this crate does not
    /// name.
    pub fn from_raw(raw: i32) -> KvRotation {
        [
            KvRotation::Auto,
            KvRotation::None,
            KvRotation::K,
            KvRotation::KV,
        ]
        .into_iter()
        .find(|r| r.to_raw() == raw)
        .unwrap_or(KvRotation::Unknown(raw))
    }
}

/// A tier of a tiered cache ([`KvCacheConfig::tiers`]): a (K, V) pair of quantized formats
/// (K [`KvFormat::Q8`] or [`KvFormat::Q4`]; V those or [`KvFormat::Q3`], [`KvFormat::Q2`]) and
/// the rows it holds per (layer, sequence), every K/V head of a row together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvTier {
    /// K's format.
    pub k_format: KvFormat,
    /// V's format.
    pub v_format: KvFormat,
    /// Rows per (layer, sequence).
    pub rows: usize,
}

impl KvTier {
    /// A tier of `rows` rows in these formats.
    pub fn new(k_format: KvFormat, v_format: KvFormat, rows: usize) -> Self {
        KvTier {
            k_format,
            v_format,
            rows,
        }
    }
}

/// Where a tiered cache puts a row that leaves the FP16 window
/// ([`KvCacheConfig::placement`]; `m40llm_tier_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum TierPlacement {
    /// The first tier with a free row (`M40LLM_PLACE_FIRST_FREE`): the oldest rows hold the
    /// first tiers' formats.
    #[default]
    FirstFree,
    /// By importance (`M40LLM_PLACE_IMPORTANCE`): the cache keeps each row's importance from
    /// the weights of its [`KvCache::attention_observe`] calls (the largest over the query
    /// heads, summed, over the number of calls that saw the row). A row leaving the window goes
    /// to the first tier that has a free row or whose least important row is less important
    /// (by the factor `1 +` [`KvCacheConfig::demote_margin`]); that row moves one tier down
    /// (re-quantized), and so on to a tier with room. Rows only move down. See
    /// `m40llm_tier_placement` in `m40llm.h`.
    Importance,
}

impl TierPlacement {
    fn to_raw(self) -> c_int {
        match self {
            TierPlacement::FirstFree => sys::M40LLM_PLACE_FIRST_FREE as c_int,
            TierPlacement::Importance => sys::M40LLM_PLACE_IMPORTANCE as c_int,
        }
    }

    fn from_raw(raw: c_int) -> Result<TierPlacement> {
        [TierPlacement::FirstFree, TierPlacement::Importance]
            .into_iter()
            .find(|p| p.to_raw() == raw)
            .ok_or_else(|| {
                Error::new(
                    Status::Unsupported,
                    format!("the library returned placement {raw}, which this crate does not know"),
                )
            })
    }
}

/// What a tiered cache holds ([`KvCache::tier_stats`]), over all its layers and sequences. A
/// row is one position of one (layer, sequence): its K and V, all K/V heads.
#[derive(Clone, Debug, PartialEq)]
pub struct TierStats {
    /// Rows each tier holds.
    pub rows: Vec<u64>,
    /// Rows each tier has room for still.
    pub free_rows: Vec<u64>,
    /// Positions read from FP16 slots (sinks, windows).
    pub kept_rows: u64,
    /// Stored bits per K/V value over every position held (each tier's codes and parameters
    /// and its 4-byte slot map entry a row, 16 for a kept row); 0 while the cache holds no
    /// position.
    pub bits_per_value: f64,
    /// Rows [`KvCache::tier_move`] has moved since the cache was created.
    pub moved_rows: u64,
    /// Rows [`TierPlacement::Importance`] has moved a tier down to make room.
    pub demoted_rows: u64,
    /// Observe calls made since the cache was created, a layer's call counting once: the
    /// caller's [`KvCache::attention_observe`] calls and the cache's own
    /// ([`KvCacheConfig::observe_interval`]).
    pub observe_calls: u64,
}

/// The most tiers a cache has (`M40LLM_MAX_TIERS`).
pub const MAX_TIERS: usize = sys::M40LLM_MAX_TIERS as usize;

/// The shape of a [`KvCache`] and how it stores K/V: built with [`KvCacheConfig::new`] and the
/// setter methods. Fields the setters do not name take the library's defaults
/// (`m40llm_kvcache_options_init`).
///
/// ```
/// use m40llm::KvCacheConfig;
/// // 32 layers, 32 query heads sharing 8 K/V heads (GQA), head_dim 128, 4 sequences of 4096.
/// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).max_seqs(4).max_seq_len(4096);
/// assert_eq!(cfg.bytes_needed()?, 32 * 4 * 8 * 4096 * 128 * 2 * 2);
/// # Ok::<(), m40llm::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
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
    /// [`KvFormat::Q4`]). The CPU backend takes any pair with K in F16, Q8 or Q4; the CUDA
    /// backend each of F16, Q8 and Q4 with itself, Q8 K with Q4 V, and Q4 K with Q3 or Q2 V.
    pub v_format: Option<KvFormat>,
    /// How quantized K and V are rotated before they are quantized (see [`KvRotation`]).
    /// Defaults to the library's default, read at run time by [`KvCacheConfig::new`].
    pub rotation: KvRotation,
    /// Protected tokens: attention sinks, the first `n_sinks` positions of each sequence, kept
    /// in FP16 beside their quantized values. See [`sinks`](Self::sinks). Defaults to the
    /// library's default, read at run time by [`KvCacheConfig::new`].
    pub n_sinks: usize,
    /// Protected tokens: the most recent `window` positions of each sequence (the newest
    /// included), kept in FP16 beside their quantized values. See [`window`](Self::window).
    /// Defaults to the library's default, read at run time by [`KvCacheConfig::new`].
    pub window: usize,
    /// Tiers (see [`tiers`](Self::tiers)); none by default.
    pub tiers: [Option<KvTier>; MAX_TIERS],
    /// How many tiers [`tiers`](Self::tiers) was given (more than [`MAX_TIERS`] is refused
    /// when the config is used).
    pub n_tiers: usize,
    /// Where a row leaving the window goes (see [`placement`](Self::placement)).
    pub placement: TierPlacement,
    /// With [`TierPlacement::Importance`], a plain attention call observes where one of its
    /// sequences is due, on that sequence's every `observe_interval`-th plain call of the layer
    /// (see [`observe_interval`](Self::observe_interval)). Defaults to the library's default,
    /// read at run time by [`KvCacheConfig::new`].
    pub observe_interval: usize,
    /// With [`TierPlacement::Importance`], the placement's hysteresis (see
    /// [`demote_margin`](Self::demote_margin)); 0 by default. Configs compare and hash it by
    /// its bits (-0.0 as 0.0).
    pub demote_margin: f32,
}

/// [`KvCacheConfig`]'s fields as `==` and `hash` see them (the margin as its bits).
type ConfigKey = (
    (usize, usize, usize, usize, usize, usize),
    (KvFormat, Option<KvFormat>, KvRotation, usize, usize),
    (
        [Option<KvTier>; MAX_TIERS],
        usize,
        TierPlacement,
        usize,
        u32,
    ),
);

impl KvCacheConfig {
    /// Every field, the margin as its bits: what `==` and `hash` compare. The pattern names
    /// every field, so that a new one cannot be left out.
    fn key(&self) -> ConfigKey {
        let KvCacheConfig {
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            max_seqs,
            max_seq_len,
            format,
            v_format,
            rotation,
            n_sinks,
            window,
            tiers,
            n_tiers,
            placement,
            observe_interval,
            demote_margin,
        } = *self;
        (
            (
                n_layers,
                n_heads,
                n_kv_heads,
                head_dim,
                max_seqs,
                max_seq_len,
            ),
            (format, v_format, rotation, n_sinks, window),
            (
                tiers,
                n_tiers,
                placement,
                observe_interval,
                (demote_margin + 0.0).to_bits(), // -0.0 + 0.0 is 0.0
            ),
        )
    }
}

impl PartialEq for KvCacheConfig {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for KvCacheConfig {}

impl std::hash::Hash for KvCacheConfig {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl KvCacheConfig {
    /// A config for multi-head attention (`n_kv_heads = n_heads`), one sequence of up to 2048
    /// positions, K and V in FP16. Rotation and protected tokens take the library's defaults
    /// (`m40llm_kvcache_options_init` of the current options version). Adjust with the setters.
    pub fn new(n_layers: usize, n_heads: usize, head_dim: usize) -> Self {
        let d = library_defaults();
        KvCacheConfig {
            n_layers,
            n_heads,
            n_kv_heads: n_heads,
            head_dim,
            max_seqs: 1,
            max_seq_len: 2048,
            format: KvFormat::F16,
            v_format: None,
            rotation: KvRotation::from_raw(d.rotation),
            n_sinks: d.n_sinks.max(0) as usize,
            window: d.window.max(0) as usize,
            tiers: [None; MAX_TIERS],
            n_tiers: 0,
            placement: TierPlacement::FirstFree,
            observe_interval: d.observe_interval.max(0) as usize,
            demote_margin: d.demote_margin,
        }
    }

    /// Makes the cache tiered: its quantized rows live in these tiers (at most [`MAX_TIERS`],
    /// first to last), not at their positions in one format, and `format` and `v_format` become
    /// the first tier's. A row gets its tier when it leaves the FP16 window (or when appended
    /// past it): the first tier with a free row; [`KvCache::tier_move`] moves rows between
    /// tiers, [`KvCache::tier_rows`] and [`KvCache::tier_of`] say where they are,
    /// [`KvCache::tier_stats`] what the whole cache holds. The tiers' rows must add up to at
    /// least `max_seq_len - sinks - window` (checked by [`bytes_needed`](Self::bytes_needed)
    /// and [`KvCache::new`]). The calls that export weights or importance work over tiers as
    /// over a uniform cache; on CUDA, causal attention over a tiered cache runs each query
    /// row as a decode row (the tiers read once a row) and refuses a sliding window
    /// ([`Status::Unsupported`](crate::Status)).
    ///
    /// ```
    /// use m40llm::{Context, KvCache, KvCacheConfig, KvFormat, KvTier};
    /// let cfg = KvCacheConfig::new(1, 8, 64).kv_heads(2).max_seq_len(1024).tiers(&[
    ///     KvTier::new(KvFormat::Q8, KvFormat::Q8, 256),
    ///     KvTier::new(KvFormat::Q4, KvFormat::Q2, 1024),
    /// ]);
    /// let ctx = Context::cpu()?;
    /// let cache = KvCache::new(&ctx, &cfg)?;
    /// assert_eq!(cache.tier_rows(0, 0)?, vec![0, 0]);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn tiers(mut self, tiers: &[KvTier]) -> Self {
        self.tiers = [None; MAX_TIERS];
        for (slot, t) in self.tiers.iter_mut().zip(tiers) {
            *slot = Some(*t);
        }
        if let Some(first) = tiers.first() {
            self.format = first.k_format;
            self.v_format = Some(first.v_format);
        }
        self.n_tiers = tiers.len();
        self
    }

    /// Where a tiered cache puts the rows leaving its window (default
    /// [`TierPlacement::FirstFree`]). [`TierPlacement::Importance`] needs tiers, and keeps 8
    /// bytes of backend memory a position for every (layer, sequence) (the importance sums
    /// and their counts), 16 bytes a sequence (the ranking's counters) and `408 + 8 x window`
    /// bytes for every (layer, sequence) (the observe calls' rankings), counted by
    /// [`bytes_needed`](Self::bytes_needed). On CUDA, at most 4,096 query heads.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig, KvFormat, KvTier, TierPlacement};
    /// let cfg = KvCacheConfig::new(1, 2, 32).kv_heads(1).max_seq_len(64).sinks(0).window(4)
    ///     .tiers(&[KvTier::new(KvFormat::Q8, KvFormat::Q8, 2), KvTier::new(KvFormat::Q4, KvFormat::Q2, 64)])
    ///     .placement(TierPlacement::Importance);
    /// let ctx = Context::cpu()?;
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// let q = DeviceBuffer::from_slice(&ctx, &[0.5f32; 64])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 64)?;
    /// for t in 0..16 {
    ///     // position 9's K lines up with q: it draws most of every later call's attention
    ///     let row: Vec<f32> =
    ///         (0..32).map(|d| if t == 9 { 3.0 } else { ((t * 7 + d) % 5) as f32 * 0.1 - 0.2 }).collect();
    ///     let k = DeviceBuffer::from_slice(&ctx, &row)?;
    ///     kv.append(0, 0, &k, &k)?;
    ///     kv.attention_observe(0, &[0], &q, &mut out, None)?; // the weights the policy reads
    /// }
    /// // 12 rows left the window; tier 0's two rows went first to positions 0 and 1, then
    /// // position 9 took one of them (which moved down to tier 1).
    /// assert_eq!(kv.tier_rows(0, 0)?, vec![2, 10]);
    /// assert_eq!(kv.tier_of(0, 0, 9)?, Some(0));
    /// assert!(kv.tier_stats()?.demoted_rows > 0);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn placement(mut self, placement: TierPlacement) -> Self {
        self.placement = placement;
        self
    }

    /// With [`TierPlacement::Importance`]: a plain attention call ([`KvCache::attention`],
    /// [`KvCache::append_attention_batch`] and their kin) is made as
    /// [`KvCache::attention_observe`] makes it where one of its sequences is due: each
    /// (layer, sequence) counts the plain calls that name it, and is due on its
    /// `interval`-th since the last observe call that named it. So a decode loop of plain calls
    /// feeds the placement by itself, batched or a sequence a call (the library's default: 4,
    /// the better at 2K tokens of the two intervals `bench/fidelity` compared, 4 and 16). 0:
    /// only the caller's [`KvCache::attention_observe`] calls observe. A due call that names a
    /// sequence twice, or that is captured into a CUDA graph, is made plain and stays due. A
    /// call that observes is an observe call in all else (its output from the kernels that
    /// export weights: on sm_80+ the tensor-core ones, else FP32). Resets, truncates and forks
    /// leave the counts as they are. See `observe_interval` in `m40llm.h`.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig, KvFormat, KvTier, TierPlacement};
    /// let cfg = KvCacheConfig::new(1, 2, 32).kv_heads(1).max_seq_len(64).sinks(0).window(4)
    ///     .tiers(&[KvTier::new(KvFormat::Q8, KvFormat::Q8, 2), KvTier::new(KvFormat::Q4, KvFormat::Q2, 64)])
    ///     .placement(TierPlacement::Importance)
    ///     .observe_interval(2);
    /// let ctx = Context::cpu()?;
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// let q = DeviceBuffer::from_slice(&ctx, &[0.5f32; 64])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 64)?;
    /// for t in 0..16 {
    ///     let row: Vec<f32> = (0..32).map(|d| ((t * 7 + d) % 5) as f32 * 0.1 - 0.2).collect();
    ///     let k = DeviceBuffer::from_slice(&ctx, &row)?;
    ///     kv.append(0, 0, &k, &k)?;
    ///     kv.attention(0, 0, &q, &mut out, None)?; // every 2nd one observes
    /// }
    /// assert_eq!(kv.tier_stats()?.observe_calls, 8);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn observe_interval(mut self, interval: usize) -> Self {
        self.observe_interval = interval;
        self
    }

    /// With [`TierPlacement::Importance`]: the placement's hysteresis, finite and >= 0 (else
    /// [`Status::InvalidArgument`] when the config is used). A row leaving the window takes a
    /// tier's place from that tier's least important row only where its importance is more
    /// than `1 + margin` times that row's; else it goes on to the next tier. 0 (the default):
    /// more important at all. A margin spares rows of close scores the re-quantization a
    /// displacement costs and leans the placement toward age as it grows; rows only move down,
    /// so none can flap between tiers. See `demote_margin` in `m40llm.h`.
    ///
    /// ```
    /// use m40llm::{KvCacheConfig, KvFormat, KvTier, TierPlacement};
    /// let cfg = KvCacheConfig::new(1, 2, 32).max_seq_len(64).window(4)
    ///     .tiers(&[KvTier::new(KvFormat::Q8, KvFormat::Q8, 8), KvTier::new(KvFormat::Q4, KvFormat::Q2, 64)])
    ///     .placement(TierPlacement::Importance)
    ///     .demote_margin(0.25);
    /// assert!(cfg.bytes_needed().is_ok());
    /// assert!(cfg.demote_margin(-1.0).bytes_needed().is_err());
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn demote_margin(mut self, margin: f32) -> Self {
        self.demote_margin = margin;
        self
    }

    /// The tiers set with [`tiers`](Self::tiers).
    pub fn tier_list(&self) -> Vec<KvTier> {
        self.tiers.iter().flatten().copied().collect()
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

    /// Sets how quantized K and V are rotated before they are quantized (see [`KvRotation`]).
    /// An F16 tensor is never rotated.
    pub fn rotation(mut self, rotation: KvRotation) -> Self {
        self.rotation = rotation;
        self
    }

    /// Sets the attention sinks: the first `n_sinks` positions of each sequence are kept in
    /// FP16 as well as quantized, and attention and reads use the FP16 values.
    ///
    /// Sinks and the [`window`](Self::window) are the protected tokens. Where K or V is
    /// quantized, every position is quantized when appended, and a protected one also keeps an
    /// FP16 copy (of its rotated values, where the tensor is rotated) that attention and
    /// [`KvCache::read_f16`] use instead: the first tokens, which draw much of the attention,
    /// and the recent ones, which the next token leans on most, stay exact (`bench/fidelity`
    /// measures it on a real model). 0 turns either off; both are capped at `max_seq_len`.
    ///
    /// Memory: `(n_sinks + window) × head_dim × 2` bytes per layer, sequence, K/V head and
    /// quantized tensor, counted by [`bytes_needed`](Self::bytes_needed) and the capacity
    /// planners. An all-F16 cache ignores both (and takes no memory for them).
    ///
    /// A backend without kernels for protected tokens refuses them at creation
    /// ([`KvCache::new`], and [`max_seq_len_on_device`](Self::max_seq_len_on_device)) with
    /// [`Status::Unsupported`](crate::Status); the CPU backend has them.
    ///
    /// ```
    /// use m40llm::{Context, KvCache, KvCacheConfig, KvFormat};
    /// let cfg = KvCacheConfig::new(1, 8, 64).kv_heads(2).max_seq_len(1024).format(KvFormat::Q4);
    /// let protected = cfg.sinks(4).window(128);
    /// // (4 + 128) FP16 rows of 64 dims for each of 2 K/V heads, in K and in V.
    /// let extra = (4 + 128) * 64 * 2 * 2 * 2;
    /// assert_eq!(protected.bytes_needed()?, cfg.sinks(0).window(0).bytes_needed()? + extra);
    /// let kv = KvCache::new(&Context::cpu()?, &protected)?;
    /// assert_eq!((kv.config().n_sinks, kv.config().window), (4, 128));
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn sinks(mut self, n_sinks: usize) -> Self {
        self.n_sinks = n_sinks;
        self
    }

    /// Sets the recent window: the most recent `window` positions of each sequence (the newest
    /// included) are kept in FP16 as well as quantized, and attention and reads use the FP16
    /// values. A position leaves the window when `window` newer ones are appended, and its
    /// FP16 copy is then gone: after [`KvCache::truncate`], the positions that had left the
    /// window stay quantized until appends refill it. Memory, the backends and the rest as
    /// for [`sinks`](Self::sinks).
    pub fn window(mut self, window: usize) -> Self {
        self.window = window;
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
    /// // Llama-3-8B's shape, K/V in Q8 without protected tokens, one sequence, in 6 GiB.
    /// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).format(KvFormat::Q8);
    /// let cfg = cfg.sinks(0).window(0);
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

    /// This config with its tiers' rows set so that the cache stores at most `bits_per_value`
    /// bits a K/V value, every byte of the stored K/V counted (the tiers' codes, parameters and
    /// slot maps, the FP16 sinks and window: [`bytes_needed`](Self::bytes_needed) with
    /// [`TierPlacement::FirstFree`], and a full cache's [`TierStats::bits_per_value`]); what
    /// [`TierPlacement::Importance`] keeps besides comes on top. The tiers' formats are kept,
    /// their rows replaced (`m40llm_kvcache_plan_tiers`). The tiers get exactly the rows that
    /// can leave the window: all in the dearest tier where they fit the target, else shared by
    /// the two tiers adjacent in cost that bracket it, the dearer taking as many as fit. Fails with
    /// [`Status::Capacity`](crate::Status) for a target below every row in the cheapest tier,
    /// with [`Status::InvalidArgument`](crate::Status) without tiers or for a target that is
    /// not positive and finite, and as `bytes_needed` does for a config it refuses.
    ///
    /// ```
    /// use m40llm::{KvCacheConfig, KvFormat, KvTier};
    /// // Llama-3-8B's shape, one sequence of 32K, the four tier pairs of the fidelity study.
    /// let pairs = [(KvFormat::Q8, KvFormat::Q8), (KvFormat::Q8, KvFormat::Q4),
    ///              (KvFormat::Q4, KvFormat::Q3), (KvFormat::Q4, KvFormat::Q2)];
    /// let tiers: Vec<KvTier> = pairs.iter().map(|&(k, v)| KvTier::new(k, v, 0)).collect();
    /// let cfg = KvCacheConfig::new(32, 32, 128).kv_heads(8).max_seq_len(32768).tiers(&tiers);
    /// let cfg = cfg.tiers_for_bits(6.0)?;
    /// let rows: Vec<usize> = cfg.tier_list().iter().map(|t| t.rows).collect();
    /// assert_eq!(rows.iter().sum::<usize>(), 32768 - 4 - 128); // every row past the window
    /// assert!(rows[0] == 0 && rows[1] > 0 && rows[2] > 0 && rows[3] == 0); // K8V4 and K4V3
    /// let values = 2.0 * 32.0 * 32768.0 * 8.0 * 128.0;
    /// assert!(cfg.bytes_needed()? as f64 * 8.0 <= 6.0 * values);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn tiers_for_bits(mut self, bits_per_value: f64) -> Result<KvCacheConfig> {
        let mut opts = self.to_raw()?;
        // SAFETY: valid options struct of the current version.
        check(unsafe { sys::m40llm_kvcache_plan_tiers(&mut opts, bits_per_value) })?;
        for (slot, raw) in self.tiers.iter_mut().flatten().zip(&opts.tiers) {
            slot.rows = raw.rows.max(0) as usize;
        }
        Ok(self)
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
        o.rotation = self.rotation.to_raw();
        o.n_sinks = to_c(self.n_sinks, "n_sinks")?;
        o.window = to_c(self.window, "window")?;
        if self.n_tiers > MAX_TIERS {
            return Err(Error::invalid(format!(
                "tiers: {} given, at most {MAX_TIERS}",
                self.n_tiers
            )));
        }
        let tiers = self.tier_list();
        o.n_tiers = tiers.len() as c_int;
        for (raw, t) in o.tiers.iter_mut().zip(&tiers) {
            raw.k_format = t.k_format.to_c();
            raw.v_format = t.v_format.to_c();
            raw.rows = to_c(t.rows, "tier rows")?;
        }
        o.placement = self.placement.to_raw();
        o.observe_interval = to_c(self.observe_interval, "observe_interval")?;
        o.demote_margin = self.demote_margin;
        Ok(o)
    }

    /// The config of options the library returned (`m40llm_kvcache_get_options`).
    fn from_raw(o: &sys::m40llm_kvcache_options) -> Result<KvCacheConfig> {
        let format = |raw: c_int| {
            KvFormat::from_c(raw).ok_or_else(|| {
                Error::new(
                    Status::Unsupported,
                    format!("the library returned KV format {raw}, which this crate does not know"),
                )
            })
        };
        let size = |v: c_int| v.max(0) as usize;
        Ok(KvCacheConfig {
            n_layers: size(o.n_layers),
            n_heads: size(o.n_heads),
            n_kv_heads: size(o.n_kv_heads),
            head_dim: size(o.head_dim),
            max_seqs: size(o.max_seqs),
            max_seq_len: size(o.max_seq_len),
            format: format(o.format)?,
            v_format: if o.v_format == sys::M40LLM_KV_SAME as c_int {
                None
            } else {
                Some(format(o.v_format)?)
            },
            rotation: KvRotation::from_raw(o.rotation),
            n_sinks: size(o.n_sinks),
            window: size(o.window),
            tiers: {
                let mut tiers = [None; MAX_TIERS];
                for (t, raw) in tiers
                    .iter_mut()
                    .zip(&o.tiers[..size(o.n_tiers).min(MAX_TIERS)])
                {
                    *t = Some(KvTier {
                        k_format: format(raw.k_format)?,
                        v_format: format(raw.v_format)?,
                        rows: size(raw.rows),
                    });
                }
                tiers
            },
            n_tiers: size(o.n_tiers),
            placement: TierPlacement::from_raw(o.placement)?,
            observe_interval: size(o.observe_interval),
            demote_margin: o.demote_margin,
        })
    }
}

/// The library's default options of the current version (`m40llm_kvcache_options_init`).
fn library_defaults() -> sys::m40llm_kvcache_options {
    let mut o = sys::m40llm_kvcache_options::default();
    // SAFETY: valid out struct. The library knows the version of the header it was built from
    // (the bindings'), so this cannot fail; were it to, `o` would stay zeroed: AUTO, no
    // protected tokens.
    let rc =
        unsafe { sys::m40llm_kvcache_options_init(&mut o, sys::M40LLM_KVCACHE_OPTIONS_VERSION) };
    debug_assert_eq!(rc, sys::M40LLM_OK);
    o
}

fn to_c(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::invalid(format!("{what} = {v} does not fit in a C int")))
}

/// A call's per-sequence counts (one per id) as the C ABI takes them, and their sum.
fn c_counts(n_ids: usize, counts: &[usize], name: &str) -> Result<(Vec<c_int>, usize)> {
    if counts.len() != n_ids {
        return Err(Error::invalid(format!(
            "seq_ids has {n_ids} entries but {name} has {}",
            counts.len()
        )));
    }
    let c = counts
        .iter()
        .map(|&n| {
            c_int::try_from(n)
                .map_err(|_| Error::invalid(format!("{name}[i] = {n} does not fit in a C int")))
        })
        .collect::<Result<Vec<c_int>>>()?;
    let total = counts
        .iter()
        .try_fold(0usize, |a, &n| a.checked_add(n))
        .ok_or_else(|| Error::invalid(format!("the {name} add up past usize")))?;
    Ok((c, total))
}

/// Input element types for [`KvCache::append`]: `f32` and `bf16` (stored in the cache's
/// formats on the backend from their FP32 values, rounded once), and `f16`/`u16` (an F16 cache
/// stores them as is). Sealed.
pub trait KvInput: Element {
    /// The library's `m40llm_dtype` of these rows (`u16`: FP16 bit patterns).
    #[doc(hidden)]
    const DTYPE: c_int;
}
impl KvInput for f32 {
    const DTYPE: c_int = sys::M40LLM_DTYPE_F32 as c_int;
}
impl KvInput for f16 {
    const DTYPE: c_int = sys::M40LLM_DTYPE_F16 as c_int;
}
impl KvInput for u16 {
    const DTYPE: c_int = sys::M40LLM_DTYPE_F16 as c_int;
}
impl KvInput for bf16 {
    const DTYPE: c_int = sys::M40LLM_DTYPE_BF16 as c_int;
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
// SAFETY: as above; `&self` methods hold the lock too, and change no contents or lengths (an
// observe call, the caller's or the cache's own, adds to the importance sums that place rows).
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
        let mut cache = KvCache {
            raw,
            ctx: ctx.clone(),
            config: *config,
        };
        // What the library recorded (dropping `cache` destroys it if this fails).
        let mut o = sys::m40llm_kvcache_options {
            version: sys::M40LLM_KVCACHE_OPTIONS_VERSION,
            ..Default::default()
        };
        // SAFETY: valid out struct with its version set, and a live cache.
        cache.call(|c| unsafe { sys::m40llm_kvcache_get_options(&mut o, c) })?;
        cache.config = KvCacheConfig::from_raw(&o)?;
        Ok(cache)
    }

    /// Runs one library call on the cache with the context's lock held and checks its status.
    fn call(&self, f: impl FnOnce(*mut sys::m40llm_kvcache) -> c_int) -> Result<()> {
        let _lock = self.ctx.lock();
        check(f(self.raw.as_ptr()))
    }

    /// What the cache was created with, as the library recorded it
    /// (`m40llm_kvcache_get_options`): the config given to [`new`](Self::new), rotation and
    /// protected tokens included, as given ([`KvRotation::Auto`] stays `Auto`; `n_sinks` and
    /// `window` are not capped to `max_seq_len` here).
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

    /// A non-empty list of sequence ids as the C library takes them, and its length.
    fn seq_ids(&self, seq_ids: &[usize]) -> Result<(Vec<c_int>, c_int)> {
        if seq_ids.is_empty() {
            return Err(Error::invalid("seq_ids is empty"));
        }
        let ids = seq_ids
            .iter()
            .map(|&s| self.seq("seq id", s))
            .collect::<Result<Vec<c_int>>>()?;
        let n = to_c(ids.len(), "seq_ids.len()")?;
        Ok((ids, n))
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

    /// A tiered cache ([`KvCacheConfig::tiers`]): moves the quantized rows of `(layer, seq)` at
    /// `positions` into tier `tier`, each re-quantized from the values it holds; rows already
    /// there stay, and rows still in FP16 slots (sinks, window) are not moved. A tier with too
    /// few free rows for all of them fails with [`Status::Capacity`](crate::Status) and moves
    /// none. For a policy of the caller's own, e.g. from [`attention_importance`](Self::attention_importance).
    pub fn tier_move(
        &mut self,
        layer: usize,
        seq: usize,
        positions: std::ops::Range<usize>,
        tier: usize,
    ) -> Result<()> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let clamp = |x: usize| x.min(c_int::MAX as usize) as c_int;
        let (b, e, t) = (clamp(positions.start), clamp(positions.end), clamp(tier));
        // SAFETY: valid cache; the library checks the range and the tier.
        self.call(|c| unsafe { sys::m40llm_kvcache_tier_move(c, l, s, b, e, t) })
    }

    /// A tiered cache: the rows each tier holds for `(layer, seq)`.
    pub fn tier_rows(&self, layer: usize, seq: usize) -> Result<Vec<usize>> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let mut rows = [0i32; MAX_TIERS];
        // SAFETY: room for MAX_TIERS entries, the most a cache has.
        self.call(|c| unsafe { sys::m40llm_kvcache_tier_rows(rows.as_mut_ptr(), c, l, s) })?;
        Ok(rows[..self.config().tier_list().len()]
            .iter()
            .map(|&r| r.max(0) as usize)
            .collect())
    }

    /// A tiered cache: the tier of position `pos` of `(layer, seq)`, or `None` for a position
    /// read from its FP16 slot (a sink, or in the window).
    pub fn tier_of(&self, layer: usize, seq: usize, pos: usize) -> Result<Option<usize>> {
        let (l, s) = (self.layer(layer)?, self.seq("seq", seq)?);
        let p = pos.min(c_int::MAX as usize) as c_int;
        let mut tier: c_int = 0;
        // SAFETY: valid out pointer and cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_tier_of(&mut tier, c, l, s, p) })?;
        Ok(usize::try_from(tier).ok())
    }

    /// A tiered cache: what it holds over all its layers and sequences (host bookkeeping, no
    /// GPU work).
    pub fn tier_stats(&self) -> Result<TierStats> {
        let mut raw = sys::m40llm_tier_stats {
            version: sys::M40LLM_TIER_STATS_VERSION,
            ..Default::default()
        };
        // SAFETY: valid out pointer (its version set) and cache.
        self.call(|c| unsafe { sys::m40llm_kvcache_tier_stats(&mut raw, c) })?;
        let n = (raw.n_tiers.max(0) as usize).min(MAX_TIERS);
        let count = |x: i64| x.max(0) as u64;
        Ok(TierStats {
            rows: raw.rows[..n].iter().map(|&r| count(r)).collect(),
            free_rows: raw.free_rows[..n].iter().map(|&r| count(r)).collect(),
            kept_rows: count(raw.kept_rows),
            bits_per_value: raw.bits_per_value,
            moved_rows: count(raw.moved_rows),
            demoted_rows: count(raw.demoted_rows),
            observe_calls: count(raw.observe_calls),
        })
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
        if n_tokens == 0 {
            return Err(Error::invalid("n_tokens must be >= 1"));
        }
        self.check_rows(n_tokens, k, v)?;
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

    /// Appends to several sequences of one layer in one call (on the GPU, one kernel launch
    /// for every 128 sequences): sequence `seq_ids[i]` gets `n_tokens[i]` new positions (0
    /// leaves it as it is). `k` and `v` hold the rows of all of them,
    /// `[Σ n_tokens][n_kv_heads][head_dim]`, those of `seq_ids[0]` first, and must each have
    /// exactly that many elements (checked as [`append_tokens`](Self::append_tokens) checks
    /// them). A batch names each sequence once. Everything is checked before anything is
    /// written: if one sequence would pass `max_seq_len` the call fails with
    /// [`Status::Capacity`](crate::Status) and no sequence changes. Each sequence then holds
    /// exactly what [`append_tokens`](Self::append_tokens) of its rows would store.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig, Status};
    /// let ctx = Context::cpu()?;
    /// let cfg = KvCacheConfig::new(1, 2, 4).max_seqs(3).max_seq_len(8);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// // 2 tokens for sequence 2, then 1 for sequence 0: 3 rows of n_kv_heads × head_dim = 8.
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.5f32; 3 * 8])?;
    /// kv.append_batch(0, &[2, 0], &[2, 1], &k, &k)?;
    /// assert_eq!((kv.seq_len(0, 0)?, kv.seq_len(0, 2)?), (1, 2));
    /// // A sequence named twice is refused, and nothing is written.
    /// let e = kv.append_batch(0, &[1, 1], &[2, 1], &k, &k).unwrap_err();
    /// assert_eq!(e.status(), Status::InvalidArgument);
    /// assert_eq!(kv.seq_len(0, 1)?, 0);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    pub fn append_batch<T: KvInput>(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        n_tokens: &[usize],
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        let (counts, total) = c_counts(seq_ids.len(), n_tokens, "n_tokens")?;
        self.append_batch_raw(layer, seq_ids, Some(&counts), total, k, v)
    }

    /// A decode step's append: one token to each of `seq_ids` (the usual batch of a step) in
    /// one call. `k` and `v` are `[seq_ids.len()][n_kv_heads][head_dim]`, row `i` belonging to
    /// `seq_ids[i]`. As [`append_batch`](Self::append_batch) with every count 1.
    pub fn append_token_batch<T: KvInput>(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        self.append_batch_raw(layer, seq_ids, None, seq_ids.len(), k, v)
    }

    /// The library's batched append, after checking the ids' range, the rows' length against
    /// `total` tokens and the buffers' context (counts `None`: one token each).
    fn append_batch_raw<T: KvInput>(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        counts: Option<&[c_int]>,
        total: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        self.check_rows(total, k, v)?;
        self.check_kv_pair(k, v)?;
        let counts = counts.map_or(ptr::null(), <[c_int]>::as_ptr);
        let (kp, vp) = (k.device_ptr(), v.device_ptr());
        // SAFETY: ids and counts (or null) are host arrays of n entries; k and v each cover the
        // `total` rows the counts add up to, in backend memory of this cache's context, as
        // elements of T's dtype.
        self.call(|c| unsafe {
            sys::m40llm_kvcache_append_batch_ex(
                c,
                l,
                ids.as_ptr(),
                counts,
                n,
                kp.cast(),
                vp.cast(),
                T::DTYPE,
            )
        })
    }

    /// `k` and `v` hold exactly `n_tokens` K/V rows; the message names `n_kv_heads × head_dim`
    /// (and the GQA mix-up, when a buffer has `n_heads × head_dim` a token).
    fn check_rows<T: KvInput>(
        &self,
        n_tokens: usize,
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
    ) -> Result<()> {
        let cfg = &self.config;
        let want = n_tokens
            .checked_mul(cfg.kv_row_len())
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
        Ok(())
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
        // SAFETY: k and v each cover n_tokens rows of backend memory of this cache's context, as
        // elements of T's dtype; the batch is one sequence (s) of n tokens.
        self.call(|c| unsafe {
            sys::m40llm_kvcache_append_batch_ex(c, l, &s, &n, 1, kp.cast(), vp.cast(), T::DTYPE)
        })
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

    /// Copies positions `pos..pos + n` of `(layer, seq)` out as FP16 (for Q8/Q4 what attention
    /// reads: the dequantized values, or a protected position's FP16 copy, rotated back where
    /// the tensor is rotated, rounded to FP16) into `k_out` and `v_out`
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
    /// `q` and `out` are `[n_heads][head_dim]` ([`KvCacheConfig::q_row_len`] elements) of one
    /// element type, `f32`, `f16` or `bf16` (see [`IoElement`]), and must not overlap. `scale` `None` means `1/sqrt(head_dim)`; a given scale must be
    /// finite and non-zero. A sequence with no positions yields zeros. Sums are FP32; on sm_80+
    /// builds (F16: head_dim a multiple of 16 up to 128; Q8/Q4: 32, 64, 96, 128) the products
    /// run on tensor cores with q split into two FP16 terms (see
    /// `m40llm_kvcache_attn_last_token_f32q` in `m40llm.h`). With
    /// [`TierPlacement::Importance`], a call that is due is an observe call
    /// ([`KvCacheConfig::observe_interval`]): the kernels that export weights (on sm_80+ the
    /// tensor-core ones, else FP32), and the context's scratch of the scores.
    pub fn attention<T: IoElement>(
        &self,
        layer: usize,
        seq: usize,
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        scale: Option<f32>,
    ) -> Result<()> {
        self.attention_batch(layer, &[seq], q, out, scale)
    }

    /// [`attention`](Self::attention) for several sequences at once (one launch over their
    /// ragged lengths): row `i` of `q` and `out` (`[seq_ids.len()][n_heads][head_dim]`) belongs
    /// to `seq_ids[i]`. Repeated ids are allowed. A call that is due observes, as
    /// [`attention`](Self::attention) says.
    pub fn attention_batch<T: IoElement>(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        // SAFETY: q and out cover ids.len() query rows each in this context's memory and don't
        // overlap; ids is a host array of n valid sequence indices.
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_batch_ex(op, c, l, ids.as_ptr(), n, qp, T::DTYPE, scale)
        })
    }

    /// [`attention_batch`](Self::attention_batch), and also adds the call's weights (each
    /// position's largest over the query heads) to the cache's own importance, which
    /// [`TierPlacement::Importance`] places rows by; each sequence is named once. The cache
    /// must have that placement ([`Status::InvalidArgument`](crate::Status) otherwise). The cache
    /// makes its own observe calls, a sequence's every [`KvCacheConfig::observe_interval`]-th
    /// plain call (4 by default); call this one where the caller picks the steps (with an
    /// interval of 0), or for a call the count would not make: it starts the count again for
    /// the sequences it names. On CUDA it ranks each sequence's tiers on the GPU and copies the result to the
    /// host without waiting: it cannot be captured in a graph
    /// ([`Status::Unsupported`](crate::Status)), and the next append of a sequence it saw
    /// waits for that copy (and may copy the sequence's sums back, a wait for the stream),
    /// so the appends of such a cache should not be captured either.
    /// See `m40llm_kvcache_attn_observe_ex` in `m40llm.h`; an example is at
    /// [`KvCacheConfig::placement`].
    pub fn attention_observe<T: IoElement>(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        // SAFETY: q and out cover ids.len() query rows each in this context's memory and don't
        // overlap; ids is a host array of n valid sequence indices (the library refuses repeats).
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_observe_ex(op, c, l, ids.as_ptr(), n, qp, T::DTYPE, scale)
        })
    }

    /// [`attention_batch`](Self::attention_batch), and also the attention weights the output is
    /// made of: `weights[(i * n_heads + h) * stride + p]` is the softmax weight that query head
    /// `h` of row `i` gives position `p` of `seq_ids[i]`, for `p` below that sequence's length
    /// (the rest of each row of `stride` is not written). `weights` holds `seq_ids.len() x
    /// n_heads` rows of `stride` floats, `stride` at least the longest length. A head's weights
    /// sum to 1. For policies that keep, evict or re-quantize tokens by the attention they
    /// draw (H2O, SnapKV, ZipCache). On the CUDA backend it runs kernel instances that write
    /// the scores (on sm_80+ the tensor-core kernel's, else the FP32 kernel's). See
    /// `m40llm_kvcache_attn_weights_ex` in `m40llm.h`.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
    /// let ctx = Context::cpu()?;
    /// let cfg = KvCacheConfig::new(1, 1, 4).max_seqs(1).max_seq_len(8);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// // K rows 0 and 2 along dim 0; q = (1, 0, 0, 0) with scale 1/2: scores 0 and 1.
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.0f32, 0., 0., 0., 2., 0., 0., 0.])?;
    /// let v = DeviceBuffer::from_slice(&ctx, &[1.0f32, 1., 1., 1., 5., 5., 5., 5.])?;
    /// kv.append(0, 0, &k, &v)?;
    /// let q = DeviceBuffer::from_slice(&ctx, &[1.0f32, 0., 0., 0.])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 4)?;
    /// let mut w = DeviceBuffer::<f32>::zeros(&ctx, 3)?; // a row of 3 for 2 positions
    /// kv.attention_weights(0, &[0], &q, &mut out, &mut w, 3, None)?;
    /// let (w, e) = (w.to_vec()?, 1f32.exp());
    /// assert!((w[0] - 1.0 / (1.0 + e)).abs() < 1e-6 && (w[1] - e / (1.0 + e)).abs() < 1e-6);
    /// assert_eq!(w[2], 0.0); // past the sequence: not written
    /// let want = w[0] * 1.0 + w[1] * 5.0; // the output is the weights times V
    /// assert!(out.to_vec()?.iter().all(|&o| (o - want).abs() < 1e-5));
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn attention_weights<T: IoElement>(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        weights: &mut impl DeviceWrite<f32>,
        stride: usize,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        let heads = ("n_heads", self.config.n_heads);
        self.check_export("weights", weights, q, out, ids.len(), heads, stride)?;
        // SAFETY: q and out cover ids.len() query rows each, weights ids.len() x n_heads rows of
        // stride floats, all in this context's memory and not overlapping; ids is a host array
        // of n valid sequence indices; the library checks stride against the lengths.
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        let wp = weights.device_ptr_mut();
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_weights_ex(
                op,
                wp,
                stride,
                c,
                l,
                ids.as_ptr(),
                n,
                qp,
                T::DTYPE,
                scale,
            )
        })
    }

    /// [`attention_batch`](Self::attention_batch), and also each K/V row's importance, updated
    /// in place: for row `i`, K/V head `g` and each position `p` below `seq_ids[i]`'s length,
    /// `importance[(i * n_kv_heads + g) * stride + p] = decay * itself + m`, where `m` is the
    /// largest weight (as [`attention_weights`](Self::attention_weights) gives them) a query
    /// head of `g` gives `p`. The rest of each row of `stride` is neither read nor written:
    /// zero the buffer once, and past a sequence's new length after a truncate. `decay` in
    /// `0.0..=1.0`: 1 sums over the calls, below 1 older calls count less. `importance` holds
    /// `seq_ids.len() x n_kv_heads` rows of `stride` floats, `stride` at least the longest
    /// length. The signal a keep/evict/re-quantize policy reads, `n_heads / n_kv_heads` times
    /// smaller than the weights. See `m40llm_kvcache_attn_importance_ex` in `m40llm.h`.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
    /// let ctx = Context::cpu()?;
    /// // Two query heads share one K/V head.
    /// let cfg = KvCacheConfig::new(1, 2, 4).kv_heads(1).max_seqs(1).max_seq_len(8);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.0f32, 0., 0., 0., 2., 0., 0., 0.])?;
    /// let v = DeviceBuffer::from_slice(&ctx, &[1.0f32, 1., 1., 1., 5., 5., 5., 5.])?;
    /// kv.append(0, 0, &k, &v)?;
    /// // Head 0 looks at position 1 (scores 0, 1), head 1 at position 0 (scores 0, -1).
    /// let q = DeviceBuffer::from_slice(&ctx, &[1.0f32, 0., 0., 0., -1., 0., 0., 0.])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 8)?;
    /// let mut imp = DeviceBuffer::<f32>::zeros(&ctx, 2)?;
    /// kv.attention_importance(0, &[0], &q, &mut out, &mut imp, 2, 1.0, None)?;
    /// kv.attention_importance(0, &[0], &q, &mut out, &mut imp, 2, 1.0, None)?;
    /// let (imp, big) = (imp.to_vec()?, 1f32.exp() / (1.0 + 1f32.exp()));
    /// // Each position's larger weight, summed over the two calls.
    /// assert!((imp[0] - 2.0 * big).abs() < 1e-5 && (imp[1] - 2.0 * big).abs() < 1e-5);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn attention_importance<T: IoElement>(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        importance: &mut impl DeviceWrite<f32>,
        stride: usize,
        decay: f32,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        let heads = ("n_kv_heads", self.config.n_kv_heads);
        self.check_export("importance", importance, q, out, ids.len(), heads, stride)?;
        // SAFETY: q and out cover ids.len() query rows each, importance ids.len() x n_kv_heads
        // rows of stride floats, all in this context's memory and not overlapping; ids is a
        // host array of n valid sequence indices; the library checks stride and decay.
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        let ip = importance.device_ptr_mut();
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_importance_ex(
                op,
                ip,
                stride,
                decay,
                c,
                l,
                ids.as_ptr(),
                n,
                qp,
                T::DTYPE,
                scale,
            )
        })
    }

    /// Causal attention of several new query rows per sequence (a prompt's prefill, ragged
    /// prompt batches, speculative verification), one call for the layer: sequence
    /// `seq_ids[s]`, whose last `q_counts[s]` positions (`T`) are the rows' own tokens, already
    /// appended, gets `T` rows of `q` and `out`; its row `i` attends over positions
    /// `0 ..= len - T + i` (with `window` `Some(w)`, only the last `w` of them: sliding-window
    /// attention). `q` and `out` are `[rows][n_heads][head_dim]`, rows the sum of the counts,
    /// `seq_ids[0]`'s first, and must not overlap. Each sequence is named once; each count is
    /// `1 ..= len`. Scale as for [`attention`](Self::attention). With every count 1 and no
    /// window it is [`attention_batch`](Self::attention_batch) (bit for bit on the CPU
    /// backend). See `m40llm_kvcache_attn_causal_f32q` in `m40llm.h`.
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
    /// let ctx = Context::cpu()?;
    /// let cfg = KvCacheConfig::new(1, 1, 4).max_seqs(1).max_seq_len(8);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// // Three tokens whose V rows are 1, 2 and 3; K is zero, so each row averages what it sees.
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.0f32; 12])?;
    /// let v = DeviceBuffer::from_slice(&ctx, &[1.0f32, 1., 1., 1., 2., 2., 2., 2., 3., 3., 3., 3.])?;
    /// kv.append(0, 0, &k, &v)?;
    /// let q = DeviceBuffer::from_slice(&ctx, &[0.5f32; 12])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 12)?;
    /// kv.attention_causal(0, &[0], &[3], &q, &mut out, None, None)?;
    /// assert_eq!(out.to_vec()?, [1.0, 1., 1., 1., 1.5, 1.5, 1.5, 1.5, 2., 2., 2., 2.]);
    /// kv.attention_causal(0, &[0], &[3], &q, &mut out, None, Some(1))?; // each row itself
    /// assert_eq!(out.to_vec()?, [1.0, 1., 1., 1., 2., 2., 2., 2., 3., 3., 3., 3.]);
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn attention_causal<T: IoElement>(
        &self,
        layer: usize,
        seq_ids: &[usize],
        q_counts: &[usize],
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        scale: Option<f32>,
        window: Option<usize>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        let (counts, rows) = c_counts(seq_ids.len(), q_counts, "q_counts")?;
        let scale = self.check_attention(rows, q, out, scale)?;
        let window = match window {
            None => 0,
            Some(0) => return Err(Error::invalid("window is Some(0): None means no window")),
            Some(w) => to_c(w, "window")?,
        };
        let opts = sys::m40llm_causal_options {
            version: sys::M40LLM_CAUSAL_OPTIONS_VERSION,
            scale,
            window,
        };
        // SAFETY: ids and counts are host arrays of n entries; q and out cover the rows the
        // counts add up to in this context's memory and don't overlap; opts is a version-1
        // struct the call only reads.
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        self.call(|c| unsafe {
            sys::m40llm_kvcache_attn_causal_ex(
                op,
                c,
                l,
                ids.as_ptr(),
                counts.as_ptr(),
                n,
                qp,
                T::DTYPE,
                &opts,
            )
        })
    }

    /// A decode step of one layer in one call: appends one token to each of `seq_ids` (row `i`
    /// of `k` and `v`, `[seq_ids.len()][n_kv_heads][head_dim]`, for `seq_ids[i]`), then attends
    /// row `i` of `q` over every position of `seq_ids[i]`, the new one included, into row `i`
    /// of `out` (`[seq_ids.len()][n_heads][head_dim]`). The same results, bit for bit, as
    /// [`append_token_batch`](Self::append_token_batch) followed by
    /// [`attention_batch`](Self::attention_batch), with the checks of both made before anything
    /// is written (each sequence named once, capacity, lengths, `q` and `out` apart).
    ///
    /// ```
    /// use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig};
    /// let ctx = Context::cpu()?;
    /// let cfg = KvCacheConfig::new(1, 2, 4).max_seqs(2).max_seq_len(8);
    /// let mut kv = KvCache::new(&ctx, &cfg)?;
    /// let k = DeviceBuffer::from_slice(&ctx, &[0.5f32; 2 * 8])?; // a token for each of 2
    /// let v = DeviceBuffer::from_slice(&ctx, &[1.0f32; 2 * 8])?;
    /// let q = DeviceBuffer::from_slice(&ctx, &[0.1f32; 2 * 8])?;
    /// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * 8)?;
    /// kv.append_attention_batch(0, &[1, 0], &k, &v, &q, &mut out, None)?;
    /// assert_eq!((kv.seq_len(0, 0)?, kv.seq_len(0, 1)?), (1, 1));
    /// assert_eq!(out.to_vec()?, [1.0; 16]); // the one V row of each sequence
    /// # Ok::<(), m40llm::Error>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn append_attention_batch<T: IoElement + KvInput>(
        &mut self,
        layer: usize,
        seq_ids: &[usize],
        k: &impl DeviceRead<T>,
        v: &impl DeviceRead<T>,
        q: &impl DeviceRead<T>,
        out: &mut impl DeviceWrite<T>,
        scale: Option<f32>,
    ) -> Result<()> {
        let l = self.layer(layer)?;
        let (ids, n) = self.seq_ids(seq_ids)?;
        self.check_rows(ids.len(), k, v)?;
        self.check_kv_pair(k, v)?;
        let scale = self.check_attention(ids.len(), q, out, scale)?;
        let (kp, vp) = (k.device_ptr().cast(), v.device_ptr().cast());
        let (qp, op) = (q.device_ptr().cast(), out.device_ptr_mut().cast());
        // SAFETY: ids is a host array of n valid sequence indices; k and v cover n K/V rows, q
        // and out n query rows each, of element type T in this context's memory; q and out
        // don't overlap.
        self.call(|c| unsafe {
            sys::m40llm_kvcache_append_attn_ex(
                op,
                c,
                l,
                ids.as_ptr(),
                n,
                kp,
                vp,
                qp,
                <T as IoElement>::DTYPE,
                scale,
            )
        })
    }

    /// What an exporting call writes besides `out` (weights, importance): `rows` query rows'
    /// `heads.1` rows (`heads.0` names them) of `stride` floats, in this context's memory and
    /// clear of `q` and `out`.
    #[allow(clippy::too_many_arguments)]
    fn check_export<T: IoElement>(
        &self,
        what: &str,
        buf: &impl DeviceRead<f32>,
        q: &impl DeviceRead<T>,
        out: &impl DeviceRead<T>,
        rows: usize,
        heads: (&str, usize),
        stride: usize,
    ) -> Result<()> {
        self.same_context(what, buf)?;
        let want = rows
            .checked_mul(heads.1)
            .and_then(|r| r.checked_mul(stride))
            .ok_or_else(|| Error::invalid(format!("too many rows of {what}")))?;
        if buf.len() != want {
            return Err(Error::invalid(format!(
                "{what} has {} elements, expected {want} ({rows} row(s) of {} {} x stride {stride})",
                buf.len(),
                heads.0,
                heads.1
            )));
        }
        if overlaps(q, buf) || overlaps(out, buf) {
            return Err(Error::invalid(format!("{what} and q or out overlap")));
        }
        Ok(())
    }

    fn check_attention<T: IoElement>(
        &self,
        rows: usize,
        q: &impl DeviceRead<T>,
        out: &impl DeviceRead<T>,
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
