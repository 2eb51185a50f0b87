//! Shared test helpers: a small seeded RNG, the float64 reference attention, error metrics and
//! the GPU gate.
#![allow(dead_code)]

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use m40llm::{
    built_with_cuda, cuda_device_count, f16, Context, DeviceBuffer, KvCache, KvCacheConfig,
};

/// SplitMix64: tiny, fast, and its stream never changes across crate versions, so a printed
/// seed reproduces a failure forever.
pub struct Rng(u64);

impl Rng {
    /// A fresh seed per run (or `M40LLM_TEST_SEED`), printed so failures can be reproduced.
    pub fn fresh(test: &str) -> Rng {
        let seed = std::env::var("M40LLM_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
                t.as_nanos() as u64 ^ (test.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            });
        println!("{test}: seed {seed} (rerun with M40LLM_TEST_SEED={seed})");
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn normal_vec(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * std) as f32).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Shape of a reference problem.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Float64 attention of one query row over positions stored as FP16:
/// k and v are [len][n_kv_heads][head_dim] (already FP16-rounded), q is [n_heads][head_dim].
pub fn reference_attention(s: Shape, k: &[f16], v: &[f16], q: &[f32], scale: f64) -> Vec<f64> {
    let widen = |x: &[f16]| x.iter().map(|h| h.to_f64()).collect::<Vec<f64>>();
    reference_attention_f64(s, &widen(k), &widen(v), q, scale)
}

/// [`reference_attention`] over K and V given in float64, [len][n_kv_heads][head_dim].
pub fn reference_attention_f64(s: Shape, k: &[f64], v: &[f64], q: &[f32], scale: f64) -> Vec<f64> {
    let (h, kvh, d) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let len = k.len() / (kvh * d);
    let group = h / kvh;
    let mut out = vec![0.0f64; h * d];
    if len == 0 {
        return out;
    }
    for head in 0..h {
        let g = head / group;
        let qh = &q[head * d..(head + 1) * d];
        let scores: Vec<f64> = (0..len)
            .map(|t| {
                let kt = &k[(t * kvh + g) * d..(t * kvh + g + 1) * d];
                scale * qh.iter().zip(kt).map(|(&a, &b)| a as f64 * b).sum::<f64>()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|&x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for (t, wt) in w.iter().enumerate() {
            let vt = &v[(t * kvh + g) * d..(t * kvh + g + 1) * d];
            for (o, &x) in out[head * d..(head + 1) * d].iter_mut().zip(vt) {
                *o += wt / z * x;
            }
        }
    }
    out
}

/// ||got - want||_2 / ||want||_2 (absolute when want is all zeros).
pub fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub const TOL: f64 = 1e-5;

/// What the library stores for FP32 input: round to nearest even.
pub fn to_f16(x: &[f32]) -> Vec<f16> {
    x.iter().map(|&v| f16::from_f32(v)).collect()
}

/// The default scale, computed as the library does (FP32).
pub fn default_scale(head_dim: usize) -> f64 {
    (1.0f32 / (head_dim as f32).sqrt()) as f64
}

/// Whether this build has CUDA and the machine a CUDA device.
#[allow(dead_code)] // used by gpu.rs only
pub fn gpu_present() -> bool {
    built_with_cuda() && cuda_device_count().unwrap_or(0) > 0
}

/// A CUDA context on device 0, or None (after printing "skipped: no CUDA device") when this
/// build or machine has none. With M40LLM_REQUIRE_GPU=1 a missing GPU fails the test instead.
pub fn gpu_context(test: &str) -> Option<Context> {
    let require = std::env::var("M40LLM_REQUIRE_GPU")
        .map(|v| v == "1")
        .unwrap_or(false);
    let count = cuda_device_count().unwrap_or(0);
    if !built_with_cuda() || count == 0 {
        let why = if built_with_cuda() {
            "no CUDA device".to_string()
        } else {
            "no CUDA device (m40llm was built without CUDA)".to_string()
        };
        if require {
            panic!("{test}: M40LLM_REQUIRE_GPU=1 but {why}");
        }
        // Written past the test harness's capture so it is always visible.
        let line = format!("{test}: skipped: {why}\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
        return None;
    }
    let ctx = Context::cuda(0).expect("creating a CUDA context on device 0");
    println!("{test}: {}", ctx.device_info().expect("device info"));
    Some(ctx)
}

/// The entries of a [`m40llm::BuildInfo::cuda_architectures`] list: `(NN, true)` for `NN-real`
/// (SASS), `(NN, false)` for `NN-virtual` (PTX), NN possibly followed by letters; `None` when
/// an entry has another form.
pub fn parse_archs(list: &str) -> Option<Vec<(u32, bool)>> {
    list.split(';')
        .map(|e| {
            let (arch, kind) = e.split_once('-')?;
            let digits = arch.trim_end_matches(|c: char| c.is_ascii_lowercase());
            let real = match kind {
                "real" => true,
                "virtual" => false,
                _ => return None,
            };
            Some((digits.parse().ok()?, real))
        })
        .collect()
}

/// Fills a cache (2 layers; layer 0 gets unrelated data to catch layer mix-ups) with random
/// sequences of the given lengths, appended in random-sized chunks (FP32 or FP16 input), then
/// checks single-sequence and batched attention of layer 1 against the float64 reference.
/// Returns the worst relative L2 error seen.
pub fn check_attention_case(
    ctx: &Context,
    rng: &mut Rng,
    s: Shape,
    lens: &[usize],
    f16_input: bool,
    scale: Option<f32>,
) -> f64 {
    use m40llm::{DeviceBuffer, KvCache, KvCacheConfig};

    let max_len = lens.iter().copied().max().unwrap_or(0).max(1);
    let cfg = KvCacheConfig::new(2, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seqs(lens.len())
        .max_seq_len(max_len);
    let mut kv = KvCache::new(ctx, &cfg).expect("create cache");
    let row = cfg.kv_row_len();
    let mut k_host: Vec<Vec<f16>> = vec![Vec::new(); lens.len()];
    let mut v_host: Vec<Vec<f16>> = vec![Vec::new(); lens.len()];
    for (seq, &len) in lens.iter().enumerate() {
        // Layer 0: a few junk tokens.
        let junk = len.min(3);
        if junk > 0 {
            let j = DeviceBuffer::from_slice(ctx, &rng.normal_vec(junk * row, 5.0)).unwrap();
            assert_eq!(kv.append(0, seq, &j, &j).unwrap(), junk);
        }
        let mut done = 0;
        while done < len {
            let n = if rng.below(3) == 0 {
                1
            } else {
                1 + rng.below(len - done)
            }
            .min(len - done);
            let k = rng.normal_vec(n * row, 1.0);
            let v = rng.normal_vec(n * row, 1.0);
            let (k16, v16) = (to_f16(&k), to_f16(&v));
            // One token: append_token; several: append_tokens (both check the length exactly).
            if f16_input {
                let kb = DeviceBuffer::from_slice(ctx, &k16).unwrap();
                let vb = DeviceBuffer::from_slice(ctx, &v16).unwrap();
                if n == 1 {
                    kv.append_token(1, seq, &kb, &vb).unwrap();
                } else {
                    kv.append_tokens(1, seq, n, &kb, &vb).unwrap();
                }
            } else {
                let kb = DeviceBuffer::from_slice(ctx, &k).unwrap();
                let vb = DeviceBuffer::from_slice(ctx, &v).unwrap();
                if n == 1 {
                    kv.append_token(1, seq, &kb, &vb).unwrap();
                } else {
                    kv.append_tokens(1, seq, n, &kb, &vb).unwrap();
                }
            }
            k_host[seq].extend_from_slice(&k16);
            v_host[seq].extend_from_slice(&v16);
            done += n;
        }
        assert_eq!(kv.seq_len(1, seq).unwrap(), len);
        assert_eq!(kv.seq_len(0, seq).unwrap(), junk);
    }
    // The stored FP16 must be exactly the round-to-nearest-even of the input.
    for (seq, &len) in lens.iter().enumerate() {
        if len > 0 {
            let (k, v) = kv.read_to_host(1, seq, 0, len).unwrap();
            assert!(k == k_host[seq], "K read back differs for seq {seq}");
            assert!(v == v_host[seq], "V read back differs for seq {seq}");
        }
    }

    let scale_ref = scale
        .map(|x| x as f64)
        .unwrap_or_else(|| default_scale(s.head_dim));
    let qrow = cfg.q_row_len();
    let mut worst = 0.0f64;

    // Single-sequence attention.
    for seq in 0..lens.len() {
        let q = rng.normal_vec(qrow, 1.0);
        let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
        let mut out = DeviceBuffer::<f32>::zeros(ctx, qrow).unwrap();
        kv.attention(1, seq, &qb, &mut out, scale).unwrap();
        let got = out.to_vec().unwrap();
        let want = reference_attention(s, &k_host[seq], &v_host[seq], &q, scale_ref);
        let e = rel_l2(&got, &want);
        assert!(
            e <= TOL,
            "single seq {seq} len {}: rel L2 {e:e} > {TOL:e} ({s:?})",
            lens[seq]
        );
        worst = worst.max(e);
    }

    // Batched attention over every sequence in a shuffled order, with one id repeated.
    let mut ids: Vec<usize> = (0..lens.len()).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    ids.push(ids[0]);
    let q = rng.normal_vec(ids.len() * qrow, 1.0);
    let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
    let mut out = DeviceBuffer::<f32>::zeros(ctx, ids.len() * qrow).unwrap();
    kv.attention_batch(1, &ids, &qb, &mut out, scale).unwrap();
    let got = out.to_vec().unwrap();
    for (i, &seq) in ids.iter().enumerate() {
        let want = reference_attention(
            s,
            &k_host[seq],
            &v_host[seq],
            &q[i * qrow..(i + 1) * qrow],
            scale_ref,
        );
        let e = rel_l2(&got[i * qrow..(i + 1) * qrow], &want);
        assert!(
            e <= TOL,
            "batched row {i} (seq {seq}, len {}): rel L2 {e:e} > {TOL:e} ({s:?})",
            lens[seq]
        );
        worst = worst.max(e);
    }
    worst
}

/// Batched appends to layer 1 of a cache on `ctx` (ragged counts 0, 1, 31, 33, 257, then decode
/// steps of one token a sequence, then small random counts), the same rows one sequence at a
/// time to a second cache on `ctx`, and the same batches to a third on the CPU backend: after
/// every batch all three must hold the same lengths and bits (read back as FP16). The config
/// needs 2 layers, at least 6 sequences and room for 257 + 5 + 4 × 20 tokens.
pub fn check_append_batch(ctx: &Context, rng: &mut Rng, cfg: &KvCacheConfig) {
    let cpu = Context::cpu().expect("CPU context");
    let mut a = KvCache::new(ctx, cfg).expect("cache a");
    let mut b = KvCache::new(ctx, cfg).expect("cache b");
    let mut c = KvCache::new(&cpu, cfg).expect("cache c");
    let (row, seqs) = (cfg.kv_row_len(), cfg.max_seqs);
    let mut ids: Vec<usize> = (0..seqs).collect();
    for round in 0..10 {
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let n = if round == 0 {
            seqs
        } else {
            1 + rng.below(seqs)
        };
        let decode = round % 2 == 1;
        let counts: Vec<usize> = (0..n)
            .map(|i| match round {
                0 => [1, 31, 33, 257, 0, 1].get(i).copied().unwrap_or(2),
                _ if decode => 1,
                _ => rng.below(21),
            })
            .collect();
        let total: usize = counts.iter().sum();
        let k = rng.normal_vec(total * row, 1.0);
        let v = rng.normal_vec(total * row, 2.0);
        let (dk, dv) = (
            DeviceBuffer::from_slice(ctx, &k).unwrap(),
            DeviceBuffer::from_slice(ctx, &v).unwrap(),
        );
        let (ck, cv) = (
            DeviceBuffer::from_slice(&cpu, &k).unwrap(),
            DeviceBuffer::from_slice(&cpu, &v).unwrap(),
        );
        if decode {
            a.append_token_batch(1, &ids[..n], &dk, &dv).unwrap();
            c.append_token_batch(1, &ids[..n], &ck, &cv).unwrap();
        } else {
            a.append_batch(1, &ids[..n], &counts, &dk, &dv).unwrap();
            c.append_batch(1, &ids[..n], &counts, &ck, &cv).unwrap();
        }
        let mut off = 0;
        for (&s, &cnt) in ids[..n].iter().zip(&counts) {
            let r = off * row..(off + cnt) * row;
            if cnt > 0 {
                b.append_tokens(1, s, cnt, &dk.slice(r.clone()), &dv.slice(r))
                    .unwrap();
            }
            off += cnt;
        }
        for s in 0..seqs {
            let len = b.seq_len(1, s).unwrap();
            assert_eq!(a.seq_len(1, s).unwrap(), len, "round {round}: seq {s}");
            assert_eq!(c.seq_len(1, s).unwrap(), len, "round {round}: seq {s}");
            assert_eq!(
                a.seq_len(0, s).unwrap(),
                0,
                "round {round}: layer 0 seq {s}"
            );
            if len > 0 {
                let want = b.read_to_host(1, s, 0, len).unwrap();
                assert!(
                    a.read_to_host(1, s, 0, len).unwrap() == want,
                    "round {round}: seq {s}: batched and single appends stored different bits"
                );
                assert!(
                    c.read_to_host(1, s, 0, len).unwrap() == want,
                    "round {round}: seq {s}: the CPU backend stored different bits"
                );
            }
        }
    }
}

/// Causal attention ([`m40llm::KvCache::attention_causal`]) of a ragged batch: sequence `i`
/// gets `prefix[i]` positions, then `counts[i]` new ones (the query rows' own, one batched
/// append each), then every row is checked against the float64 reference over the positions
/// it sees (the last `window` of them, where given). Output poisoned (NaN) first. Returns the
/// largest relative L2 error of a row.
#[allow(dead_code)] // each test binary uses what it needs
pub fn check_causal_case(
    ctx: &Context,
    rng: &mut Rng,
    s: Shape,
    prefix: &[usize],
    counts: &[usize],
    window: Option<usize>,
) -> f64 {
    use m40llm::{DeviceBuffer, KvCache, KvCacheConfig};

    let n = prefix.len();
    let lens: Vec<usize> = prefix.iter().zip(counts).map(|(p, c)| p + c).collect();
    let cfg = KvCacheConfig::new(1, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seqs(n)
        .max_seq_len(lens.iter().copied().max().unwrap_or(1));
    let mut kv = KvCache::new(ctx, &cfg).expect("create cache");
    let row = cfg.kv_row_len();
    let ids: Vec<usize> = (0..n).collect();
    let k: Vec<Vec<f32>> = lens.iter().map(|&l| rng.normal_vec(l * row, 1.0)).collect();
    let v: Vec<Vec<f32>> = lens.iter().map(|&l| rng.normal_vec(l * row, 1.0)).collect();
    for (phase, sizes) in [prefix, counts].into_iter().enumerate() {
        let pick = |x: &[Vec<f32>]| -> Vec<f32> {
            (0..n)
                .flat_map(|i| {
                    let first = if phase == 0 { 0 } else { prefix[i] };
                    x[i][first * row..(first + sizes[i]) * row].to_vec()
                })
                .collect()
        };
        let (kp, vp) = (pick(&k), pick(&v));
        if kp.is_empty() {
            continue;
        }
        let kb = DeviceBuffer::from_slice(ctx, &kp).unwrap();
        let vb = DeviceBuffer::from_slice(ctx, &vp).unwrap();
        kv.append_batch(0, &ids, sizes, &kb, &vb).unwrap();
    }
    let rows: usize = counts.iter().sum();
    let q_host = rng.normal_vec(rows * cfg.q_row_len(), 1.0);
    let q = DeviceBuffer::from_slice(ctx, &q_host).unwrap();
    let mut out = DeviceBuffer::from_slice(ctx, &vec![f32::NAN; rows * cfg.q_row_len()]).unwrap();
    kv.attention_causal(0, &ids, counts, &q, &mut out, None, window)
        .expect("causal attention");
    let got = out.to_vec().unwrap();
    let scale = default_scale(s.head_dim);
    let qr = cfg.q_row_len();
    let mut worst = 0.0f64;
    let mut r = 0;
    for i in 0..n {
        for t in 0..counts[i] {
            let end = prefix[i] + t + 1;
            let begin = window.map_or(0, |w| end.saturating_sub(w));
            let want = reference_attention(
                s,
                &to_f16(&k[i][begin * row..end * row]),
                &to_f16(&v[i][begin * row..end * row]),
                &q_host[r * qr..(r + 1) * qr],
                scale,
            );
            let e = rel_l2(&got[r * qr..(r + 1) * qr], &want);
            assert!(
                e <= TOL,
                "seq {i} row {t}: rel L2 {e:e} (prefix {}, window {window:?})",
                prefix[i]
            );
            worst = worst.max(e);
            r += 1;
        }
    }
    worst
}

/// 16-bit element types of q, out and K/V (f16, bf16), with the conversions of `half`.
pub trait Half16: m40llm::IoElement + m40llm::KvInput {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl Half16 for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}
impl Half16 for m40llm::bf16 {
    fn from_f32(x: f32) -> Self {
        m40llm::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        m40llm::bf16::to_f32(self)
    }
}

/// q, out and K/V in a 16-bit type T on `ctx`, for the decode, causal and append+attend calls:
/// two caches of `cfg` get the same values (T rows, and the same rows widened to f32); every
/// output element in T must be the f32 call's, on the widened q, rounded to T by `half` (bit
/// for bit: the kernels' arithmetic is the same FP32), and the f32 call must agree with the CPU
/// backend (float64, relative L2 ≤ 1e-5 a call). Outputs are poisoned (NaN) first.
#[allow(dead_code)] // each test binary uses what it needs
pub fn check_half_io<T: Half16>(ctx: &Context, rng: &mut Rng, cfg: &KvCacheConfig) {
    let cpu = Context::cpu().unwrap();
    let mut a = KvCache::new(ctx, cfg).unwrap();
    let mut b = KvCache::new(ctx, cfg).unwrap();
    let mut c = KvCache::new(&cpu, cfg).unwrap();
    let (row, qrow) = (cfg.kv_row_len(), cfg.q_row_len());
    let ids = [0usize, 1, 2, 3];
    let lens = [1usize, 31, 33, 257];
    let narrow = |x: Vec<f32>| -> (Vec<T>, Vec<f32>) {
        let t: Vec<T> = x.into_iter().map(T::from_f32).collect();
        let w = t.iter().map(|&h| h.to_f32()).collect();
        (t, w)
    };
    let (k16, k32) = narrow(rng.normal_vec(lens.iter().sum::<usize>() * row, 1.0));
    let (v16, v32) = narrow(rng.normal_vec(k16.len(), 1.0));
    let up = |ctx: &Context, x: &[T]| DeviceBuffer::from_slice(ctx, x).unwrap();
    let up32 = |ctx: &Context, x: &[f32]| DeviceBuffer::from_slice(ctx, x).unwrap();
    a.append_batch(0, &ids, &lens, &up(ctx, &k16), &up(ctx, &v16))
        .unwrap();
    b.append_batch(0, &ids, &lens, &up32(ctx, &k32), &up32(ctx, &v32))
        .unwrap();
    c.append_batch(0, &ids, &lens, &up32(&cpu, &k32), &up32(&cpu, &v32))
        .unwrap();
    for (s, len) in ids.into_iter().zip(lens) {
        assert_eq!(
            a.read_to_host(0, s, 0, len).unwrap(),
            b.read_to_host(0, s, 0, len).unwrap(),
            "{}: seq {s}: rows appended as {} are stored differently from their f32 values",
            T::NAME,
            T::NAME
        );
    }
    let counts = [1usize, 7, 33, 40];
    for call in ["decode", "causal", "append_attention"] {
        let rows = if call == "causal" {
            counts.iter().sum()
        } else {
            ids.len()
        };
        let (q16, q32) = narrow(rng.normal_vec(rows * qrow, 1.0));
        let (nk16, nk32) = narrow(rng.normal_vec(ids.len() * row, 1.0));
        let (nv16, nv32) = narrow(rng.normal_vec(ids.len() * row, 1.0));
        let mut o16 = up(ctx, &vec![T::from_f32(f32::NAN); rows * qrow]);
        let mut o32 = up32(ctx, &vec![f32::NAN; rows * qrow]);
        let mut oc = up32(&cpu, &vec![f32::NAN; rows * qrow]);
        let (dq16, dq32, cq) = (up(ctx, &q16), up32(ctx, &q32), up32(&cpu, &q32));
        match call {
            "decode" => {
                a.attention_batch(0, &ids, &dq16, &mut o16, None).unwrap();
                b.attention_batch(0, &ids, &dq32, &mut o32, None).unwrap();
                c.attention_batch(0, &ids, &cq, &mut oc, None).unwrap();
            }
            "causal" => {
                a.attention_causal(0, &ids, &counts, &dq16, &mut o16, None, None)
                    .unwrap();
                b.attention_causal(0, &ids, &counts, &dq32, &mut o32, None, None)
                    .unwrap();
                c.attention_causal(0, &ids, &counts, &cq, &mut oc, None, None)
                    .unwrap();
            }
            _ => {
                let (k, v) = (up(ctx, &nk16), up(ctx, &nv16));
                a.append_attention_batch(0, &ids, &k, &v, &dq16, &mut o16, None)
                    .unwrap();
                let (k, v) = (up32(ctx, &nk32), up32(ctx, &nv32));
                b.append_attention_batch(0, &ids, &k, &v, &dq32, &mut o32, None)
                    .unwrap();
                let (k, v) = (up32(&cpu, &nk32), up32(&cpu, &nv32));
                c.append_attention_batch(0, &ids, &k, &v, &cq, &mut oc, None)
                    .unwrap();
            }
        }
        let (got, wide) = (o16.to_vec().unwrap(), o32.to_vec().unwrap());
        for (i, (&g, &w)) in got.iter().zip(&wide).enumerate() {
            let want = T::from_f32(w);
            assert!(
                g.to_f32().to_bits() == want.to_f32().to_bits()
                    || (w.is_nan() && g.to_f32().is_nan()),
                "{} {call}: element {i} is {g:?}, the f32 output {w} rounds to {want:?}",
                T::NAME
            );
        }
        let want: Vec<f64> = oc.to_vec().unwrap().iter().map(|&x| x as f64).collect();
        let e = rel_l2(&wide, &want);
        assert!(
            e <= 1e-5,
            "{} {call}: f32 output against the CPU backend: rel L2 {e:e}",
            T::NAME
        );
    }
}
