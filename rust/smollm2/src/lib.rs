//! SmolLM2 (a Llama-architecture model) generating text with candle for the transformer and
//! m40llm for the KV cache and attention, checked against a pure-candle attention path of the
//! same model. The example is `src/main.rs`; the README says how to run it.

pub mod attention;
pub mod model;
pub mod tokenizer;

pub use attention::{Attention, CandleAttention, M40Attention};
pub use model::{Config, Model};
pub use tokenizer::Tokenizer;

use anyhow::Result;
use std::time::{Duration, Instant};

/// One path's decoding state: the model, its attention, the position, its time.
pub struct Decoder<A: Attention> {
    pub model: Model,
    pub attn: A,
    pub pos: usize,
    pub elapsed: Duration,
}

impl<A: Attention> Decoder<A> {
    pub fn new(model: Model, attn: A) -> Self {
        Decoder {
            model,
            attn,
            pos: 0,
            elapsed: Duration::ZERO,
        }
    }

    /// Runs one token at the next position and returns the next-token logits.
    pub fn feed(&mut self, token: u32) -> Result<Vec<f32>> {
        let t0 = Instant::now();
        let logits = self.model.forward_token(token, self.pos, &mut self.attn)?;
        self.elapsed += t0.elapsed();
        self.pos += 1;
        Ok(logits)
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Largest logit minus the second largest.
pub fn top2_gap(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in x {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// `|x - reference| / |reference|` (L2 norms, f64).
pub fn rel_err(x: &[f32], reference: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &r) in x.iter().zip(reference) {
        num += (a as f64 - r as f64).powi(2);
        den += (r as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// One generated position of the lockstep run.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    /// The m40llm path's greedy token, and the candle path's.
    pub m40: u32,
    pub candle: u32,
    /// Relative error of the m40llm logits against candle's at this step.
    pub rel_err: f64,
    /// Candle's top-2 logit gap at this step.
    pub gap: f32,
    /// Both paths had consumed the same tokens so far (the logits compare like for like).
    pub same_prefix: bool,
}

pub struct Comparison {
    /// Largest logits relative error over the prompt positions.
    pub prompt_rel_err: f64,
    pub steps: Vec<Step>,
    /// Time spent in each path (model and attention) on the prompt and on the generation.
    pub m40_prompt: Duration,
    pub candle_prompt: Duration,
    pub m40_gen: Duration,
    pub candle_gen: Duration,
}

impl Comparison {
    /// The first step where the greedy tokens differ.
    pub fn first_difference(&self) -> Option<usize> {
        self.steps.iter().position(|s| s.m40 != s.candle)
    }

    pub fn max_rel_err(&self) -> f64 {
        self.steps
            .iter()
            .filter(|s| s.same_prefix)
            .map(|s| s.rel_err)
            .fold(self.prompt_rel_err, f64::max)
    }

    /// The self-check: the greedy tokens agree for every step, or the first difference comes
    /// where candle's top-2 gap is below `tie` (either token is a fair greedy choice).
    pub fn tokens_agree(&self, tie: f32) -> bool {
        match self.first_difference() {
            None => true,
            Some(i) => self.steps[i].gap < tie,
        }
    }

    pub fn m40_tokens(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.m40).collect()
    }

    pub fn candle_tokens(&self) -> Vec<u32> {
        self.steps.iter().map(|s| s.candle).collect()
    }
}

/// Feeds `prompt` token by token to both paths, then decodes `n_new` tokens greedily on each
/// (each path continues from its own tokens, past an end-of-sequence token too), comparing
/// their logits at every step.
pub fn compare<A: Attention, B: Attention>(
    m40: &mut Decoder<A>,
    candle: &mut Decoder<B>,
    prompt: &[u32],
    n_new: usize,
) -> Result<Comparison> {
    anyhow::ensure!(!prompt.is_empty(), "empty prompt");
    let mut prompt_rel_err = 0.0f64;
    let (mut lm, mut lc) = (Vec::new(), Vec::new());
    for &t in prompt {
        lm = m40.feed(t)?;
        lc = candle.feed(t)?;
        prompt_rel_err = prompt_rel_err.max(rel_err(&lm, &lc));
    }
    let (m40_prompt, candle_prompt) = (m40.elapsed, candle.elapsed);
    let mut steps = Vec::with_capacity(n_new);
    let mut same_prefix = true;
    for i in 0..n_new {
        let s = Step {
            m40: argmax(&lm),
            candle: argmax(&lc),
            rel_err: rel_err(&lm, &lc),
            gap: top2_gap(&lc),
            same_prefix,
        };
        steps.push(s);
        same_prefix &= s.m40 == s.candle;
        if i + 1 < n_new {
            lm = m40.feed(s.m40)?;
            lc = candle.feed(s.candle)?;
        }
    }
    Ok(Comparison {
        prompt_rel_err,
        steps,
        m40_prompt,
        candle_prompt,
        m40_gen: m40.elapsed - m40_prompt,
        candle_gen: candle.elapsed - candle_prompt,
    })
}
