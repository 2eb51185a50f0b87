//! The CUDA backend against a float64 reference, on fresh random data (seed printed; set
//! M40LLM_TEST_SEED to replay). A custom harness (`harness = false`) so that without a GPU every
//! test is reported as skipped, never passed; M40LLM_REQUIRE_GPU=1 makes that a failure. It ends
//! with "N passed, N failed[, N skipped]" and exits non-zero on any failure.

mod common;

use std::sync::Arc;

use common::{
    check_attention_case, check_causal_case, default_scale, gpu_context, parse_archs,
    reference_attention, rel_l2, to_f16, Rng, Shape, TOL,
};
use m40llm::{
    build_info, f16, Backend, Context, DeviceBuffer, Graph, KvCache, KvCacheConfig, KvFormat,
    KvRotation, Status,
};

const LENS: [usize; 5] = [1, 31, 33, 257, 4099];

fn run_single_lengths(test: &str, head_dim: usize, n_heads: usize, n_kv_heads: usize) {
    let Some(ctx) = gpu_context(test) else { return };
    let mut rng = Rng::fresh(test);
    let s = Shape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    for len in LENS {
        let e = check_attention_case(&ctx, &mut rng, s, &[len], false, None);
        println!("{test}: len {len}: worst rel L2 {e:e}");
    }
    ctx.synchronize().unwrap();
}

fn mha_head_dim_64() {
    run_single_lengths("mha_head_dim_64", 64, 8, 8);
}

fn mha_head_dim_128() {
    run_single_lengths("mha_head_dim_128", 128, 8, 8);
}

fn gqa4_head_dim_64() {
    run_single_lengths("gqa4_head_dim_64", 64, 16, 4);
}

fn gqa4_head_dim_128() {
    run_single_lengths("gqa4_head_dim_128", 128, 32, 8);
}

fn batched_ragged() {
    let Some(ctx) = gpu_context("batched_ragged") else {
        return;
    };
    let mut rng = Rng::fresh("batched_ragged");
    for head_dim in [64, 128] {
        for (n_heads, n_kv_heads) in [(8, 8), (32, 8)] {
            let s = Shape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            // Ragged lengths including every required one, an empty sequence and a
            // single-token one; FP32 input with the default scale, then FP16 input with an
            // explicit scale.
            let lens = [4099, 0, 1, 31, 33, 257, 2, 1000, 64, 65];
            let e = check_attention_case(&ctx, &mut rng, s, &lens, false, None);
            println!("batched_ragged: {s:?}: worst rel L2 {e:e}");
            let e = check_attention_case(&ctx, &mut rng, s, &lens, true, Some(0.05));
            println!("batched_ragged (f16 input): {s:?}: worst rel L2 {e:e}");
        }
    }
}

fn batch_larger_than_one_launch() {
    // More sequences than one kernel launch carries (the library splits the batch).
    let Some(ctx) = gpu_context("batch_larger_than_one_launch") else {
        return;
    };
    let mut rng = Rng::fresh("batch_larger_than_one_launch");
    let s = Shape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let lens: Vec<usize> = (0..300).map(|_| rng.below(80)).collect();
    let e = check_attention_case(&ctx, &mut rng, s, &lens, false, None);
    println!("batch_larger_than_one_launch: worst rel L2 {e:e}");
}

fn gpu_matches_cpu_backend_bitwise_storage() {
    // Both backends round FP32 to FP16 the same way (round to nearest even) and run the same
    // sequence operations.
    let Some(gpu) = gpu_context("gpu_matches_cpu_backend_bitwise_storage") else {
        return;
    };
    let cpu = Context::new(Backend::Cpu).unwrap();
    let mut rng = Rng::fresh("gpu_matches_cpu_backend_bitwise_storage");
    let cfg = KvCacheConfig::new(2, 8, 64)
        .kv_heads(2)
        .max_seqs(3)
        .max_seq_len(300);
    let mut data = rng.normal_vec(200 * cfg.kv_row_len(), 3.0);
    // Include values that round in interesting ways: ties, subnormals, overflow to inf.
    data[..6].copy_from_slice(&[
        65520.0,
        -65504.0,
        1e-7,
        5.9604645e-8,
        2.9802322e-8,
        1.0009766,
    ]);
    let mut caches = Vec::new();
    for ctx in [&gpu, &cpu] {
        let mut kv = KvCache::new(ctx, &cfg).unwrap();
        let k = DeviceBuffer::from_slice(ctx, &data).unwrap();
        kv.append(1, 0, &k, &k).unwrap();
        kv.fork(2, 0).unwrap();
        kv.truncate(2, 150).unwrap();
        kv.append(
            1,
            2,
            &k.slice(..10 * cfg.kv_row_len()),
            &k.slice(..10 * cfg.kv_row_len()),
        )
        .unwrap();
        caches.push(kv);
    }
    for seq in [0, 2] {
        let n = caches[0].seq_len(1, seq).unwrap();
        assert_eq!(n, caches[1].seq_len(1, seq).unwrap());
        let a = caches[0].read_to_host(1, seq, 0, n).unwrap();
        let b = caches[1].read_to_host(1, seq, 0, n).unwrap();
        let same =
            a.0.iter()
                .zip(&b.0)
                .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "GPU and CPU stored different FP16 for seq {seq}");
    }
    assert_eq!(
        caches[0].read_to_host(1, 0, 0, 1).unwrap().0[0],
        f16::INFINITY
    );
}

