//! m40llm's attention path against candle's on a random-weight model of SmolLM2's
//! architecture (GQA, RoPE, RMSNorm, SwiGLU, tied output), small enough for CI.

use candle_core::Device;
use m40llm::{Backend, Context, KvCacheConfig, KvFormat, KvRotation};
use smollm2::{compare, CandleAttention, Comparison, Config, Decoder, M40Attention, Model};

const CFG: Config = Config {
    n_layers: 2,
    d_model: 192,
    n_heads: 6,
    n_kv_heads: 2,
    head_dim: 32,
    d_ffn: 160,
    vocab: 97,
    rope_base: 10000.0,
    rms_eps: 1e-5,
    context_len: 64,
};
const PROMPT: [u32; 5] = [3, 41, 7, 96, 0];
const NEW: usize = 20;

fn context() -> Context {
    let ctx = Context::new(Backend::Auto).expect("context");
    println!(
        "m40llm backend: {}",
        ctx.device_info().expect("device info")
    );
    ctx
}

fn kv_config() -> KvCacheConfig {
    KvCacheConfig::new(CFG.n_layers, CFG.n_heads, CFG.head_dim)
        .kv_heads(CFG.n_kv_heads)
        .max_seq_len(PROMPT.len() + NEW)
}

fn run(ctx: &Context, kv: &KvCacheConfig, reference: CandleAttention) -> Comparison {
    let model = Model::random(CFG, 0x5eed, &Device::Cpu).expect("model");
    let mut m = Decoder::new(model.clone(), M40Attention::new(ctx, kv).expect("cache"));
    let mut c = Decoder::new(model, reference);
    let r = compare(&mut m, &mut c, &PROMPT, NEW).expect("decode");
    for (i, s) in r.steps.iter().enumerate() {
        println!(
            "step {i:2}: m40llm {:3} candle {:3} rel err {:.2e} gap {:.3}",
            s.m40, s.candle, s.rel_err, s.gap
        );
    }
    r
}

/// Same tokens on every step (so every step's logits compare like for like), and every step's
/// logits within `tol`.
fn assert_close(r: &Comparison, tol: f64, what: &str) {
    assert_eq!(r.first_difference(), None, "{what}: greedy tokens differ");
    assert!(r.steps.iter().all(|s| s.same_prefix));
    let err = r.max_rel_err();
    println!("{what}: max logits rel err {err:.2e} (tolerance {tol:.0e})");
    assert!(err <= tol, "{what}: logits rel err {err:.3e} > {tol:.0e}");
}

/// Tolerance against [`CandleAttention::f16_cache_f64_math`]: the CPU backend accumulates in
/// FP64 like it, so only the last bit of its FP32 output differs (amplified ~100x by the two
/// layers: measured 4.4e-6); the CUDA kernels sum in FP32 (relative ~1e-6 an output).
fn same_kv_tolerance(ctx: &Context) -> f64 {
    match ctx.backend() {
        Backend::Cpu => 1e-5,
        _ => 5e-4,
    }
}

/// The F16 cache against candle computing the same thing (K/V rounded to FP16, FP64 math):
/// only summation order differs.
#[test]
fn f16_cache_matches_candle_on_the_same_fp16_kv() {
    let ctx = context();
    let r = run(
        &ctx,
        &kv_config(),
        CandleAttention::f16_cache_f64_math(CFG.n_layers),
    );
    assert_close(
        &r,
        same_kv_tolerance(&ctx),
        "F16 cache vs candle FP16 K/V, FP64 math",
    );
}

/// The F16 cache against the pure-candle path (FP32 K/V): FP16 rounding of K and V (a relative
/// 2^-11 a value) is the difference.
#[test]
fn f16_cache_matches_pure_candle() {
    let ctx = context();
    let r = run(&ctx, &kv_config(), CandleAttention::new(CFG.n_layers));
    assert_close(&r, 5e-3, "F16 cache vs pure candle");
    assert!(r.tokens_agree(0.05));
}

/// Quantized K/V (rotated, no protected tokens): what quantization costs, bounded. With every
/// position inside the protected FP16 window and no rotation, the codes are never read and the
/// result is the F16 cache's (with rotation, the FP16 copies are of the rotated rows: rounded
/// in another frame, a difference as large as FP16 rounding itself).
#[test]
fn quantized_caches() {
    let ctx = context();
    let plain = kv_config().sinks(0).window(0);
    let q8 = run(
        &ctx,
        &plain.format(KvFormat::Q8),
        CandleAttention::new(CFG.n_layers),
    );
    assert_close(&q8, 5e-2, "Q8 cache vs pure candle");
    let q4 = run(
        &ctx,
        &plain.format(KvFormat::Q4),
        CandleAttention::new(CFG.n_layers),
    );
    let (e8, e4) = (q8.max_rel_err(), q4.max_rel_err());
    println!("Q8 {e8:.2e}, Q4 {e4:.2e}");
    assert!(
        e4 > e8 && e4 < 0.5,
        "Q4's error {e4:.2e} should exceed Q8's {e8:.2e} and stay below 0.5"
    );
    let windowed = kv_config()
        .format(KvFormat::Q4)
        .rotation(KvRotation::None)
        .sinks(4)
        .window(PROMPT.len() + NEW);
    let r = run(
        &ctx,
        &windowed,
        CandleAttention::f16_cache_f64_math(CFG.n_layers),
    );
    let what = "Q4 cache, unrotated, every position in the FP16 window, vs FP16 K/V";
    assert_close(&r, same_kv_tolerance(&ctx), what);
}
