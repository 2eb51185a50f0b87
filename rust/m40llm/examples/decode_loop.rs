//! A decode loop shaped like a small decoder: for every step, every layer appends one token of
//! K/V to each sequence and attends over all of them in one call (`append_attention_batch`);
//! the attention output of one layer becomes the query of the next (a stand-in for the layer's
//! other work). Prints the device, the decode throughput and, on a GPU, the step's time
//! against the K/V bytes it reads over the device's copy bandwidth (measured here: a device to
//! device copy of a large buffer, bytes read + written). The prompt is appended (and its
//! causal attention run) on the main thread and the decode loop runs on a worker thread that
//! owns the context, the cache and the buffers (they are `Send` and carry no lifetimes).
//!
//! On a GPU it then runs the same number of steps as one CUDA graph a step ([`Graph`]: each
//! step's calls captured again and applied to the graph, updated in place where the kernels
//! launched are the same, then launched), as the C example (`examples/decode_loop.c`) does.
//!
//! ```text
//! cargo run --release --example decode_loop -- [--backend auto|cuda|cpu] [--device N]
//!     [--layers N] [--seqs N] [--heads N] [--kv-heads N] [--head-dim N]
//!     [--prompt N] [--steps N]
//! ```

use std::time::{Duration, Instant};

use m40llm::{Backend, Context, DeviceBuffer, Graph, KvCache, KvCacheConfig, Result};

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

/// Device-to-device copy bandwidth in GB/s (bytes read + written), timed on the host around
/// copies of 2 x 256 MiB queued back to back.
fn copy_bandwidth(ctx: &Context) -> Result<f64> {
    const N: usize = 64 << 20; // f32s: 256 MiB
    const REPS: u32 = 10;
    let src = DeviceBuffer::<f32>::zeros(ctx, N)?;
    let mut dst = DeviceBuffer::<f32>::zeros(ctx, N)?;
    dst.copy_from_device(&src)?; // warm
    ctx.synchronize()?;
    let t = Instant::now();
    for _ in 0..REPS {
        dst.copy_from_device(&src)?;
    }
    ctx.synchronize()?;
    Ok(2.0 * (N * 4) as f64 * REPS as f64 / t.elapsed().as_secs_f64() / 1e9)
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
        .max_seq_len(prompt + steps * if gpu { 2 } else { 1 } + 1); // a warm-up step, the
                                                                    // steps (eager, graph)
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
    let copy_gbps = if gpu {
        let gbps = copy_bandwidth(&ctx)?;
        println!("copy bandwidth: {gbps:.0} GB/s (device to device, bytes read + written)");
        Some(gbps)
    } else {
        None
    };

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
        let step = |kv: &mut KvCache, q: &mut DeviceBuffer<f32>, out: &mut DeviceBuffer<f32>| {
            for layer in 0..layers {
                // One call stores every sequence's new token (row i for ids[i]) and attends.
                kv.append_attention_batch(layer, &ids, &k_new, &v_new, &*q, out, None)?;
                q.copy_from_device(&*out)?;
            }
            Ok::<(), m40llm::Error>(())
        };
        step(&mut kv, &mut q, &mut out)?; // warm-up: the first calls load the kernels
        ctx.synchronize()?;
        let t1 = Instant::now();
        for _step in 0..steps {
            step(&mut kv, &mut q, &mut out)?;
        }
        ctx.synchronize()?;
        let eager = t1.elapsed();
        // The same steps as graphs: captured (the calls move the lengths as they are made, and
        // the graph bakes them in), applied to the one graph, launched.
        let mut graphed = None;
        if gpu {
            let (mut graph, mut updated) = (None::<Graph>, 0);
            let t2 = Instant::now();
            for _step in 0..steps {
                let calls = || step(&mut kv, &mut q, &mut out);
                match graph.as_mut() {
                    None => graph = Some(Graph::capture(&ctx, calls)?),
                    Some(g) => updated += g.recapture(calls)? as usize,
                }
                graph.as_ref().expect("captured above").launch()?;
            }
            ctx.synchronize()?;
            graphed = Some((t2.elapsed(), updated));
        }
        Ok((eager, graphed, kv, out))
    });
    let (decode, graphed, kv, out) = worker.join().expect("the decode thread panicked")?;

    let last = out.to_vec()?;
    assert!(
        last.iter().all(|x| x.is_finite()),
        "non-finite attention output"
    );
    let tokens = (seqs * steps) as f64;
    let step_time = decode / steps.max(1) as u32;
    println!(
        "prefill {:.1} ms; decode {steps} steps in {:.1} ms: {:.3} ms/step, {:.0} tokens/s ({} sequences)",
        prefill.as_secs_f64() * 1e3,
        decode.as_secs_f64() * 1e3,
        step_time.as_secs_f64() * 1e3,
        tokens / decode.as_secs_f64(),
        seqs
    );
    if let Some(gbps) = copy_gbps {
        // The K and V (FP16) every step reads: each sequence's positions after its append, in
        // every layer, averaged over the timed steps (after the prompt and the warm-up step).
        let kv_bytes = |mean_len: f64| 2.0 * 2.0 * (kv_row * layers * seqs) as f64 * mean_len;
        let bytes = kv_bytes((prompt + 1) as f64 + (steps as f64 + 1.0) / 2.0);
        let at_copy = Duration::from_secs_f64(bytes / (gbps * 1e9));
        println!(
            "a step reads {:.3} GB of K/V: {:.3} ms at the copy bandwidth; the step takes {:.2}x that",
            bytes / 1e9,
            at_copy.as_secs_f64() * 1e3,
            step_time.as_secs_f64() / at_copy.as_secs_f64()
        );
        if let Some((graph, updated)) = graphed {
            let bytes = kv_bytes((prompt + 1 + steps) as f64 + (steps as f64 + 1.0) / 2.0);
            let per_step = graph.as_secs_f64() / steps.max(1) as f64;
            println!(
                "as graphs: {:.3} ms/step ({updated} of {steps} re-captures updated in place), {:.2}x the step's K/V bytes over the copy bandwidth",
                per_step * 1e3,
                per_step / (bytes / (gbps * 1e9))
            );
        }
    }
    println!("final length per sequence: {}", kv.seq_len(0, 0)?);
    Ok(())
}
