//! Quantized K/V formats through the safe API on the CPU backend: sizes, and attention over
//! what the cache stores (read back as FP16) against the float64 reference; rotation and
//! protected tokens (sinks, window) against a quantizer and rotation written here from the
//! header's words: the stored values bit-exact, attention within 1e-5.

mod common;

use std::ops::{Add, Mul, Sub};

use common::{
    default_scale, reference_attention, reference_attention_f64, rel_l2, Rng, Shape, TOL,
};
use m40llm::{
    f16, sys, Context, DeviceBuffer, KvCache, KvCacheConfig, KvFormat, KvRotation, Status,
};

/// The formats alone, whatever the library's defaults: no protected tokens (the byte counts
/// below) and no rotation (the per-value error bound below is the unrotated quantizer's; a
/// rotated row's error is spread over its block). Rotation and protected tokens are checked
/// against the header's rules further down.
fn config(format: KvFormat, v_format: Option<KvFormat>) -> KvCacheConfig {
    let mut c = KvCacheConfig::new(1, 8, 64)
        .kv_heads(2)
        .max_seqs(1)
        .max_seq_len(300)
        .rotation(KvRotation::None)
        .sinks(0)
        .window(0);
    c = c.format(format);
    if let Some(v) = v_format {
        c = c.v_format(v);
    }
    c
}

#[test]
fn bytes_per_value() {
    let values = 300 * 2 * 64; // per tensor
    let bytes = |f, v| config(f, v).bytes_needed().unwrap();
    assert_eq!(bytes(KvFormat::F16, None), 2 * values * 2);
    assert_eq!(bytes(KvFormat::Q8, None), 2 * (values + values / 16));
    assert_eq!(bytes(KvFormat::Q4, None), 2 * (values / 2 + values / 8));
    assert_eq!(
        bytes(KvFormat::Q8, Some(KvFormat::Q4)),
        values + values / 16 + values / 2 + values / 8
    );
    // V in Q3 (4 bits a value) and Q2 (3 bits)
    assert_eq!(
        bytes(KvFormat::Q4, Some(KvFormat::Q3)),
        values * 5 / 8 + values * 4 / 8
    );
    assert_eq!(
        bytes(KvFormat::Q4, Some(KvFormat::Q2)),
        values * 5 / 8 + values * 3 / 8
    );
    // K in Q3 or Q2 is refused, whatever V is, before anything is made
    let ctx = Context::cpu().unwrap();
    for k in [KvFormat::Q3, KvFormat::Q2] {
        for v in [None, Some(KvFormat::Q4), Some(k)] {
            let cfg = config(k, v);
            for e in [
                cfg.bytes_needed().unwrap_err(),
                KvCache::new(&ctx, &cfg).unwrap_err(),
            ] {
                assert_eq!(e.status(), Status::InvalidArgument, "{k:?}/{v:?}: {e}");
                assert!(e.message().contains("V format only"), "{e}");
            }
        }
    }
    let e = KvCacheConfig::new(1, 4, 48)
        .format(KvFormat::Q8)
        .bytes_needed()
        .unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
    assert!(e.message().contains("multiple of 32"), "{e}");
}