/// Rotated quantized caches, and protected tokens where the CUDA backend has kernels for them,
/// against the CPU backend: the same stored FP16 (read back, bit for bit: both rotate and
/// quantize with the same FP32 operations) and attention within TOL, before and after a
/// truncate and more appends (which move the window). A backend without kernels for protected
/// tokens must refuse them at creation with Unsupported naming n_sinks: that outcome is checked
/// and reported, never taken as a pass of the comparison.
fn rotated_and_protected_match_cpu() {
    let test = "rotated_and_protected_match_cpu";
    let Some(gpu) = gpu_context(test) else { return };
    let cpu = Context::cpu().unwrap();
    let mut rng = Rng::fresh(test);
    use KvFormat::{Q2, Q3, Q4, Q8};
    // (K format, V format, rotation, n_heads, n_kv_heads, head_dim)
    let cases = [
        (Q8, None, KvRotation::KV, 8, 2, 64),
        (Q4, Some(Q3), KvRotation::KV, 8, 2, 64),
        (Q4, Some(Q2), KvRotation::Auto, 16, 2, 128),
        (Q4, None, KvRotation::K, 32, 8, 128),
        (Q8, Some(Q4), KvRotation::Auto, 8, 2, 128),
        (Q4, None, KvRotation::KV, 8, 1, 96), // blocks of 32
        (Q8, None, KvRotation::None, 4, 4, 64),
    ];
    let lens = [4099, 0, 1, 33, 300];
    let max_len = 4099 + 100;
    let (mut compared, mut refused) = (0, 0);
    for &(kf, vf, rotation, n_heads, n_kv_heads, head_dim) in &cases {
        for (sinks, window) in [(0, 0), (4, 128), (1, 16)] {
            let mut cfg = KvCacheConfig::new(1, n_heads, head_dim)
                .kv_heads(n_kv_heads)
                .max_seqs(lens.len())
                .max_seq_len(max_len)
                .format(kf)
                .rotation(rotation)
                .sinks(sinks)
                .window(window);
            if let Some(vf) = vf {
                cfg = cfg.v_format(vf);
            }
            let what = format!("{kf:?}/{vf:?} {rotation:?} sinks {sinks} window {window}");
            let mut g = match KvCache::new(&gpu, &cfg) {
                Ok(g) => g,
                Err(e) if sinks + window > 0 => {
                    assert_eq!(e.status(), Status::Unsupported, "{what}: {e}");
                    assert!(e.message().contains("n_sinks"), "{what}: {e}");
                    println!("{test}: {what}: refused by the CUDA backend: {e}");
                    refused += 1;
                    continue;
                }
                Err(e) => panic!("{what}: {e}"),
            };
            assert_eq!(g.config(), &cfg);
            let mut c = KvCache::new(&cpu, &cfg).unwrap();
            let row = cfg.kv_row_len();
            // One outlier channel, as real K/V have: what rotation is for.
            let outlier = rng.below(head_dim);
            let append = |rng: &mut Rng, g: &mut KvCache, c: &mut KvCache, seq, n| {
                let mut data = || {
                    let mut x = rng.normal_vec(n * row, 1.0);
                    for v in x.iter_mut().skip(outlier).step_by(head_dim) {
                        *v *= 20.0;
                    }
                    x
                };
                let (k, v) = (data(), data());
                for (kv, ctx) in [(g, &gpu), (c, &cpu)] {
                    let kb = DeviceBuffer::from_slice(ctx, &k).unwrap();
                    let vb = DeviceBuffer::from_slice(ctx, &v).unwrap();
                    kv.append_tokens(0, seq, n, &kb, &vb).unwrap();
                }
            };
            for (seq, &len) in lens.iter().enumerate() {
                let mut done = 0;
                while done < len {
                    let n = (1 + rng.below(700)).min(len - done);
                    append(&mut rng, &mut g, &mut c, seq, n);
                    done += n;
                }
            }
            for round in 0..2 {
                if round == 1 {
                    // Move the window: back by 150, forward by 70 (80 left the window).
                    g.truncate(0, 4099 - 150).unwrap();
                    c.truncate(0, 4099 - 150).unwrap();
                    append(&mut rng, &mut g, &mut c, 0, 70);
                }
                for seq in 0..lens.len() {
                    let n = g.seq_len(0, seq).unwrap();
                    assert_eq!(n, c.seq_len(0, seq).unwrap());
                    if n == 0 {
                        continue;
                    }
                    let (gk, gv) = g.read_to_host(0, seq, 0, n).unwrap();
                    let (ck, cv) = c.read_to_host(0, seq, 0, n).unwrap();
                    for (name, a, b) in [("K", &gk, &ck), ("V", &gv, &cv)] {
                        let bad = a
                            .iter()
                            .zip(b)
                            .position(|(x, y)| x.to_bits() != y.to_bits());
                        assert!(
                            bad.is_none(),
                            "{what}, round {round}, seq {seq}: GPU and CPU read different {name} \
                             at element {bad:?}"
                        );
                    }
                }
                let qrow = cfg.q_row_len();
                let ids: Vec<usize> = (0..lens.len()).collect();
                let q = rng.normal_vec(ids.len() * qrow, 1.0);
                let mut outs = Vec::new();
                for (kv, ctx) in [(&g, &gpu), (&c, &cpu)] {
                    let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
                    let mut out = DeviceBuffer::<f32>::zeros(ctx, ids.len() * qrow).unwrap();
                    kv.attention_batch(0, &ids, &qb, &mut out, None).unwrap();
                    outs.push(out.to_vec().unwrap());
                }
                // One sequence alone too (the single-sequence path).
                let qb = DeviceBuffer::from_slice(&gpu, &q[..qrow]).unwrap();
                let mut one = DeviceBuffer::<f32>::zeros(&gpu, qrow).unwrap();
                g.attention(0, 0, &qb, &mut one, None).unwrap();
                let one = one.to_vec().unwrap();
                let mut rows: Vec<(String, &[f32], &[f32])> = (0..ids.len())
                    .map(|i| {
                        let r = i * qrow..(i + 1) * qrow;
                        (format!("batched seq {i}"), &outs[0][r.clone()], &outs[1][r])
                    })
                    .collect();
                rows.push(("seq 0 alone".to_string(), &one, &outs[1][..qrow]));
                for (how, got, want) in rows {
                    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
                    let e = rel_l2(got, &want);
                    assert!(
                        e <= TOL,
                        "{what}, round {round}, {how}: relative L2 {e:e} > {TOL:e}"
                    );
                }
            }
            compared += 1;
            println!("{test}: {what}: GPU matches the CPU backend");
        }
    }
    println!("{test}: {compared} configurations compared, {refused} refused (protected tokens)");
    gpu.synchronize().unwrap();
}

