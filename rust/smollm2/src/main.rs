//! SmolLM2-135M-Instruct generating text greedily: candle runs the transformer, m40llm holds
//! the KV cache and runs attention. A pure-candle attention path of the same model runs in
//! lockstep as the check. See README.md.

use anyhow::{bail, Context as _, Result};
use candle_core::Device;
use m40llm::{Backend, Context, KvCacheConfig, KvFormat, KvRotation};
use smollm2::{compare, CandleAttention, Decoder, M40Attention, Model, Tokenizer};
use std::path::PathBuf;

const USAGE: &str = "usage: smollm2 [GGUF] [options]
  GGUF              SmolLM2-135M-Instruct.Q4_1.gguf (bench/fidelity/fetch_model.sh fetches it;
                    default: $M40LLM_CACHE or ~/.cache/m40llm, then that file name)
  --prompt TEXT     the user's message, put in the chat template
  --raw TEXT        a prompt used as is (no chat template)
  --new N           tokens to generate (default 64)
  --format F        K/V format: f16 (default), q8, q4
  --v-format F      V's format apart from K's
  --rotation R      auto (default), none, k, kv
  --sinks N         protected first tokens of quantized caches (library default: 4)
  --window N        protected recent tokens of quantized caches (library default: 128)
  --backend B       m40llm's backend: auto (default: CUDA if usable, else CPU), cpu, cuda
  --tie G           the check's near-tie top-2 gap (default 0.05)
  --quiet           no per-step table";

const SYSTEM: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
const DEFAULT_PROMPT: &str =
    "Write a short story about a robot who learns to paint. Use about 100 words.";

struct Args {
    gguf: PathBuf,
    prompt: String,
    n_new: usize,
    format: KvFormat,
    v_format: Option<KvFormat>,
    rotation: KvRotation,
    sinks: Option<usize>,
    window: Option<usize>,
    backend: Backend,
    tie: f32,
    quiet: bool,
}