#[test]
fn attention_over_quantized_values() {
    let ctx = Context::cpu().unwrap();
    let mut rng = Rng::fresh("attention_over_quantized_values");
    let s = Shape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
    };
    for (f, v) in [
        (KvFormat::Q8, None),
        (KvFormat::Q4, None),
        (KvFormat::Q8, Some(KvFormat::Q4)),
        (KvFormat::F16, Some(KvFormat::Q8)),
        (KvFormat::Q4, Some(KvFormat::Q3)),
        (KvFormat::Q4, Some(KvFormat::Q2)),
    ] {
        let cfg = config(f, v);
        let mut kv = KvCache::new(&ctx, &cfg).unwrap();
        let n = 257;
        let k: Vec<f32> = (0..n * cfg.kv_row_len())
            .map(|_| rng.uniform() as f32 * 2.0 - 1.0)
            .collect();
        let vv: Vec<f32> = (0..n * cfg.kv_row_len())
            .map(|_| rng.uniform() as f32 * 2.0 - 1.0)
            .collect();
        let dk = DeviceBuffer::from_slice(&ctx, &k).unwrap();
        let dv = DeviceBuffer::from_slice(&ctx, &vv).unwrap();
        kv.append_tokens(0, 0, n, &dk, &dv).unwrap();
        let mut rk = DeviceBuffer::<f16>::zeros(&ctx, n * cfg.kv_row_len()).unwrap();
        let mut rv = DeviceBuffer::<f16>::zeros(&ctx, n * cfg.kv_row_len()).unwrap();
        kv.read_f16(0, 0, 0, &mut rk, &mut rv).unwrap();
        let (hk, hv) = (rk.to_vec().unwrap(), rv.to_vec().unwrap());
        // quantized: the stored values differ from the input, but not by much
        let err = k
            .iter()
            .zip(&hk)
            .map(|(a, b)| (a - b.to_f32()).abs())
            .fold(0.0f32, f32::max);
        let bound = if f == KvFormat::Q4 { 0.08 } else { 0.01 };
        assert!(err <= bound, "{f:?}: stored K off by {err} (bound {bound})");
        let q: Vec<f32> = (0..cfg.q_row_len())
            .map(|_| rng.uniform() as f32 * 2.0 - 1.0)
            .collect();
        let dq = DeviceBuffer::from_slice(&ctx, &q).unwrap();
        let mut out = DeviceBuffer::<f32>::zeros(&ctx, cfg.q_row_len()).unwrap();
        kv.attention(0, 0, &dq, &mut out, None).unwrap();
        // the reference sees the stored values rounded to FP16 (read_f16): about 1e-4 apart
        let want = reference_attention(s, &hk, &hv, &q, 1.0 / 8.0);
        let e = rel_l2(&out.to_vec().unwrap(), &want);
        assert!(e <= 2e-3, "{f:?}/{v:?}: relative L2 {e}");
    }
}

// ---- The header's rules, written here independently of the library ---------------------------

const GROUP: usize = 32;

fn fp16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// One group of 32 values quantized as the header says (FP32 arithmetic where it rounds),
/// dequantized exactly in float64.
fn quantize_group(format: KvFormat, x: &[f32], out: &mut [f64]) {
    match format {
        KvFormat::Q8 => {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = fp16(amax / 127.0);
            for (o, &v) in out.iter_mut().zip(x) {
                let c = if d == 0.0 {
                    0
                } else {
                    (v / d).round_ties_even().clamp(-127.0, 127.0) as i32
                };
                *o = c as f64 * d as f64;
            }
        }
        KvFormat::Q4 | KvFormat::Q3 | KvFormat::Q2 => {
            let qmax = match format {
                KvFormat::Q4 => 15.0,
                KvFormat::Q3 => 7.0,
                _ => 3.0,
            };
            let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = fp16((hi - lo) / qmax);
            let m = fp16(lo);
            for (o, &v) in out.iter_mut().zip(x) {
                let c = if d == 0.0 {
                    0
                } else {
                    ((v - m) / d).round_ties_even().clamp(0.0, qmax) as i32
                };
                *o = c as f64 * d as f64 + m as f64;
            }
        }
        other => panic!("{other:?} is not a quantized format"),
    }
}

/// The header's rotation of one row: over blocks of b dims, b the largest power of two dividing
/// the row's length, butterfly stages h = 1, 2, 4, .. of (x[i], x[i + h]) -> (x[i] + x[i + h],
/// x[i] - x[i + h]) for i with bit h clear, then every element times `scale` (1/sqrt(b)).
fn rotate<T>(x: &mut [T], scale: T)
where
    T: Copy + Add<Output = T> + Sub<Output = T> + Mul<Output = T>,
{
    let b = 1usize << x.len().trailing_zeros();
    for y in x.chunks_mut(b) {
        let mut h = 1;
        while h < b {
            for i in (0..b).filter(|i| i & h == 0) {
                let (a, c) = (y[i], y[i + h]);
                y[i] = a + c;
                y[i + h] = a - c;
            }
            h *= 2;
        }
        for v in y.iter_mut() {
            *v = *v * scale;
        }
    }
}

