//! A Llama-architecture decoder (SmolLM2) in candle, one token at a time, with attention
//! behind the [`Attention`] trait so that the K/V cache and attention can be m40llm's or
//! candle's own.
//!
//! Conventions (as `bench/fidelity/model.py`, checked there against llama.cpp): GGUF stores the
//! rows of `attn_q`/`attn_k` permuted by llama.cpp's converter so that RoPE rotates adjacent
//! pairs `(x[2i], x[2i+1])` by `pos * base^(-2i/head_dim)` (ggml's NORM RoPE). q and K stay in
//! that order, in the cache too; dot products do not care. Query head `h` reads K/V head
//! `h / (n_heads / n_kv_heads)`, m40llm's GQA mapping and llama.cpp's.

use crate::Attention;
use anyhow::{bail, ensure, Context as _, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

/// The hyperparameters, each read from the GGUF metadata.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_ffn: usize,
    pub vocab: usize,
    pub rope_base: f64,
    pub rms_eps: f64,
    pub context_len: usize,
}

impl Config {
    pub fn from_gguf(c: &Content) -> Result<Config> {
        let get = |k: &str| {
            c.metadata
                .get(k)
                .with_context(|| format!("GGUF has no {k}"))
        };
        let arch = get("general.architecture")?.to_string()?.clone();
        if arch != "llama" {
            bail!("general.architecture is {arch:?}: only llama is implemented");
        }
        let u = |k: &str| -> Result<usize> {
            let v = get(&format!("{arch}.{k}"))?;
            Ok(v.to_u64().or_else(|_| v.to_u32().map(u64::from))? as usize)
        };
        let f = |k: &str| -> Result<f64> { Ok(get(&format!("{arch}.{k}"))?.to_f32()? as f64) };
        let d_model = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let head_dim = d_model / n_heads;
        let cfg = Config {
            n_layers: u("block_count")?,
            d_model,
            n_heads,
            n_kv_heads: u("attention.head_count_kv")?,
            head_dim,
            d_ffn: u("feed_forward_length")?,
            vocab: get("tokenizer.ggml.tokens")?.to_vec()?.len(),
            rope_base: f("rope.freq_base")?,
            rms_eps: f("attention.layer_norm_rms_epsilon")?,
            context_len: u("context_length")?,
        };
        if let Ok(n) = u("rope.dimension_count") {
            ensure!(
                n == head_dim,
                "rope.dimension_count {n} != head_dim {head_dim}: partial RoPE is not implemented"
            );
        }
        if let Ok(n) = u("vocab_size") {
            ensure!(
                n == cfg.vocab,
                "{arch}.vocab_size {n} != {} tokens",
                cfg.vocab
            );
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.n_heads * self.head_dim == self.d_model,
            "d_model is not n_heads × head_dim"
        );
        ensure!(
            self.n_kv_heads > 0 && self.n_heads.is_multiple_of(self.n_kv_heads),
            "n_heads is not a multiple of n_kv_heads"
        );
        ensure!(
            self.head_dim.is_multiple_of(2),
            "RoPE needs an even head_dim"
        );
        Ok(())
    }
}

struct Layer {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
}

/// `x W^T` for a weight stored `[out, in]` as GGUF (and PyTorch) store it.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

/// Weights on one candle device. Cloning is cheap (tensors are shared).
#[derive(Clone)]
pub struct Model {
    pub cfg: Config,
    /// Whether the output projection is the token embedding (no `output.weight`).
    pub tied_output: bool,
    embed: Tensor,
    layers: Arc<Vec<Layer>>,
    out_norm: Tensor,
    lm_head: Tensor,
    device: Device,
}

