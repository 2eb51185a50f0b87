//! The two attention paths: m40llm's KV cache and decode attention, and candle ops over candle
//! tensors (the reference).

use anyhow::Result;
use candle_core::{DType, Tensor, D};
use m40llm::{Backend, Context, DeviceBuffer, KvCache, KvCacheConfig};

/// One decode step of one layer: store the token's K/V, return its attention output.
pub trait Attention {
    /// `q`: `[n_heads, head_dim]`, `k` and `v`: `[n_kv_heads, head_dim]`, FP32 after RoPE, for
    /// the next position of `layer`. Returns `[n_heads, head_dim]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
}

/// m40llm as the KV cache and attention of one sequence. The prompt goes in token by token
/// like the generated tokens. Where candle runs on the context's device (both CPU, or both the
/// same GPU with the `cuda` feature), q/K/V tensors go to the cache as they are and the output
/// is a new tensor there (m40llm's candle interop: no copies). Where one runs on the CPU and
/// the other on a GPU, they are staged through host memory and the context's buffers (copies
/// each way per call).
pub struct M40Attention {
    kv: KvCache,
    seq: usize,
    staging: Option<Staging>,
}

/// The context's buffers for tensors on another device than the cache.
struct Staging {
    q: DeviceBuffer<f32>,
    k: DeviceBuffer<f32>,
    v: DeviceBuffer<f32>,
    out: DeviceBuffer<f32>,
}

impl M40Attention {
    pub fn new(ctx: &Context, cfg: &KvCacheConfig) -> Result<M40Attention> {
        Ok(M40Attention {
            kv: KvCache::new(ctx, cfg)?,
            seq: 0,
            staging: None,
        })
    }

    pub fn cache(&self) -> &KvCache {
        &self.kv
    }

    fn staged(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let s = match &mut self.staging {
            Some(s) => s,
            staging => {
                let (ctx, cfg) = (self.kv.context(), self.kv.config());
                staging.insert(Staging {
                    q: DeviceBuffer::zeros(ctx, cfg.q_row_len())?,
                    k: DeviceBuffer::zeros(ctx, cfg.kv_row_len())?,
                    v: DeviceBuffer::zeros(ctx, cfg.kv_row_len())?,
                    out: DeviceBuffer::zeros(ctx, cfg.q_row_len())?,
                })
            }
        };
        s.k.copy_from_host(&host(k)?)?;
        s.v.copy_from_host(&host(v)?)?;
        s.q.copy_from_host(&host(q)?)?;
        self.kv.append_token(layer, self.seq, &s.k, &s.v)?;
        self.kv.attention(layer, self.seq, &s.q, &mut s.out, None)?;
        Ok(Tensor::from_vec(s.out.to_vec()?, q.shape(), q.device())?)
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
}

impl Attention for M40Attention {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        if q.device().is_cpu() != (self.kv.context().backend() == Backend::Cpu) {
            return self.staged(layer, q, k, v);
        }
        // RoPE's output may be a strided view: the interop takes contiguous tensors.
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        self.kv.append_tensor(layer, self.seq, &k, &v)?;
        Ok(self.kv.attention_tensor(layer, self.seq, &q, None)?)
    }
}

/// Attention in candle ops with its own K/V tensors (`[n_kv_heads, positions, head_dim]` per
/// layer).
pub struct CandleAttention {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    round_kv_f16: bool,
    dtype: DType,
}

impl CandleAttention {
    /// The pure-candle path: K/V kept in FP32, FP32 arithmetic.
    pub fn new(n_layers: usize) -> CandleAttention {
        CandleAttention {
            k: vec![None; n_layers],
            v: vec![None; n_layers],
            round_kv_f16: false,
            dtype: DType::F32,
        }
    }

    /// What m40llm's F16 cache computes, exactly: K and V rounded to FP16 as they are stored,
    /// then q·K, the softmax and the sum over V in FP64 (m40llm's CPU backend accumulates in
    /// FP64 too; its CUDA kernels in FP32).
    pub fn f16_cache_f64_math(n_layers: usize) -> CandleAttention {
        CandleAttention {
            round_kv_f16: true,
            dtype: DType::F64,
            ..CandleAttention::new(n_layers)
        }
    }

    /// Bytes of K and V held (FP32).
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

fn push(cache: &mut Option<Tensor>, row: &Tensor) -> Result<Tensor> {
    let row = row.unsqueeze(1)?; // [G, 1, D]
    let all = match cache.take() {
        Some(prev) => Tensor::cat(&[&prev, &row], 1)?,
        None => row,
    };
    *cache = Some(all.clone());
    Ok(all)
}

impl Attention for CandleAttention {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let store = |t: &Tensor| -> Result<Tensor> {
            let t = if self.round_kv_f16 {
                t.to_dtype(DType::F16)?
            } else {
                t.clone()
            };
            Ok(t.to_dtype(self.dtype)?)
        };
        let (k, v) = (store(k)?, store(v)?);
        let out_dtype = q.dtype();
        let q = q.to_dtype(self.dtype)?;
        let keys = push(&mut self.k[layer], &k)?;
        let values = push(&mut self.v[layer], &v)?;
        let (h, d) = q.dims2()?;
        let g = keys.dim(0)?;
        let qg = q.reshape((g, h / g, d))?; // query head h reads K/V head h / (h / g)
        let scores = (qg.matmul(&keys.t()?)? * (1.0 / (d as f64).sqrt()))?; // [G, r, T]
        let e = scores
            .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
            .exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        Ok(p.matmul(&values)?.reshape((h, d))?.to_dtype(out_dtype)?)
    }
}