/// The device facts against the build's list and what the driver loads from it: the newest
/// SASS of the GPU's major version not newer than the GPU, else the newest PTX not newer than
/// it, JIT-compiled.
fn device_code() {
    let Some(ctx) = gpu_context("device_code") else {
        return;
    };
    let b = build_info().unwrap();
    let info = ctx.device_info().unwrap();
    println!("device_code: build {b}");
    assert!(b.cuda);
    let archs = parse_archs(b.cuda_architectures).expect("architecture list");
    let (major, minor) = info.compute_capability.unwrap();
    let cc = 10 * major + minor;
    let newest = |sass: bool| {
        archs
            .iter()
            .filter(|&&(n, real)| real == sass && n <= cc && (!sass || n / 10 == major))
            .map(|a| a.0)
            .max()
    };
    let (sass, ptx) = (newest(true), newest(false));
    let expected = sass.or(ptx).expect("the build has code for this GPU");
    assert_eq!(info.native_code, sass.is_some());
    assert_eq!(info.kernel_arch, Some((expected / 10, expected % 10)));
    assert_eq!(info.tensor_cores, b.tensor_cores && expected >= 80);
    assert!(info
        .to_string()
        .contains(if info.native_code { "SASS" } else { "JIT" }));
}

fn errors_and_device_info() {
    let Some(ctx) = gpu_context("errors_and_device_info") else {
        return;
    };
    let info = ctx.device_info().unwrap();
    assert_eq!(info.backend, Backend::Cuda);
    assert_eq!(info.device, Some(0));
    assert!(info.compute_capability.unwrap().0 >= 5);
    assert!(info.total_memory > 0 && info.multiprocessors > 0);
    assert!(!ctx.cuda_stream().is_null());
    // The CUDA backend needs head_dim % 8 == 0.
    let e = KvCache::new(&ctx, &KvCacheConfig::new(1, 2, 12)).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    // V in Q3 or Q2 with K other than Q4: no kernels for the pair, said at creation.
    for (k, v, want) in [
        (KvFormat::Q8, KvFormat::Q3, "K format Q8 with V format Q3"),
        (KvFormat::F16, KvFormat::Q2, "K format F16 with V format Q2"),
    ] {
        let cfg = KvCacheConfig::new(1, 4, 64).format(k).v_format(v);
        let e = KvCache::new(&ctx, &cfg).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(e.message().contains(want), "{e}");
    }
    // Wrong sizes are caught before any kernel runs; the context stays usable.
    let cfg = KvCacheConfig::new(1, 4, 64).max_seq_len(4);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let small = DeviceBuffer::<f32>::zeros(&ctx, 10).unwrap();
    assert_eq!(
        kv.append(0, 0, &small, &small).unwrap_err().status(),
        Status::InvalidArgument
    );
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, cfg.q_row_len()).unwrap();
    assert_eq!(
        kv.attention(0, 0, &small, &mut out, None)
            .unwrap_err()
            .status(),
        Status::InvalidArgument
    );
    let k = DeviceBuffer::<f32>::zeros(&ctx, 5 * cfg.kv_row_len()).unwrap();
    assert_eq!(
        kv.append(0, 0, &k, &k).unwrap_err().status(),
        Status::Capacity
    );
    ctx.synchronize().unwrap();
}

fn contexts_on_several_threads() {
    // Distinct contexts are independent; a context may move to another thread.
    if gpu_context("contexts_on_several_threads").is_none() {
        return;
    }
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let ctx = Context::cuda(0).unwrap();
            std::thread::spawn(move || {
                let mut rng = Rng::fresh(&format!("contexts_on_several_threads[{t}]"));
                let s = Shape {
                    n_heads: 8,
                    n_kv_heads: 2,
                    head_dim: 64,
                };
                check_attention_case(&ctx, &mut rng, s, &[300, 7], t % 2 == 1, None)
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert!(e <= common::TOL);
    }
}

fn shared_context_across_threads() {
    // One CUDA context shared by 4 threads through clones: each makes its own caches and
    // buffers and calls concurrently (the context's lock serializes the calls); then one cache
    // shared read-only by 4 threads running attention at once.
    let Some(ctx) = gpu_context("shared_context_across_threads") else {
        return;
    };
    let s = Shape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::fresh(&format!("shared_context_across_threads[{t}]"));
                check_attention_case(&ctx, &mut rng, s, &[513, 1, 64], t % 2 == 1, None)
            })
        })
        .collect();
    for w in workers {
        let e = w.join().unwrap();
        println!("shared_context_across_threads: worst rel L2 {e:e}");
        assert!(e <= TOL);
    }

    let cfg = KvCacheConfig::new(1, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seqs(2)
        .max_seq_len(1000);
    let mut rng = Rng::fresh("shared_context_across_threads[cache]");
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let mut kv_host = Vec::new();
    for (seq, len) in [(0, 1000), (1, 77)] {
        let k = rng.normal_vec(len * cfg.kv_row_len(), 1.0);
        let v = rng.normal_vec(len * cfg.kv_row_len(), 1.0);
        let kb = DeviceBuffer::from_slice(&ctx, &k).unwrap();
        let vb = DeviceBuffer::from_slice(&ctx, &v).unwrap();
        kv.append_tokens(0, seq, len, &kb, &vb).unwrap();
        kv_host.push((to_f16(&k), to_f16(&v)));
    }
    let kv = Arc::new(kv);
    let kv_host = Arc::new(kv_host);
    let readers: Vec<_> = (0..4)
        .map(|t| {
            let (kv, kv_host) = (kv.clone(), kv_host.clone());
            let q = rng.normal_vec(cfg.q_row_len(), 1.0);
            std::thread::spawn(move || {
                let seq = t % 2;
                let ctx = kv.context();
                let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
                let mut out = DeviceBuffer::<f32>::zeros(ctx, q.len()).unwrap();
                for _ in 0..20 {
                    kv.attention(0, seq, &qb, &mut out, None).unwrap();
                }
                let (k, v) = &kv_host[seq];
                let want = reference_attention(s, k, v, &q, default_scale(s.head_dim));
                rel_l2(&out.to_vec().unwrap(), &want)
            })
        })
        .collect();
    for r in readers {
        let e = r.join().unwrap();
        assert!(e <= TOL, "shared cache: rel L2 {e:e}");
    }
    ctx.synchronize().unwrap();
}