impl Model {
    /// Loads every tensor of a GGUF file and dequantizes it to FP32 with candle (Q4_1 and
    /// Q8_0 here: about 0.6 GB for SmolLM2-135M). FP32 matmuls keep the two attention paths'
    /// comparison clean: candle's quantized matmul rounds activations to 8 bits, which turns
    /// differences in the last bits into visible ones; on this CPU they are also faster.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<(Model, Content)> {
        let mut file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let content =
            Content::read(&mut file).with_context(|| format!("reading GGUF {}", path.display()))?;
        let cfg = Config::from_gguf(&content)?;
        let mut t = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let w = content
                .tensor(&mut file, name, device)
                .and_then(|q| q.dequantize(device))
                .with_context(|| format!("tensor {name}"))?;
            ensure!(
                w.dims() == shape,
                "{name} is {:?}, expected {shape:?}",
                w.dims()
            );
            Ok(w)
        };
        let (d, kv, f) = (cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.d_ffn);
        let embed = t("token_embd.weight", &[cfg.vocab, d])?;
        let tied_output = !content.tensor_infos.contains_key("output.weight");
        let lm_head = if tied_output {
            embed.clone()
        } else {
            t("output.weight", &[cfg.vocab, d])?
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let mut w = |n: &str, shape: &[usize]| t(&format!("blk.{i}.{n}.weight"), shape);
            layers.push(Layer {
                attn_norm: w("attn_norm", &[d])?,
                wq: w("attn_q", &[d, d])?,
                wk: w("attn_k", &[kv, d])?,
                wv: w("attn_v", &[kv, d])?,
                wo: w("attn_output", &[d, d])?,
                ffn_norm: w("ffn_norm", &[d])?,
                w_gate: w("ffn_gate", &[f, d])?,
                w_up: w("ffn_up", &[f, d])?,
                w_down: w("ffn_down", &[d, f])?,
            });
        }
        let out_norm = t("output_norm.weight", &[d])?;
        let model = Model {
            cfg,
            tied_output,
            embed,
            layers: Arc::new(layers),
            out_norm,
            lm_head,
            device: device.clone(),
        };
        Ok((model, content))
    }

    /// A model of random FP32 weights (deterministic in `seed`), for tests: matrices scaled by
    /// 1/sqrt(fan-in), norm gains near 1, a tied output.
    pub fn random(cfg: Config, seed: u64, device: &Device) -> Result<Model> {
        cfg.validate()?;
        let mut rng = SplitMix(seed);
        let mut mat = |rows: usize, cols: usize, scale: f32| -> Result<Tensor> {
            let data: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric() * scale).collect();
            Ok(Tensor::from_vec(data, (rows, cols), device)?)
        };
        let d = cfg.d_model;
        let kv = cfg.n_kv_heads * cfg.head_dim;
        let s = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let mut layers = Vec::new();
        for _ in 0..cfg.n_layers {
            layers.push(Layer {
                attn_norm: mat(1, d, 0.2)?.affine(1.0, 1.0)?.flatten_all()?,
                // Larger q/k make the attention weights far from uniform.
                wq: mat(d, d, 3.0 * s(d))?,
                wk: mat(kv, d, 3.0 * s(d))?,
                wv: mat(kv, d, s(d))?,
                wo: mat(d, d, s(d))?,
                ffn_norm: mat(1, d, 0.2)?.affine(1.0, 1.0)?.flatten_all()?,
                w_gate: mat(cfg.d_ffn, d, s(d))?,
                w_up: mat(cfg.d_ffn, d, s(d))?,
                w_down: mat(d, cfg.d_ffn, s(cfg.d_ffn))?,
            });
        }
        let embed = mat(cfg.vocab, d, 1.0)?;
        Ok(Model {
            cfg,
            tied_output: true,
            lm_head: embed.clone(),
            embed,
            layers: Arc::new(layers),
            out_norm: mat(1, d, 0.2)?.affine(1.0, 1.0)?.flatten_all()?,
            device: device.clone(),
        })
    }

    /// Runs `token` at position `pos` (the positions before it are in `attn`'s cache) and
    /// returns the next-token logits, `[vocab]` FP32 on the host.
    pub fn forward_token(
        &self,
        token: u32,
        pos: usize,
        attn: &mut dyn Attention,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        ensure!(
            (token as usize) < c.vocab,
            "token {token} is outside the vocabulary ({})",
            c.vocab
        );
        let (cos, sin) = self.rope_row(pos)?;
        let ids = Tensor::new(&[token], &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [1, d]
        for (li, l) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &l.attn_norm, c.rms_eps)?;
            let q = rope(
                &linear(&h, &l.wq)?.reshape((c.n_heads, c.head_dim))?,
                &cos,
                &sin,
            )?;
            let k = rope(
                &linear(&h, &l.wk)?.reshape((c.n_kv_heads, c.head_dim))?,
                &cos,
                &sin,
            )?;
            let v = linear(&h, &l.wv)?.reshape((c.n_kv_heads, c.head_dim))?;
            let o = attn.attend(li, &q, &k, &v)?.reshape((1, c.d_model))?;
            x = (x + linear(&o, &l.wo)?)?;
            let h = rms_norm(&x, &l.ffn_norm, c.rms_eps)?;
            let act = (linear(&h, &l.w_gate)?.silu()? * linear(&h, &l.w_up)?)?;
            x = (x + linear(&act, &l.w_down)?)?;
        }
        let h = rms_norm(&x, &self.out_norm, c.rms_eps)?;
        Ok(linear(&h, &self.lm_head)?
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1()?)
    }

    /// cos and sin of `pos * base^(-2i/head_dim)`, `[1, head_dim/2]` each (angles in f64).
    fn rope_row(&self, pos: usize) -> Result<(Tensor, Tensor)> {
        let half = self.cfg.head_dim / 2;
        let ang: Vec<f64> = (0..half)
            .map(|i| {
                pos as f64
                    * self
                        .cfg
                        .rope_base
                        .powf(-2.0 * i as f64 / self.cfg.head_dim as f64)
            })
            .collect();
        let cos: Vec<f32> = ang.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = ang.iter().map(|a| a.sin() as f32).collect();
        Ok((
            Tensor::from_vec(cos, (1, half), &self.device)?,
            Tensor::from_vec(sin, (1, half), &self.device)?,
        ))
    }
}

fn rms_norm(x: &Tensor, gain: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(1)?;
    Ok(x.broadcast_div(&ms.affine(1.0, eps)?.sqrt()?)?
        .broadcast_mul(gain)?)
}

/// Rotates adjacent pairs of `x` (`[heads, head_dim]`) by the row's angles.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (h, d) = x.dims2()?;
    let pairs = x.reshape((h, d / 2, 2))?;
    let x0 = pairs.narrow(2, 0, 1)?.squeeze(2)?;
    let x1 = pairs.narrow(2, 1, 1)?.squeeze(2)?;
    let r0 = (x0.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    let r1 = (x0.broadcast_mul(sin)? + x1.broadcast_mul(cos)?)?;
    Ok(Tensor::stack(&[r0, r1], 2)?.reshape((h, d))?)
}

/// SplitMix64: reproducible test weights without a rand dependency.
struct SplitMix(u64);

impl SplitMix {
    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}