fn chat(user: &str) -> String {
    format!("<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

fn format_arg(s: &str) -> Result<KvFormat> {
    Ok(match s {
        "f16" => KvFormat::F16,
        "q8" => KvFormat::Q8,
        "q4" => KvFormat::Q4,
        _ => bail!("unknown format {s:?} (f16, q8, q4)"),
    })
}

fn default_gguf() -> PathBuf {
    let cache = std::env::var_os("M40LLM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/m40llm")
        });
    cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn parse() -> Result<Args> {
    let mut a = Args {
        gguf: default_gguf(),
        prompt: chat(DEFAULT_PROMPT),
        n_new: 64,
        format: KvFormat::F16,
        v_format: None,
        rotation: KvRotation::Auto,
        sinks: None,
        window: None,
        backend: Backend::Auto,
        tie: 0.05,
        quiet: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || {
            it.next()
                .with_context(|| format!("{arg} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "--prompt" => a.prompt = chat(&val()?),
            "--raw" => a.prompt = val()?,
            "--new" => a.n_new = val()?.parse()?,
            "--format" => a.format = format_arg(&val()?)?,
            "--v-format" => a.v_format = Some(format_arg(&val()?)?),
            "--rotation" => {
                a.rotation = match val()?.as_str() {
                    "auto" => KvRotation::Auto,
                    "none" => KvRotation::None,
                    "k" => KvRotation::K,
                    "kv" => KvRotation::KV,
                    r => bail!("unknown rotation {r:?} (auto, none, k, kv)"),
                }
            }
            "--sinks" => a.sinks = Some(val()?.parse()?),
            "--window" => a.window = Some(val()?.parse()?),
            "--backend" => {
                a.backend = match val()?.as_str() {
                    "auto" => Backend::Auto,
                    "cpu" => Backend::Cpu,
                    "cuda" => Backend::Cuda,
                    b => bail!("unknown backend {b:?} (auto, cpu, cuda)"),
                }
            }
            "--tie" => a.tie = val()?.parse()?,
            "--quiet" => a.quiet = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            s if !s.starts_with('-') => a.gguf = PathBuf::from(s),
            s => bail!("unknown option {s}\n{USAGE}"),
        }
    }
    if a.n_new == 0 {
        bail!("--new must be at least 1");
    }
    Ok(a)
}

fn candle_device() -> Result<Device> {
    #[cfg(feature = "cuda")]
    return Ok(Device::cuda_if_available(0)?);
    #[cfg(not(feature = "cuda"))]
    Ok(Device::Cpu)
}

fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn main() -> Result<()> {
    let a = parse()?;
    if !a.gguf.exists() {
        bail!(
            "no model at {} (bench/fidelity/fetch_model.sh downloads it)\n{USAGE}",
            a.gguf.display()
        );
    }
    let device = candle_device()?;
    let t0 = std::time::Instant::now();
    let (model, content) = Model::from_gguf(&a.gguf, &device)?;
    let tok = Tokenizer::from_gguf(&content)?;
    drop(content);
    let c = model.cfg;
    println!(
        "model: {} ({:.1} s): llama, {} layers, d_model {}, {}/{} heads (GQA), head_dim {}, ffn {}, \
         vocab {}, RoPE base {}, RMS eps {:e}, context {}, {} output",
        a.gguf.display(),
        t0.elapsed().as_secs_f64(),
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.d_ffn,
        c.vocab,
        c.rope_base,
        c.rms_eps,
        c.context_len,
        if model.tied_output { "tied" } else { "separate" }
    );
    println!("candle: {device:?}");

    let prompt = tok.encode(&a.prompt);
    let max_len = prompt.len() + a.n_new;
    if max_len > c.context_len {
        bail!(
            "prompt + --new = {max_len} tokens is over the model's context ({})",
            c.context_len
        );
    }
    // With candle on a GPU, m40llm on candle's device and stream: tensors pass without copies.
    let ctx = if device.is_cuda() && a.backend != Backend::Cpu {
        Context::from_candle_device(&device)?
    } else {
        Context::new(a.backend)?
    };
    let mut kv_cfg = KvCacheConfig::new(c.n_layers, c.n_heads, c.head_dim)
        .kv_heads(c.n_kv_heads)
        .max_seqs(1)
        .max_seq_len(max_len)
        .format(a.format)
        .rotation(a.rotation);
    if let Some(f) = a.v_format {
        kv_cfg = kv_cfg.v_format(f);
    }
    if let Some(n) = a.sinks {
        kv_cfg = kv_cfg.sinks(n);
    }
    if let Some(n) = a.window {
        kv_cfg = kv_cfg.window(n);
    }
    let m40 = M40Attention::new(&ctx, &kv_cfg)?;
    let kc = *m40.cache().config();
    let kv_bytes = kc.bytes_needed()?;
    println!(
        "m40llm {}: {}",
        m40llm::library_version(),
        ctx.device_info()?
    );
    let v_format = kc.v_format.unwrap_or(kc.format);
    let quantized = kc.format != KvFormat::F16 || v_format != KvFormat::F16;
    let options = if quantized {
        format!(
            ", rotation {:?}, sinks {}, window {}",
            kc.rotation, kc.n_sinks, kc.window
        )
    } else {
        String::new()
    };
    println!(
        "m40llm cache: K {:?} V {v_format:?}{options}: {} for {max_len} positions ({} bytes a token)",
        kc.format,
        mib(kv_bytes),
        kv_bytes / max_len
    );
    if quantized && max_len <= kc.n_sinks + kc.window {
        println!(
            "note: all {max_len} positions stay in the FP16 sinks + window: the quantized codes are \
             never read (--window 16, or --sinks 0 --window 0, to read them)"
        );
    }
    println!(
        "prompt: {} tokens, appended token by token (m40llm has no prefill call yet); then {} \
         greedy tokens on each path",
        prompt.len(),
        a.n_new
    );

    let mut m = Decoder::new(model.clone(), m40);
    let mut r = Decoder::new(model, CandleAttention::new(c.n_layers));
    let cmp = compare(&mut m, &mut r, &prompt, a.n_new)?;

    if !a.quiet {
        println!("step  m40llm  candle  logits rel err  candle top-2 gap");
        for (i, s) in cmp.steps.iter().enumerate() {
            let err = if s.same_prefix {
                format!("{:.2e}", s.rel_err)
            } else {
                "(diverged)".into()
            };
            let mark = if s.m40 != s.candle {
                "  <- differs"
            } else {
                ""
            };
            println!(
                "{i:4}  {:6}  {:6}  {err:>14}  {:16.3}{mark}",
                s.m40, s.candle, s.gap
            );
        }
    }
    let text = |ids: &[u32]| {
        let end = ids
            .iter()
            .position(|&t| Some(t) == tok.eos())
            .unwrap_or(ids.len());
        let mut s = tok.decode(&ids[..end]);
        if end < ids.len() {
            s.push_str(&format!(
                " [end of sequence at token {end}; the check decodes past it]"
            ));
        }
        s
    };
    println!(
        "--- m40llm:\n{}\n--- candle:\n{}\n---",
        text(&cmp.m40_tokens()),
        text(&cmp.candle_tokens())
    );
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64();
    let n_gen = a.n_new - 1; // the first token comes from the prompt's last position
    println!(
        "prompt (token by token): m40llm {:.1} tokens/s, candle {:.1} tokens/s",
        rate(prompt.len(), cmp.m40_prompt),
        rate(prompt.len(), cmp.candle_prompt)
    );
    if n_gen > 0 {
        println!(
            "generation: m40llm {:.1} tokens/s, candle {:.1} tokens/s",
            rate(n_gen, cmp.m40_gen),
            rate(n_gen, cmp.candle_gen)
        );
    }
    println!(
        "K/V memory at {} positions: m40llm {} (allocated for {max_len}), candle {} (FP32)",
        r.pos,
        mib(kv_bytes),
        mib(r.attn.bytes())
    );
    let agree = cmp.first_difference().unwrap_or(cmp.steps.len());
    println!(
        "logits rel err vs candle: prompt max {:.2e}, overall max {:.2e} (while the tokens agree)",
        cmp.prompt_rel_err,
        cmp.max_rel_err()
    );
    let verdict = if cmp.tokens_agree(a.tie) {
        "PASS"
    } else {
        "FAIL"
    };
    match cmp.first_difference() {
        None => println!("greedy tokens: all {} agree", cmp.steps.len()),
        Some(i) => println!(
            "greedy tokens: {agree} of {} agree; first difference at step {i}, candle's top-2 gap {:.4} \
             ({} the {} near-tie bound)",
            cmp.steps.len(),
            cmp.steps[i].gap,
            if cmp.steps[i].gap < a.tie { "under" } else { "over" },
            a.tie
        ),
    }
    if !quantized {
        println!("self-check (F16 cache: tokens agree, or the first difference is a near tie): {verdict}");
        if verdict == "FAIL" {
            std::process::exit(1);
        }
    } else {
        println!("self-check: not applied to a quantized cache (reported above: {verdict} by the F16 rule)");
    }
    Ok(())
}