fn cache_moves_between_threads() {
    // A model struct (context, cache, buffers) built here, decoded on a worker thread, and
    // checked here again, against the float64 reference.
    struct Model {
        ctx: Context,
        kv: KvCache,
        q: DeviceBuffer<f32>,
        out: DeviceBuffer<f32>,
    }
    if gpu_context("cache_moves_between_threads").is_none() {
        return;
    }
    let ctx = Context::cuda(0).unwrap();
    let mut rng = Rng::fresh("cache_moves_between_threads");
    let s = Shape {
        n_heads: 16,
        n_kv_heads: 4,
        head_dim: 64,
    };
    let cfg = KvCacheConfig::new(1, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seq_len(400);
    let row = cfg.kv_row_len();
    let mut m = Model {
        kv: KvCache::new(&ctx, &cfg).unwrap(),
        q: DeviceBuffer::zeros(&ctx, cfg.q_row_len()).unwrap(),
        out: DeviceBuffer::zeros(&ctx, cfg.q_row_len()).unwrap(),
        ctx,
    };
    let (k, v) = (
        rng.normal_vec(300 * row, 1.0),
        rng.normal_vec(300 * row, 1.0),
    );
    let kb = DeviceBuffer::from_slice(&m.ctx, &k[..250 * row]).unwrap();
    let vb = DeviceBuffer::from_slice(&m.ctx, &v[..250 * row]).unwrap();
    m.kv.append_tokens(0, 0, 250, &kb, &vb).unwrap();
    let q = rng.normal_vec(cfg.q_row_len(), 1.0);
    let (k2, v2, q2) = (k.clone(), v.clone(), q.clone());
    let (m, got) = std::thread::spawn(move || {
        let mut m = m;
        for t in 250..300 {
            let kt = DeviceBuffer::from_slice(&m.ctx, &k2[t * row..(t + 1) * row]).unwrap();
            let vt = DeviceBuffer::from_slice(&m.ctx, &v2[t * row..(t + 1) * row]).unwrap();
            m.kv.append_token(0, 0, &kt, &vt).unwrap();
        }
        m.q.copy_from_host(&q2).unwrap();
        m.kv.attention(0, 0, &m.q, &mut m.out, None).unwrap();
        let got = m.out.to_vec().unwrap();
        (m, got)
    })
    .join()
    .unwrap();
    drop((kb, vb));
    let want = reference_attention(s, &to_f16(&k), &to_f16(&v), &q, default_scale(s.head_dim));
    let e = rel_l2(&got, &want);
    println!("cache_moves_between_threads: rel L2 {e:e}");
    assert!(e <= TOL);
    assert_eq!(m.kv.read_to_host(0, 0, 0, 300).unwrap().1, to_f16(&v));
    m.ctx.synchronize().unwrap();
}

/// Batched appends against single ones and the CPU backend, every format the CUDA backend has,
/// rotated and protected caches, GQA and MQA.
fn append_batch_matches_single_appends() {
    let test = "append_batch_matches_single_appends";
    let Some(ctx) = gpu_context(test) else { return };
    let mut rng = Rng::fresh(test);
    let base = KvCacheConfig::new(2, 32, 128)
        .kv_heads(8)
        .max_seqs(6)
        .max_seq_len(400);
    for cfg in [
        base,
        base.format(KvFormat::Q8).sinks(4).window(16),
        base.format(KvFormat::Q8).v_format(KvFormat::Q4),
        base.format(KvFormat::Q4)
            .kv_heads(1)
            .rotation(KvRotation::None)
            .sinks(0)
            .window(5),
    ] {
        common::check_append_batch(&ctx, &mut rng, &cfg);
    }
    ctx.synchronize().unwrap();
}

/// Append-and-attend against the two calls on the GPU (bit for bit) and against the CPU backend.
fn append_attention_batch_matches_the_two_calls() {
    let test = "append_attention_batch_matches_the_two_calls";
    let Some(ctx) = gpu_context(test) else { return };
    let cpu = Context::cpu().unwrap();
    let mut rng = Rng::fresh(test);
    let base = KvCacheConfig::new(1, 32, 128)
        .kv_heads(8)
        .max_seqs(8)
        .max_seq_len(600);
    for cfg in [base, base.format(KvFormat::Q8).window(16)] {
        let mut a = KvCache::new(&ctx, &cfg).unwrap();
        let mut b = KvCache::new(&ctx, &cfg).unwrap();
        let mut c = KvCache::new(&cpu, &cfg).unwrap();
        let (row, qrow) = (cfg.kv_row_len(), cfg.q_row_len());
        let all: Vec<usize> = (0..8).collect();
        let prompt = [0, 1, 31, 33, 257, 5, 100, 2];
        let k = rng.normal_vec(prompt.iter().sum::<usize>() * row, 1.0);
        for kv in [&mut a, &mut b] {
            let dk = DeviceBuffer::from_slice(&ctx, &k).unwrap();
            kv.append_batch(0, &all, &prompt, &dk, &dk).unwrap();
        }
        let ck = DeviceBuffer::from_slice(&cpu, &k).unwrap();
        c.append_batch(0, &all, &prompt, &ck, &ck).unwrap();
        for step in 0..6 {
            let ids: Vec<usize> = all
                .iter()
                .copied()
                .filter(|s| (s + step) % 3 != 0)
                .collect();
            let n = ids.len();
            let (k, v, q) = (
                rng.normal_vec(n * row, 1.0),
                rng.normal_vec(n * row, 1.0),
                rng.normal_vec(n * qrow, 1.0),
            );
            let up = |ctx: &Context, x: &[f32]| DeviceBuffer::from_slice(ctx, x).unwrap();
            let (dk, dv, dq) = (up(&ctx, &k), up(&ctx, &v), up(&ctx, &q));
            let mut oa = DeviceBuffer::<f32>::zeros(&ctx, n * qrow).unwrap();
            let mut ob = DeviceBuffer::<f32>::zeros(&ctx, n * qrow).unwrap();
            let mut oc = DeviceBuffer::<f32>::zeros(&cpu, n * qrow).unwrap();
            a.append_attention_batch(0, &ids, &dk, &dv, &dq, &mut oa, None)
                .unwrap();
            b.append_token_batch(0, &ids, &dk, &dv).unwrap();
            b.attention_batch(0, &ids, &dq, &mut ob, None).unwrap();
            let (ck, cv, cq) = (up(&cpu, &k), up(&cpu, &v), up(&cpu, &q));
            c.append_attention_batch(0, &ids, &ck, &cv, &cq, &mut oc, None)
                .unwrap();
            let got = oa.to_vec().unwrap();
            assert!(
                got == ob.to_vec().unwrap(),
                "step {step}: differs from the two calls"
            );
            let want: Vec<f64> = oc.to_vec().unwrap().iter().map(|&x| x as f64).collect();
            let e = rel_l2(&got, &want);
            assert!(
                e <= TOL,
                "step {step}: rel L2 {e:e} against the CPU backend"
            );
        }
    }
    ctx.synchronize().unwrap();
}

/// A decode step (append + attention in two layers, then a copy) captured as a graph and
/// re-captured every step, against the same calls made eagerly on a twin cache (bit for bit)
/// and the CPU backend; a failing call inside a capture discards it.
fn graph_steps_match_eager_calls() {
    let test = "graph_steps_match_eager_calls";
    let Some(ctx) = gpu_context(test) else { return };
    let cpu = Context::cpu().unwrap();
    let mut rng = Rng::fresh(test);
    let cfg = KvCacheConfig::new(2, 12, 64)
        .kv_heads(4)
        .max_seqs(3)
        .max_seq_len(400)
        .format(KvFormat::Q8)
        .window(16);
    let (row, qrow) = (cfg.kv_row_len(), cfg.q_row_len());
    let ids = [0usize, 1, 2];
    let prompt = [1, 33, 257];
    let k = rng.normal_vec(prompt.iter().sum::<usize>() * row, 1.0);
    let mut caches = Vec::new();
    for c in [&ctx, &ctx, &cpu] {
        let mut kv = KvCache::new(c, &cfg).unwrap();
        let dk = DeviceBuffer::from_slice(c, &k).unwrap();
        for layer in 0..2 {
            kv.append_batch(layer, &ids, &prompt, &dk, &dk).unwrap();
        }
        caches.push(kv);
    }
    let (mut g, mut e, mut c) = (caches.remove(0), caches.remove(0), caches.remove(0));
    let up = |ctx: &Context, x: &[f32]| DeviceBuffer::from_slice(ctx, x).unwrap();
    let mut graph: Option<Graph> = None;
    let mut updates = 0;
    for step in 0..6 {
        let (k, v, q) = (
            rng.normal_vec(3 * row, 1.0),
            rng.normal_vec(3 * row, 1.0),
            rng.normal_vec(3 * qrow, 1.0),
        );
        let (dk, dv) = (up(&ctx, &k), up(&ctx, &v));
        let (mut qg, mut qe, mut qc) = (up(&ctx, &q), up(&ctx, &q), up(&cpu, &q));
        let (ck, cv) = (up(&cpu, &k), up(&cpu, &v));
        let mut og = DeviceBuffer::<f32>::zeros(&ctx, 3 * qrow).unwrap();
        let mut oe = DeviceBuffer::<f32>::zeros(&ctx, 3 * qrow).unwrap();
        let mut oc = DeviceBuffer::<f32>::zeros(&cpu, 3 * qrow).unwrap();
        let layers = |kv: &mut KvCache,
                      k: &DeviceBuffer<f32>,
                      v: &DeviceBuffer<f32>,
                      q: &mut DeviceBuffer<f32>,
                      out: &mut DeviceBuffer<f32>| {
            for layer in 0..2 {
                kv.append_attention_batch(layer, &ids, k, v, &*q, out, None)?;
                q.copy_from_device(&*out)?;
            }
            Ok(())
        };
        if step == 0 {
            layers(&mut g, &dk, &dv, &mut qg, &mut og).unwrap(); // the warm-up, eager
        } else {
            let capture = || layers(&mut g, &dk, &dv, &mut qg, &mut og);
            match graph.as_mut() {
                None => graph = Some(Graph::capture(&ctx, capture).unwrap()),
                Some(gr) => updates += gr.recapture(capture).unwrap() as usize,
            }
            graph.as_ref().unwrap().launch().unwrap();
        }
        layers(&mut e, &dk, &dv, &mut qe, &mut oe).unwrap();
        layers(&mut c, &ck, &cv, &mut qc, &mut oc).unwrap();
        let got = og.to_vec().unwrap();
        assert!(
            got == oe.to_vec().unwrap(),
            "step {step}: the graph's output differs"
        );
        let want: Vec<f64> = oc.to_vec().unwrap().iter().map(|&x| x as f64).collect();
        let err = rel_l2(&got, &want);
        assert!(
            err <= TOL,
            "step {step}: rel L2 {err:e} against the CPU backend"
        );
    }
    assert!(updates >= 1, "no re-capture was an update in place");
    for layer in 0..2 {
        assert_eq!(g.seq_len(layer, 2).unwrap(), e.seq_len(layer, 2).unwrap());
    }
    // A call that fails inside a capture: its error comes back and the capture is discarded
    // (the stream is not left capturing: eager calls work after it).
    let bad = DeviceBuffer::<f32>::zeros(&ctx, 1).unwrap();
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, 3 * qrow).unwrap();
    let q = DeviceBuffer::<f32>::zeros(&ctx, 3 * qrow).unwrap();
    let err = graph
        .as_mut()
        .unwrap()
        .recapture(|| g.attention_batch(0, &ids, &bad, &mut out, None))
        .unwrap_err();
    assert_eq!(err.status(), Status::InvalidArgument, "{err}");
    g.attention_batch(0, &ids, &q, &mut out, None).unwrap();
    drop(graph);
    ctx.synchronize().unwrap();
    let cpu_err = Graph::capture(&cpu, || Ok(())).unwrap_err();
    assert_eq!(cpu_err.status(), Status::Unsupported, "{cpu_err}");
}

