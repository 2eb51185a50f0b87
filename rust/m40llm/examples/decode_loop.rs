//! A decode loop shaped like a small decoder: for every step, every layer appends one token of
//! K/V to each sequence (one batched call) and runs batched attention over all sequences; the attention output of one
//! layer becomes the query of the next (a stand-in for the layer's other work). Prints the
//! device and the decode throughput. The prompt is appended (and its causal attention run) on
//! the main thread and the decode loop runs on a worker thread that owns the context, the
//! cache and the buffers (they are `Send` and carry no lifetimes).
//!
//! ```text
//! cargo run --release --example decode_loop -- [--backend auto|cuda|cpu] [--device N]
//!     [--layers N] [--seqs N] [--heads N] [--kv-heads N] [--head-dim N]
//!     [--prompt N] [--steps N]
//! ```

use std::time::Instant;

use m40llm::{Backend, Context, DeviceBuffer, KvCache, KvCacheConfig, Result};

struct Args {
    backend: Backend,
    device: u32,
    layers: Option<usize>,
    seqs: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    prompt: Option<usize>,
    steps: Option<usize>,
}

fn parse_args() -> Args {
    let mut a = Args {
        backend: Backend::Auto,
        device: 0,
        layers: None,
        seqs: 8,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        prompt: None,
        steps: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.chunks(2);
    for pair in &mut it {
        let (key, val) = match pair {
            [k, v] => (k.as_str(), v.as_str()),
            [k] => {
                eprintln!("missing value for {k}");
                std::process::exit(2);
            }
            _ => unreachable!(),
        };
        let num = || -> usize {
            val.parse().unwrap_or_else(|_| {
                eprintln!("{key} needs a number, got {val:?}");
                std::process::exit(2)
            })
        };
        match key {
            "--backend" => {
                a.backend = match val {
                    "auto" => Backend::Auto,
                    "cuda" => Backend::Cuda,
                    "cpu" => Backend::Cpu,
                    _ => {
                        eprintln!("--backend is auto, cuda or cpu");
                        std::process::exit(2)
                    }
                }
            }
            "--device" => a.device = num() as u32,
            "--layers" => a.layers = Some(num()),
            "--seqs" => a.seqs = num(),
            "--heads" => a.heads = num(),
            "--kv-heads" => a.kv_heads = num(),
            "--head-dim" => a.head_dim = num(),
            "--prompt" => a.prompt = Some(num()),
            "--steps" => a.steps = Some(num()),
            _ => {
                eprintln!("unknown option {key} (see the example's source for the options)");
                std::process::exit(2);
            }
        }
    }
    a
}

/// Deterministic filler data in [-1, 1).
fn filler(n: usize, salt: u64) -> Vec<f32> {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() -> Result<()> {
    let args = parse_args();
    let ctx = Context::builder()
        .backend(args.backend)
        .device(args.device)
        .build()?;
    let gpu = ctx.backend() == Backend::Cuda;
    // The CPU backend is a reference path: keep its default workload small.
    let layers = args.layers.unwrap_or(if gpu { 32 } else { 2 });
    let prompt = args.prompt.unwrap_or(if gpu { 1024 } else { 128 });
    let steps = args.steps.unwrap_or(if gpu { 128 } else { 8 });
    let seqs = args.seqs;

    println!(
        "m40llm {} on {}",
        m40llm::library_version(),
        ctx.device_info()?
    );
    let cfg = KvCacheConfig::new(layers, args.heads, args.head_dim)
        .kv_heads(args.kv_heads)
        .max_seqs(seqs)
        .max_seq_len(prompt + steps);
    println!(
        "{layers} layers x {seqs} sequences, {} heads / {} KV heads x {}, prompt {prompt}, {steps} steps; cache {:.1} MiB",
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.bytes_needed()? as f64 / (1u64 << 20) as f64
    );
    let mut kv = KvCache::new(&ctx, &cfg)?;
    let (kv_row, q_row) = (cfg.kv_row_len(), cfg.q_row_len());

    let ids: Vec<usize> = (0..seqs).collect();

    // Prefill: the whole prompt of every sequence in one batched append per layer, then the
    // prompt rows' causal attention (each over the prompt up to itself) in one call.
    let t0 = Instant::now();
    if prompt > 0 {
        let k = DeviceBuffer::from_slice(&ctx, &filler(seqs * prompt * kv_row, 1))?;
        let v = DeviceBuffer::from_slice(&ctx, &filler(seqs * prompt * kv_row, 2))?;
        let q = DeviceBuffer::from_slice(&ctx, &filler(seqs * prompt * q_row, 5))?;
        let mut out = DeviceBuffer::<f32>::zeros(&ctx, seqs * prompt * q_row)?;
        let counts = vec![prompt; seqs];
        for layer in 0..layers {
            kv.append_batch(layer, &ids, &counts, &k, &v)?;
            kv.attention_causal(layer, &ids, &counts, &q, &mut out, None, None)?;
        }
        assert!(
            out.to_vec()?.iter().all(|x| x.is_finite()),
            "non-finite prompt attention output"
        );
    }
    ctx.synchronize()?;
    let prefill = t0.elapsed();

    // Per-step inputs: one new K/V row per sequence (reused: a model would compute them).
    let k_new = DeviceBuffer::from_slice(&ctx, &filler(seqs * kv_row, 3))?;
    let v_new = DeviceBuffer::from_slice(&ctx, &filler(seqs * kv_row, 4))?;
    let mut q = DeviceBuffer::from_slice(&ctx, &filler(seqs * q_row, 5))?;
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, seqs * q_row)?;

    // Decode on a worker thread that takes ownership of everything it uses.
    let worker = std::thread::spawn(move || -> Result<_> {
        let t1 = Instant::now();
        for _step in 0..steps {
            for layer in 0..layers {
                // One call stores every sequence's new token (row i for ids[i]).
                kv.append_token_batch(layer, &ids, &k_new, &v_new)?;
                kv.attention_batch(layer, &ids, &q, &mut out, None)?;
                q.copy_from_device(&out)?;
            }
        }
        ctx.synchronize()?;
        Ok((t1.elapsed(), kv, out))
    });
    let (decode, kv, out) = worker.join().expect("the decode thread panicked")?;

    let last = out.to_vec()?;
    assert!(
        last.iter().all(|x| x.is_finite()),
        "non-finite attention output"
    );
    let tokens = (seqs * steps) as f64;
    println!(
        "prefill {:.1} ms; decode {steps} steps in {:.1} ms: {:.2} ms/step, {:.0} tokens/s ({} sequences)",
        prefill.as_secs_f64() * 1e3,
        decode.as_secs_f64() * 1e3,
        decode.as_secs_f64() * 1e3 / steps.max(1) as f64,
        tokens / decode.as_secs_f64(),
        seqs
    );
    println!("final length per sequence: {}", kv.seq_len(0, 0)?);
    Ok(())
}
