//! CUDA graphs of a context's calls: a decode step captured and launched as one graph.

use std::fmt;
use std::ptr::{self, NonNull};

use m40llm_sys as sys;

use crate::context::Context;
use crate::error::{check, Result};

/// An executable CUDA graph of the calls made on one [`Context`] (CUDA backend): a decode
/// step's appends, attention calls and copies, captured by [`Graph::capture`], launched by
/// [`Graph::launch`], and for the next step captured again by [`Graph::recapture`], which
/// updates the graph in place where the step launches the same kernels (new lengths and
/// positions: the usual case, far cheaper than a new graph) and instantiates it anew otherwise.
///
/// A captured call bakes in what was decided when it was made: the positions an append writes,
/// the lengths attention reads, the buffers. The cache's lengths move when the call is captured,
/// so a graph holds one step, and [`launch`](Self::launch) runs that step (launching it twice
/// runs it twice, at the same positions). Make each call once outside a capture first (the
/// first calls load the kernels and size the buffers they keep). `m40llm.h`, "Graphs", has the
/// details. The graph keeps its context alive and is `Send` and `Sync`.
///
/// ```no_run
/// # use m40llm::{Context, DeviceBuffer, Graph, KvCache, KvCacheConfig};
/// let ctx = Context::cuda(0)?;
/// let mut kv = KvCache::new(&ctx, &KvCacheConfig::new(1, 8, 64).max_seqs(1).max_seq_len(64))?;
/// let (k, v) = (DeviceBuffer::<f32>::zeros(&ctx, 64)?, DeviceBuffer::<f32>::zeros(&ctx, 64)?);
/// let q = DeviceBuffer::<f32>::zeros(&ctx, 8 * 64)?;
/// let mut out = DeviceBuffer::<f32>::zeros(&ctx, 8 * 64)?;
/// kv.append_attention_batch(0, &[0], &k, &v, &q, &mut out, None)?; // warm-up, eager
/// let mut step = Graph::capture(&ctx, || kv.append_attention_batch(0, &[0], &k, &v, &q, &mut out, None))?;
/// step.launch()?;
/// for _ in 0..10 {
///     step.recapture(|| kv.append_attention_batch(0, &[0], &k, &v, &q, &mut out, None))?;
///     step.launch()?;
/// }
/// ctx.synchronize()?;
/// # Ok::<(), m40llm::Error>(())
/// ```
pub struct Graph {
    ctx: Context,
    raw: NonNull<sys::m40llm_graph>,
}

// SAFETY: the handle is only used under the context's lock (which serializes every call on the
// context), and destroyed once, in `drop`.
unsafe impl Send for Graph {}
// SAFETY: as above: `&Graph` only launches, under the lock.
unsafe impl Sync for Graph {}

/// A capture in progress: discarded if it is not ended (the closure failed or panicked).
struct Capture<'a> {
    ctx: &'a Context,
    open: bool,
}

impl Drop for Capture<'_> {
    fn drop(&mut self) {
        if self.open {
            let _lock = self.ctx.lock();
            // SAFETY: valid context; the lock is held. A NULL graph discards the capture; its
            // status is not the caller's error (that one is already being returned).
            let _ = unsafe {
                sys::m40llm_graph_capture_end(ptr::null_mut(), self.ctx.as_raw(), ptr::null_mut())
            };
        }
    }
}

/// Captures the calls `f` makes on `ctx` into `*raw` (a new graph where it is null); whether
/// the graph was updated in place.
fn capture_into(
    ctx: &Context,
    raw: &mut *mut sys::m40llm_graph,
    f: impl FnOnce() -> Result<()>,
) -> Result<bool> {
    {
        let _lock = ctx.lock();
        // SAFETY: valid context; the lock is held.
        check(unsafe { sys::m40llm_graph_capture_begin(ctx.as_raw()) })?;
    }
    let mut capture = Capture { ctx, open: true };
    f()?; // every call takes the lock itself
    let _lock = ctx.lock();
    let mut updated = 0;
    capture.open = false;
    // SAFETY: valid context and out pointers; the lock is held. On failure the library leaves
    // `*raw` as it was and has ended the capture (its arguments are valid here).
    check(unsafe { sys::m40llm_graph_capture_end(raw, ctx.as_raw(), &mut updated) })?;
    Ok(updated != 0)
}

impl Graph {
    /// Captures the calls `f` makes on `ctx` (from this thread; calls on the same context from
    /// other threads would be captured too, so make none during it) into a new graph. Where `f`
    /// fails (or panics), the capture is discarded and its error returned; the calls captured
    /// before the failure moved the lengths (put them back with `seq_truncate`). Fails with
    /// [`Status::Unsupported`](crate::Status) on the CPU backend.
    pub fn capture(ctx: &Context, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let mut raw = ptr::null_mut();
        capture_into(ctx, &mut raw, f)?;
        let raw = NonNull::new(raw).expect("m40llm_graph_capture_end returned no graph");
        Ok(Graph {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Captures the calls `f` makes into this graph: updated in place where they launch the
    /// same kernels as before (returns `true`), else instantiated anew (`false`). Launches
    /// already queued run as they were. On failure the graph is as it was.
    pub fn recapture(&mut self, f: impl FnOnce() -> Result<()>) -> Result<bool> {
        let mut raw = self.raw.as_ptr();
        let updated = capture_into(&self.ctx, &mut raw, f)?;
        debug_assert_eq!(raw, self.raw.as_ptr(), "a re-capture keeps the handle");
        Ok(updated)
    }

    /// Queues the graph on the context's stream (returns at once; stream-ordered with every
    /// other call on the context).
    pub fn launch(&self) -> Result<()> {
        let _lock = self.ctx.lock();
        // SAFETY: valid graph of this context; the lock is held.
        check(unsafe { sys::m40llm_graph_launch(self.raw.as_ptr()) })
    }

    /// The context the graph was captured on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _lock = self.ctx.lock();
        // SAFETY: owned handle, destroyed once, before the context (which `self.ctx` keeps).
        unsafe { sys::m40llm_graph_destroy(self.raw.as_ptr()) }
    }
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("context", &self.ctx).finish()
    }
}