/// FP16 and BF16 q/out/K/V against the f32 calls rounded (bit for bit) and the CPU backend,
/// on the FP32 and tensor-core paths (MHA, GQA 4 and 8, head_dim 64, 128, 256, quantized).
fn half_and_bf16_q_out() {
    let Some(ctx) = gpu_context("half_and_bf16_q_out") else {
        return;
    };
    let mut rng = Rng::fresh("half_and_bf16_q_out");
    let base = |h, kvh, d| {
        KvCacheConfig::new(1, h, d)
            .kv_heads(kvh)
            .max_seqs(4)
            .max_seq_len(300)
    };
    for cfg in [
        base(8, 8, 64),
        base(32, 8, 128),
        base(16, 2, 256),
        base(12, 4, 96)
            .format(KvFormat::Q8)
            .v_format(KvFormat::Q4)
            .window(16),
        base(8, 1, 128).format(KvFormat::Q4).window(16),
    ] {
        common::check_half_io::<f16>(&ctx, &mut rng, &cfg);
        common::check_half_io::<m40llm::bf16>(&ctx, &mut rng, &cfg);
    }
    ctx.synchronize().unwrap();
}

fn append_row_length_checks() {
    // The GQA mix-up (a query-shaped K row) is an error before any kernel runs.
    let Some(ctx) = gpu_context("append_row_length_checks") else {
        return;
    };
    let cfg = KvCacheConfig::new(1, 32, 128).kv_heads(8).max_seq_len(8);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let wrong = DeviceBuffer::<f32>::zeros(&ctx, cfg.q_row_len()).unwrap();
    let e = kv.append_token(0, 0, &wrong, &wrong).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("n_kv_heads × head_dim"), "{e}");
    let right = DeviceBuffer::<f32>::zeros(&ctx, cfg.kv_row_len()).unwrap();
    kv.append_token(0, 0, &right, &right).unwrap();
    assert_eq!(kv.seq_len(0, 0).unwrap(), 1);
    ctx.synchronize().unwrap();
}