fn block(d: usize) -> usize {
    1 << d.trailing_zeros()
}

/// In FP32, as the library computes it.
fn rotate_f32(x: &mut [f32]) {
    rotate(x, 1.0 / (block(x.len()) as f32).sqrt());
}

/// In float64 with the exact scale: the orthogonal map itself (its own inverse).
fn rotate_f64(x: &mut [f64]) {
    rotate(x, 1.0 / (block(x.len()) as f64).sqrt());
}

/// How one tensor of a cache stores its rows.
#[derive(Clone, Copy, Debug)]
struct Rule {
    format: KvFormat,
    rotated: bool,
}

/// K's and V's rules for a config, from the header: a tensor stored F16 is never rotated; Auto
/// is the library's choice, which the header gives as every quantized tensor (as KV).
fn rules(cfg: &KvCacheConfig) -> (Rule, Rule) {
    let vf = cfg.v_format.unwrap_or(cfg.format);
    let (k, v) = match cfg.rotation {
        KvRotation::None => (false, false),
        KvRotation::K => (true, false),
        KvRotation::KV | KvRotation::Auto => (true, true),
        other => panic!("no rule for {other:?}"),
    };
    (
        Rule {
            format: cfg.format,
            rotated: k && cfg.format != KvFormat::F16,
        },
        Rule {
            format: vf,
            rotated: v && vf != KvFormat::F16,
        },
    )
}

/// For one appended row `x`: what attention reads, in float64 and in the row's own frame
/// (rotated back exactly), and what read_f16 returns (bit-exact). `kept`: a protected position
/// (its FP16 copy of the rotated values is read instead of the codes).
fn stored_row(rule: Rule, kept: bool, x: &[f32]) -> (Vec<f64>, Vec<f16>) {
    if rule.format == KvFormat::F16 {
        let read: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        return (read.iter().map(|h| h.to_f64()).collect(), read);
    }
    let mut y = x.to_vec();
    if rule.rotated {
        rotate_f32(&mut y);
    }
    let mut val = vec![0.0f64; x.len()];
    if kept {
        for (o, &v) in val.iter_mut().zip(&y) {
            *o = fp16(v) as f64;
        }
    } else {
        for (g, o) in y.chunks(GROUP).zip(val.chunks_mut(GROUP)) {
            quantize_group(rule.format, g, o);
        }
    }
    // read_f16: the value in FP32 (an FP16 copy exactly; code x scale + min rounded once),
    // rotated back in FP32, rounded to FP16.
    let mut back: Vec<f32> = val.iter().map(|&v| v as f32).collect();
    if rule.rotated {
        rotate_f32(&mut back);
    }
    if rule.rotated {
        rotate_f64(&mut val);
    }
    (val, back.iter().map(|&v| f16::from_f32(v)).collect())
}

/// Rows with structure quantization and rotation must survive: an outlier channel (x10-30, the
/// same in every row: what rotation is for), a group of equal values (Q4 scale 0), a group of
/// zeros (Q8 scale 0), and, where `big` (V), rows x1000.
fn fill_values(rng: &mut Rng, rows: usize, d: usize, big: bool) -> Vec<f32> {
    let outlier = rng.below(d);
    let mut x = Vec::with_capacity(rows * d);
    for _ in 0..rows {
        let mut row: Vec<f32> = (0..d).map(|_| rng.uniform() as f32 * 2.0 - 1.0).collect();
        row[outlier] *= 10.0 + 20.0 * rng.uniform() as f32;
        match rng.below(16) {
            0 => row[..GROUP].fill(0.5),
            1 => row[..GROUP].fill(0.0),
            2 if big => row.iter_mut().for_each(|v| *v *= 1000.0),
            _ => {}
        }
        x.extend_from_slice(&row);
    }
    x
}