#[cfg(feature = "cudarc")]
fn cudarc_interop() {
    // m40llm on a cudarc stream, K/V/q/out in cudarc memory (one of them allocated on another
    // cudarc stream), against the float64 reference.
    use cudarc::driver::CudaContext;
    use m40llm::CudarcView;

    if gpu_context("cudarc_interop").is_none() {
        return;
    }
    let cuda = CudaContext::new(0).unwrap();
    let stream = cuda.new_stream().unwrap();
    let other_stream = cuda.new_stream().unwrap();
    let ctx = Context::from_cudarc_stream(&stream).unwrap();
    assert_eq!(ctx.backend(), Backend::Cuda);
    assert_eq!(ctx.device(), Some(0));
    assert_eq!(ctx.cuda_stream(), stream.cu_stream().cast());
    assert!(Arc::ptr_eq(ctx.cudarc_stream().unwrap(), &stream));

    let mut rng = Rng::fresh("cudarc_interop");
    let s = Shape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    let cfg = KvCacheConfig::new(2, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seqs(2)
        .max_seq_len(600);
    let (row, qrow) = (cfg.kv_row_len(), cfg.q_row_len());
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let lens = [513usize, 33];
    let mut host = Vec::new();
    for (seq, &len) in lens.iter().enumerate() {
        let k = rng.normal_vec(len * row, 1.0);
        let v = rng.normal_vec(len * row, 1.0);
        // Seq 1's K comes from another stream: the view makes the context's stream wait.
        let kd = if seq == 1 {
            other_stream.clone_htod(&k).unwrap()
        } else {
            stream.clone_htod(&k).unwrap()
        };
        let vd = stream.clone_htod(&v).unwrap();
        // All but the last 3 tokens at once (whole slices), then token by token (CudaViews).
        let bulk = len - 3;
        let (kb, vb) = (kd.slice(..bulk * row), vd.slice(..bulk * row));
        kv.append_tokens(
            1,
            seq,
            bulk,
            &ctx.cudarc_view(&kb).unwrap(),
            &ctx.cudarc_view(&vb).unwrap(),
        )
        .unwrap();
        for t in bulk..len {
            let kt = kd.slice(t * row..(t + 1) * row);
            let vt = vd.slice(t * row..(t + 1) * row);
            kv.append_token(
                1,
                seq,
                &CudarcView::new(&ctx, &kt).unwrap(),
                &CudarcView::new(&ctx, &vt).unwrap(),
            )
            .unwrap();
        }
        host.push((to_f16(&k), to_f16(&v)));
    }
    // Batched attention: q and out are cudarc slices.
    let ids = [1usize, 0, 1];
    let q = rng.normal_vec(ids.len() * qrow, 1.0);
    let qd = stream.clone_htod(&q).unwrap();
    let mut outd = stream.alloc_zeros::<f32>(ids.len() * qrow).unwrap();
    kv.attention_batch(
        1,
        &ids,
        &ctx.cudarc_view(&qd).unwrap(),
        &mut ctx.cudarc_view_mut(&mut outd).unwrap(),
        None,
    )
    .unwrap();
    let got: Vec<f32> = stream.clone_dtoh(&outd).unwrap();
    for (i, &seq) in ids.iter().enumerate() {
        let (k, v) = &host[seq];
        let want = reference_attention(
            s,
            k,
            v,
            &q[i * qrow..(i + 1) * qrow],
            default_scale(s.head_dim),
        );
        let e = rel_l2(&got[i * qrow..(i + 1) * qrow], &want);
        println!("cudarc_interop: row {i} (seq {seq}): rel L2 {e:e}");
        assert!(e <= TOL);
    }
    // Single-sequence attention into part of a cudarc slice (a CudaViewMut).
    let mut out1 = stream.alloc_zeros::<f32>(2 * qrow).unwrap();
    {
        let mut part = out1.slice_mut(qrow..);
        let qv = qd.slice(..qrow);
        kv.attention(
            1,
            1,
            &ctx.cudarc_view(&qv).unwrap(),
            &mut ctx.cudarc_view_mut(&mut part).unwrap(),
            Some(0.05),
        )
        .unwrap();
    }
    let got1: Vec<f32> = stream.clone_dtoh(&out1).unwrap();
    assert!(got1[..qrow].iter().all(|&x| x == 0.0));
    let want1 = reference_attention(s, &host[1].0, &host[1].1, &q[..qrow], 0.05);
    assert!(rel_l2(&got1[qrow..], &want1) <= TOL);
    // Read-back into cudarc memory (u16 bit patterns).
    let mut kbits = stream.alloc_zeros::<u16>(lens[1] * row).unwrap();
    kv.read_k_f16(1, 1, 0, &mut ctx.cudarc_view_mut(&mut kbits).unwrap())
        .unwrap();
    let kbits: Vec<u16> = stream.clone_dtoh(&kbits).unwrap();
    assert!(kbits.iter().zip(&host[1].0).all(|(&a, b)| a == b.to_bits()));

    // Lengths are checked as for any buffer.
    let short = stream.alloc_zeros::<f32>(qrow - 1).unwrap();
    let e = kv
        .attention(
            1,
            0,
            &ctx.cudarc_view(&short).unwrap(),
            &mut ctx.cudarc_view_mut(&mut outd).unwrap(),
            None,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = kv
        .append_token(
            1,
            0,
            &ctx.cudarc_view(&qd.slice(..qrow)).unwrap(),
            &ctx.cudarc_view(&qd.slice(..qrow)).unwrap(),
        )
        .unwrap_err();
    assert!(e.message().contains("n_kv_heads × head_dim"), "{e}");
    // Contexts that cannot use cudarc memory.
    let plain = Context::cuda(0).unwrap();
    let e = CudarcView::new(&plain, &qd).unwrap_err();
    assert!(e.message().contains("from_cudarc_stream"), "{e}");
    let cpu = Context::cpu().unwrap();
    assert_eq!(
        CudarcView::new(&cpu, &qd).unwrap_err().status(),
        Status::InvalidArgument
    );
    // A view of another m40llm context's memory is refused by the cache.
    let ctx2 = Context::from_cudarc_stream(&other_stream).unwrap();
    let e = kv
        .attention(
            1,
            0,
            &ctx2.cudarc_view(&qd.slice(..qrow)).unwrap(),
            &mut ctx.cudarc_view_mut(&mut out1.slice_mut(..qrow)).unwrap(),
            None,
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    // The per-thread stream is refused; the default (legacy) stream works.
    assert_eq!(
        Context::from_cudarc_stream(&cuda.per_thread_stream())
            .unwrap_err()
            .status(),
        Status::Unsupported
    );
    let dflt = cuda.default_stream();
    let dctx = Context::from_cudarc_stream(&dflt).unwrap();
    assert!(
        !dctx.cuda_stream().is_null(),
        "own stream for the legacy one"
    );
    let mut dkv = KvCache::new(&dctx, &cfg).unwrap();
    let (k, v) = (rng.normal_vec(2 * row, 1.0), rng.normal_vec(2 * row, 1.0));
    let kd = dflt.clone_htod(&k).unwrap();
    let vd = dflt.clone_htod(&v).unwrap();
    dkv.append_tokens(
        0,
        0,
        2,
        &dctx.cudarc_view(&kd).unwrap(),
        &dctx.cudarc_view(&vd).unwrap(),
    )
    .unwrap();
    let mut dout = dflt.alloc_zeros::<f32>(qrow).unwrap();
    // q lives on `stream`, in the same CUDA context: allowed, ordered by cudarc's events.
    dkv.attention(
        0,
        0,
        &dctx.cudarc_view(&qd.slice(..qrow)).unwrap(),
        &mut dctx.cudarc_view_mut(&mut dout).unwrap(),
        None,
    )
    .unwrap();
    let got: Vec<f32> = dflt.clone_dtoh(&dout).unwrap();
    let want = reference_attention(
        s,
        &to_f16(&k),
        &to_f16(&v),
        &q[..qrow],
        default_scale(s.head_dim),
    );
    assert!(rel_l2(&got, &want) <= TOL);
    dctx.synchronize().unwrap();
    ctx.synchronize().unwrap();
}

fn causal_attention() {
    let Some(ctx) = gpu_context("causal_attention") else {
        return;
    };
    let mut rng = Rng::fresh("causal_attention");
    for (n_heads, n_kv_heads, head_dim) in [(8, 8, 64), (32, 8, 128), (16, 2, 256)] {
        let s = Shape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        // A prompt, speculative rows on long prefixes (split along positions), ragged.
        let e = check_causal_case(
            &ctx,
            &mut rng,
            s,
            &[0, 3000, 5, 200],
            &[300, 4, 1, 33],
            None,
        );
        println!("causal {n_heads}/{n_kv_heads} d {head_dim}: worst rel L2 {e:e}");
        check_causal_case(&ctx, &mut rng, s, &[0, 100], &[70, 16], Some(24));
    }
}

/// The attention weights (`attention_weights`) on the GPU against the CPU backend's over the
/// same appends: F16 and Q4 K / Q2 V with protected tokens (a wrapped window), GQA 4, ragged
/// lengths; every head's weights sum to 1 and the padding of each row is left as it was.
fn attention_weights_match_cpu() {
    let test = "attention_weights_match_cpu";
    let Some(gpu) = gpu_context(test) else { return };
    let cpu = Context::cpu().unwrap();
    let mut rng = Rng::fresh(test);
    let lens = [1usize, 33, 90, 2049];
    let stride = 2049 + 5;
    for (kf, vf) in [(KvFormat::F16, KvFormat::F16), (KvFormat::Q4, KvFormat::Q2)] {
        let cfg = KvCacheConfig::new(1, 8, 128)
            .kv_heads(2)
            .max_seqs(lens.len())
            .max_seq_len(stride)
            .format(kf)
            .v_format(vf)
            .sinks(4)
            .window(16);
        let (mut g, mut c) = (
            KvCache::new(&gpu, &cfg).unwrap(),
            KvCache::new(&cpu, &cfg).unwrap(),
        );
        let row = cfg.kv_row_len();
        for (seq, &len) in lens.iter().enumerate() {
            let (k, v) = (
                rng.normal_vec(len * row, 1.0),
                rng.normal_vec(len * row, 1.0),
            );
            for (kv, ctx) in [(&mut g, &gpu), (&mut c, &cpu)] {
                let kb = DeviceBuffer::from_slice(ctx, &k).unwrap();
                let vb = DeviceBuffer::from_slice(ctx, &v).unwrap();
                kv.append_tokens(0, seq, len, &kb, &vb).unwrap();
            }
        }
        let ids = [3usize, 0, 2, 1, 3];
        let q = rng.normal_vec(ids.len() * cfg.q_row_len(), 1.0);
        let n_w = ids.len() * cfg.n_heads * stride;
        let mut got = Vec::new();
        for (kv, ctx) in [(&g, &gpu), (&c, &cpu)] {
            let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
            let mut out = DeviceBuffer::<f32>::zeros(ctx, q.len()).unwrap();
            let mut w = DeviceBuffer::from_slice(ctx, &vec![-7.0f32; n_w]).unwrap();
            kv.attention_weights(0, &ids, &qb, &mut out, &mut w, stride, None)
                .unwrap();
            got.push((out.to_vec().unwrap(), w.to_vec().unwrap()));
        }
        let what = format!("{kf:?}/{vf:?}");
        let e = rel_l2(
            &got[0].0,
            &got[1].0.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        );
        assert!(
            e <= TOL,
            "{what}: output rel L2 {e:e} against the CPU backend"
        );
        for (i, &seq) in ids.iter().enumerate() {
            for h in 0..cfg.n_heads {
                let r = (i * cfg.n_heads + h) * stride;
                let (gw, cw) = (&got[0].1[r..r + stride], &got[1].1[r..r + stride]);
                for p in 0..lens[seq] {
                    assert!(
                        (gw[p] - cw[p]).abs() as f64 <= 1e-7 + 1e-4 * cw[p].abs() as f64,
                        "{what}: row {i} head {h} position {p}: {} against {}",
                        gw[p],
                        cw[p]
                    );
                }
                let sum: f64 = gw[..lens[seq]].iter().map(|&x| x as f64).sum();
                assert!(
                    (sum - 1.0).abs() <= 1e-5,
                    "{what}: row {i} head {h}: sum {sum}"
                );
                assert!(
                    gw[lens[seq]..].iter().all(|&x| x == -7.0),
                    "{what}: padding written"
                );
            }
        }
        // The importance, twice with decay 0.5 from the same random start: the GPU's against
        // the CPU backend's.
        let n_i = ids.len() * cfg.n_kv_heads * stride;
        let start: Vec<f32> = (0..n_i).map(|i| (i % 97) as f32 / 97.0).collect();
        let mut imps = Vec::new();
        for (kv, ctx) in [(&g, &gpu), (&c, &cpu)] {
            let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
            let mut out = DeviceBuffer::<f32>::zeros(ctx, q.len()).unwrap();
            let mut imp = DeviceBuffer::from_slice(ctx, &start).unwrap();
            for _ in 0..2 {
                kv.attention_importance(0, &ids, &qb, &mut out, &mut imp, stride, 0.5, None)
                    .unwrap();
            }
            imps.push(imp.to_vec().unwrap());
        }
        for (at, (&gi, &ci)) in imps[0].iter().zip(&imps[1]).enumerate() {
            let (p, row) = (at % stride, at / stride / cfg.n_kv_heads);
            if p >= lens[ids[row]] {
                assert_eq!(
                    gi, start[at],
                    "{what}: importance {at} past its length written"
                );
            } else {
                assert!(
                    (gi - ci).abs() as f64 <= 1e-7 + 1e-4 * ci.abs() as f64,
                    "{what}: importance {at}: {gi} against {ci}"
                );
            }
        }
        println!("{test}: {what}: output rel L2 {e:e}, weights and importance within 1e-4");
    }
}

fn main() {
    let tests: &[(&str, fn())] = &[
        ("causal_attention", causal_attention),
        ("mha_head_dim_64", mha_head_dim_64),
        ("mha_head_dim_128", mha_head_dim_128),
        ("gqa4_head_dim_64", gqa4_head_dim_64),
        ("gqa4_head_dim_128", gqa4_head_dim_128),
        ("batched_ragged", batched_ragged),
        ("batch_larger_than_one_launch", batch_larger_than_one_launch),
        (
            "gpu_matches_cpu_backend_bitwise_storage",
            gpu_matches_cpu_backend_bitwise_storage,
        ),
        (
            "rotated_and_protected_match_cpu",
            rotated_and_protected_match_cpu,
        ),
        ("device_code", device_code),
        ("errors_and_device_info", errors_and_device_info),
        ("contexts_on_several_threads", contexts_on_several_threads),
        (
            "shared_context_across_threads",
            shared_context_across_threads,
        ),
        ("cache_moves_between_threads", cache_moves_between_threads),
        ("append_row_length_checks", append_row_length_checks),
        ("half_and_bf16_q_out", half_and_bf16_q_out),
        ("attention_weights_match_cpu", attention_weights_match_cpu),
        (
            "append_batch_matches_single_appends",
            append_batch_matches_single_appends,
        ),
        (
            "append_attention_batch_matches_the_two_calls",
            append_attention_batch_matches_the_two_calls,
        ),
        (
            "graph_steps_match_eager_calls",
            graph_steps_match_eager_calls,
        ),
        #[cfg(feature = "cudarc")]
        ("cudarc_interop", cudarc_interop),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<_> = tests
        .iter()
        .filter(|(name, _)| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str())))
        .collect();
    if !common::gpu_present() {
        // gpu_context panics here under M40LLM_REQUIRE_GPU=1, which fails the run.
        let _ = gpu_context("gpu tests");
        for (name, _) in &selected {
            println!("test {name} ... skipped");
        }
        println!("0 passed, 0 failed, {} skipped", selected.len());
        return;
    }
    let mut failed = 0;
    for (name, test) in &selected {
        match std::panic::catch_unwind(test) {
            Ok(()) => println!("test {name} ... ok"),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    println!("{} passed, {} failed", selected.len() - failed, failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