/// Appends sequences of the given lengths to layer 1 of a cache of `cfg` (layer 0 gets
/// unrelated rows at the same time, so slots mixed up between layers show), in random chunks
/// (FP32 input, or FP16 where `f16_input`), checks read_f16 bit-exact against [`stored_row`]
/// and attention (one by one and batched) against the float64 reference. Returns the worst
/// relative L2 error.
fn check_case(
    ctx: &Context,
    rng: &mut Rng,
    cfg: KvCacheConfig,
    lens: &[usize],
    f16_input: bool,
) -> f64 {
    let max_len = lens.iter().copied().max().unwrap().max(1);
    let cfg = cfg.max_seqs(lens.len()).max_seq_len(max_len);
    let what = format!("{cfg:?}, f16 input {f16_input}");
    let mut kv = KvCache::new(ctx, &cfg).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(kv.config(), &cfg, "what the library recorded");
    let (rule_k, rule_v) = rules(&cfg);
    let quantized = rule_k.format != KvFormat::F16 || rule_v.format != KvFormat::F16;
    let (d, row) = (cfg.head_dim, cfg.kv_row_len());
    let s = Shape {
        n_heads: cfg.n_heads,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: d,
    };
    let mut values = Vec::new(); // per sequence: (K, V) as attention reads them
    for (seq, &len) in lens.iter().enumerate() {
        let mut k = fill_values(rng, len * cfg.n_kv_heads, d, false);
        let mut v = fill_values(rng, len * cfg.n_kv_heads, d, true);
        if f16_input {
            // the library quantizes the FP16 values: so does the reference
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = fp16(*x);
            }
        }
        let mut done = 0;
        while done < len {
            let n = (1 + rng.below(97)).min(len - done);
            let (kc, vc) = (
                &k[done * row..(done + n) * row],
                &v[done * row..(done + n) * row],
            );
            if f16_input {
                let h = |x: &[f32]| x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>();
                let kb = DeviceBuffer::from_slice(ctx, &h(kc)).unwrap();
                let vb = DeviceBuffer::from_slice(ctx, &h(vc)).unwrap();
                kv.append_tokens(1, seq, n, &kb, &vb).unwrap();
            } else {
                let kb = DeviceBuffer::from_slice(ctx, kc).unwrap();
                let vb = DeviceBuffer::from_slice(ctx, vc).unwrap();
                kv.append_tokens(1, seq, n, &kb, &vb).unwrap();
            }
            let junk = DeviceBuffer::from_slice(ctx, &rng.normal_vec(n * row, 3.0)).unwrap();
            kv.append_tokens(0, seq, n, &junk, &junk).unwrap();
            done += n;
        }
        // Appends only: the window is the last `window` positions.
        let (mut vk, mut vv) = (Vec::new(), Vec::new());
        let (mut rk, mut rv) = (Vec::new(), Vec::new());
        for r in 0..len * cfg.n_kv_heads {
            let p = r / cfg.n_kv_heads;
            let kept = quantized && (p < cfg.n_sinks || p + cfg.window >= len);
            let (val, read) = stored_row(rule_k, kept, &k[r * d..(r + 1) * d]);
            vk.extend(val);
            rk.extend(read);
            let (val, read) = stored_row(rule_v, kept, &v[r * d..(r + 1) * d]);
            vv.extend(val);
            rv.extend(read);
        }
        if len > 0 {
            let (gk, gv) = kv.read_to_host(1, seq, 0, len).unwrap();
            for (name, got, want) in [("K", &gk, &rk), ("V", &gv, &rv)] {
                let bad = got
                    .iter()
                    .zip(want.iter())
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                if let Some(i) = bad {
                    panic!(
                        "{what}: seq {seq}: stored {name} differs from the header's rule at \
                         position {}, dim {}: {} (0x{:04x}), want {} (0x{:04x})",
                        i / row,
                        i % d,
                        got[i],
                        got[i].to_bits(),
                        want[i],
                        want[i].to_bits()
                    );
                }
            }
        }
        values.push((vk, vv));
    }

    let qrow = cfg.q_row_len();
    let scale = default_scale(d);
    let q: Vec<f32> = (0..lens.len() * qrow)
        .map(|_| rng.uniform() as f32 * 2.0 - 1.0)
        .collect();
    let dq = DeviceBuffer::from_slice(ctx, &q).unwrap();
    let mut worst = 0.0f64;
    let mut out = DeviceBuffer::<f32>::zeros(ctx, lens.len() * qrow).unwrap();
    let ids: Vec<usize> = (0..lens.len()).collect();
    kv.attention_batch(1, &ids, &dq, &mut out, None).unwrap();
    let batched = out.to_vec().unwrap();
    for (seq, (vk, vv)) in values.iter().enumerate() {
        let qs = &q[seq * qrow..(seq + 1) * qrow];
        let want = reference_attention_f64(s, vk, vv, qs, scale);
        let mut one = DeviceBuffer::<f32>::zeros(ctx, qrow).unwrap();
        kv.attention(
            1,
            seq,
            &dq.slice(seq * qrow..(seq + 1) * qrow),
            &mut one,
            None,
        )
        .unwrap();
        for (how, got) in [
            ("one by one", one.to_vec().unwrap()),
            ("batched", batched[seq * qrow..(seq + 1) * qrow].to_vec()),
        ] {
            let e = rel_l2(&got, &want);
            assert!(
                e <= TOL,
                "{what}: seq {seq} (length {}), {how}: relative L2 {e:e} > {TOL:e}",
                lens[seq]
            );
            worst = worst.max(e);
        }
    }
    worst
}

#[test]
fn rotation_and_protected_tokens_against_the_header() {
    let ctx = Context::cpu().unwrap();
    let mut rng = Rng::fresh("rotation_and_protected_tokens_against_the_header");
    use KvFormat::{F16, Q2, Q3, Q4, Q8};
    use KvRotation::{Auto, K, KV};
    // (K format, V format, rotation, sinks, window, n_heads, n_kv_heads, head_dim)
    let cases = [
        (Q8, None, KV, 0, 0, 8, 2, 64),
        (Q4, None, K, 0, 0, 8, 2, 96), // blocks of 32
        (Q4, None, Auto, 0, 0, 4, 4, 128),
        (Q4, None, Auto, 4, 16, 8, 2, 64),
        (Q8, Some(Q4), KV, 3, 10, 8, 1, 128),
        (F16, Some(Q8), Auto, 2, 5, 4, 2, 64), // K F16: never rotated, never protected
        (Q8, None, KvRotation::None, 4, 16, 4, 4, 32),
        (Q4, None, KV, 1, 0, 6, 3, 256),
        (Q8, None, K, 0, 24, 8, 2, 160), // blocks of 32; window only
        (Q4, Some(Q3), Auto, 4, 16, 8, 2, 64),
        (Q4, Some(Q2), KV, 0, 0, 4, 1, 128),
        (Q8, Some(Q3), K, 2, 5, 6, 3, 32), // V unrotated
        (F16, Some(Q2), KvRotation::None, 0, 8, 4, 4, 256),
    ];
    let lens = [0, 1, 7, 40, 150];
    for (i, &(kf, vf, rotation, sinks, window, h, kvh, d)) in cases.iter().enumerate() {
        let mut cfg = KvCacheConfig::new(2, h, d)
            .kv_heads(kvh)
            .format(kf)
            .rotation(rotation)
            .sinks(sinks)
            .window(window);
        if let Some(vf) = vf {
            cfg = cfg.v_format(vf);
        }
        let e = check_case(&ctx, &mut rng, cfg, &lens, i % 2 == 1);
        println!("{cfg:?}: worst relative L2 {e:e}");
    }
}

/// The window through truncate, append and fork, position by position: read_f16 returns the
/// FP16 copy where a position is protected and the dequantized value elsewhere.
#[test]
fn protected_window_through_truncate_append_fork() {
    const D: usize = 32;
    const SINKS: usize = 2;
    const WINDOW: usize = 8;
    const N: usize = 40;
    let ctx = Context::cpu().unwrap();
    let mut rng = Rng::fresh("protected_window_through_truncate_append_fork");
    for (format, v_format) in [
        (KvFormat::Q8, KvFormat::Q8),
        (KvFormat::Q4, KvFormat::Q4),
        (KvFormat::Q4, KvFormat::Q3),
        (KvFormat::Q4, KvFormat::Q2),
    ] {
        let cfg = KvCacheConfig::new(1, 1, D)
            .max_seqs(2)
            .max_seq_len(N)
            .format(format)
            .v_format(v_format)
            .rotation(KvRotation::None)
            .sinks(SINKS)
            .window(WINDOW);
        let mut kv = KvCache::new(&ctx, &cfg).unwrap();
        let x: Vec<f16> = (0..N * D)
            .map(|_| f16::from_f32(rng.uniform() as f32 * 2.0 - 1.0))
            .collect();
        let rules = [format, v_format].map(|format| Rule {
            format,
            rotated: false,
        });
        enum Op {
            Append(usize),
            Truncate(usize),
            Fork,
        }
        // (operation on seq 0, the first window position after it). 30 positions (window
        // 22..29); back to 27 (22..26 stay); 5 more, 27..31 (window 24..31: 22 and 23 left it);
        // fork into seq 1; back to 20 (no window: 20.. were never refilled); 3 more (20..22).
        let steps = [
            (Op::Append(30), 22),
            (Op::Truncate(27), 22),
            (Op::Append(5), 24),
            (Op::Fork, 24),
            (Op::Truncate(20), 20),
            (Op::Append(3), 20),
        ];
        let mut len = 0;
        for (step, (op, lo)) in steps.iter().enumerate() {
            let seqs: &[usize] = match *op {
                Op::Append(n) => {
                    let b = DeviceBuffer::from_slice(&ctx, &x[len * D..(len + n) * D]).unwrap();
                    kv.append_tokens(0, 0, n, &b, &b).unwrap();
                    len += n;
                    &[0]
                }
                Op::Truncate(n) => {
                    kv.truncate(0, n).unwrap();
                    len = n;
                    &[0]
                }
                Op::Fork => {
                    kv.fork(1, 0).unwrap();
                    &[0, 1]
                }
            };
            for &seq in seqs {
                let (k, v) = kv.read_to_host(0, seq, 0, len).unwrap();
                for p in 0..len {
                    let row: Vec<f32> = x[p * D..(p + 1) * D].iter().map(|h| h.to_f32()).collect();
                    for (got, rule) in [&k, &v].into_iter().zip(rules) {
                        let (_, want) = stored_row(rule, p < SINKS || p >= *lo, &row);
                        assert!(
                            got[p * D..(p + 1) * D] == want[..],
                            "{:?}, step {step}, seq {seq}: position {p} is not what the \
                             window says (first window position {lo})",
                            rule.format
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn rotation_and_protection_options() {
    // The defaults are the library's.
    let mut o = sys::m40llm_kvcache_options::default();
    // SAFETY: a valid out struct.
    let rc =
        unsafe { sys::m40llm_kvcache_options_init(&mut o, sys::M40LLM_KVCACHE_OPTIONS_VERSION) };
    assert_eq!(rc, sys::M40LLM_OK);
    let cfg = KvCacheConfig::new(2, 8, 64)
        .kv_heads(2)
        .max_seqs(3)
        .max_seq_len(100);
    assert_eq!(cfg.rotation.to_raw(), o.rotation);
    assert_eq!(cfg.rotation, KvRotation::from_raw(o.rotation));
    assert_eq!(
        (cfg.n_sinks as i32, cfg.window as i32),
        (o.n_sinks, o.window)
    );

    // The C values.
    for (r, c) in [
        (KvRotation::Auto, sys::M40LLM_ROTATE_AUTO),
        (KvRotation::None, sys::M40LLM_ROTATE_NONE),
        (KvRotation::K, sys::M40LLM_ROTATE_K),
        (KvRotation::KV, sys::M40LLM_ROTATE_KV),
    ] {
        assert_eq!(r.to_raw(), c as i32);
        assert_eq!(KvRotation::from_raw(c as i32), r);
    }
    assert_eq!(KvRotation::from_raw(7), KvRotation::Unknown(7));
    assert_eq!(KvRotation::Unknown(-3).to_raw(), -3);

    // What a cache was created with, as the library recorded it (not capped).
    let ctx = Context::cpu().unwrap();
    for (format, rotation, sinks, window) in [
        (KvFormat::Q4, KvRotation::K, 3, 1000),
        (KvFormat::Q8, KvRotation::None, 0, 7),
        (KvFormat::F16, KvRotation::KV, 4, 128),
        (KvFormat::Q8, KvRotation::Auto, 0, 0),
    ] {
        let c = cfg
            .format(format)
            .rotation(rotation)
            .sinks(sinks)
            .window(window);
        let kv = KvCache::new(&ctx, &c).unwrap();
        assert_eq!(kv.config(), &c);
        assert_eq!(kv.config().rotation, rotation);
        assert_eq!((kv.config().n_sinks, kv.config().window), (sinks, window));
    }

    // Memory: (sinks + window) FP16 rows of head_dim per layer, sequence, K/V head and quantized
    // tensor; capped at max_seq_len; nothing for F16 tensors, nothing for rotation.
    let rows = 2 * 3 * 2; // layers x sequences x K/V heads
    let bytes = |c: KvCacheConfig| c.bytes_needed().unwrap();
    for (format, v_format, tensors) in [
        (KvFormat::Q4, None, 2),
        (KvFormat::Q8, Some(KvFormat::F16), 1),
        (KvFormat::F16, None, 0),
    ] {
        let mut c = cfg.format(format).sinks(0).window(0);
        if let Some(v) = v_format {
            c = c.v_format(v);
        }
        let base = bytes(c);
        let extra = |slots: usize| base + slots * 64 * 2 * rows * tensors;
        assert_eq!(bytes(c.sinks(4).window(16)), extra(20), "{format:?}");
        assert_eq!(
            bytes(c.sinks(4).window(16).rotation(KvRotation::None)),
            extra(20)
        );
        assert_eq!(
            bytes(c.sinks(4).window(16).rotation(KvRotation::KV)),
            extra(20)
        );
        assert_eq!(bytes(c.sinks(30).window(1000)), extra(100), "window capped");
        assert_eq!(bytes(c.sinks(500).window(1000)), extra(100), "sinks capped");
        assert_eq!(bytes(c.window(5)), extra(5));
    }

    // Refused, with the library's status and message (a value this crate does not name goes to
    // the library as is).
    for raw in [7, 4, -1] {
        let c = cfg.format(KvFormat::Q8).rotation(KvRotation::Unknown(raw));
        for e in [
            KvCache::new(&ctx, &c).unwrap_err(),
            c.bytes_needed().unwrap_err(),
            c.max_seq_len_for_budget(1 << 30).unwrap_err(),
        ] {
            assert_eq!(e.status(), Status::InvalidArgument, "{e}");
            assert!(e.message().contains(&format!("rotation is {raw}")), "{e}");
        }
    }
    // Counts are usize (never negative); one past a C int is refused before the library.
    let big = i32::MAX as usize + 1;
    for (what, c) in [
        ("n_sinks", cfg.format(KvFormat::Q8).sinks(big)),
        ("window", cfg.format(KvFormat::Q8).window(big)),
    ] {
        let e = KvCache::new(&ctx, &c).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        assert!(e.message().contains(what), "{e}");
    }
}
