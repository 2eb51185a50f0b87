//! Checks of m40llm's candle interop (`m40llm` feature `candle`) on one candle device, shared
//! by candle_interop.rs (the CPU) and candle_interop_gpu.rs (a CUDA device). Random tensors,
//! seeded per run; outputs against the float64 reference over the FP16-rounded K/V
//! (`common::TOL`) and, bit for bit, against the library's buffer API on the same data with
//! its output poisoned first.
#![allow(dead_code)] // each test binary uses its own subset

use candle_core::{DType, Device, Tensor};
use m40llm::{Context, DeviceBuffer, KvCache, KvCacheConfig, Status};

use crate::common::{default_scale, reference_attention, rel_l2, to_f16, Rng, Shape, TOL};

/// GQA with 3 query heads a K/V head, 12 heads (not a power of two).
pub const S: Shape = Shape {
    n_heads: 12,
    n_kv_heads: 4,
    head_dim: 64,
};
const LENS: [usize; 4] = [1, 31, 33, 257];

pub type Check = fn(&Context, &Device, &mut Rng);

/// Every check, by name.
pub const CHECKS: [(&str, Check); 8] = [
    ("attention_matches_reference", attention_matches_reference),
    ("causal_matches_reference", causal_matches_reference),
    ("offsets_and_layouts", offsets_and_layouts),
    ("f16_kv_is_stored_as_given", f16_kv_is_stored_as_given),
    ("half_q_and_kv", half_q_and_kv),
    (
        "append_attention_batch_matches_two_calls",
        append_attention_batch_matches_two_calls,
    ),
    (
        "bad_input_is_refused_and_writes_nothing",
        bad_input_is_refused_and_writes_nothing,
    ),
    (
        "host_tensors_on_a_gpu_cache_are_refused",
        host_tensors_on_a_gpu_cache_are_refused,
    ),
];

fn config(max_seqs: usize, max_seq_len: usize) -> KvCacheConfig {
    KvCacheConfig::new(1, S.n_heads, S.head_dim)
        .kv_heads(S.n_kv_heads)
        .max_seqs(max_seqs)
        .max_seq_len(max_seq_len)
}

/// A random tensor of `dims` on `device`, and its values.
fn random(rng: &mut Rng, dims: &[usize], device: &Device) -> (Tensor, Vec<f32>) {
    let v = rng.normal_vec(dims.iter().product(), 1.0);
    (Tensor::from_vec(v.clone(), dims, device).unwrap(), v)
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn kv_row() -> usize {
    S.n_kv_heads * S.head_dim
}

fn q_row() -> usize {
    S.n_heads * S.head_dim
}

/// The library's buffer API on the same q: the reference for bit-identity.
fn buffer_attention(kv: &KvCache, seq_ids: &[usize], q: &[f32], scale: Option<f32>) -> Vec<f32> {
    let ctx = kv.context();
    let qb = DeviceBuffer::from_slice(ctx, q).unwrap();
    let mut out = DeviceBuffer::from_slice(ctx, &vec![f32::NAN; q.len()]).unwrap();
    kv.attention_batch(0, seq_ids, &qb, &mut out, scale)
        .unwrap();
    out.to_vec().unwrap()
}

/// Row `r` of `got` against the reference over `k`/`v` (`[len][n_kv_heads][head_dim]`).
fn check_row(what: &str, got: &[f32], k: &[f32], v: &[f32], q: &[f32], scale: f64) {
    let want = reference_attention(S, &to_f16(k), &to_f16(v), q, scale);
    let e = rel_l2(got, &want);
    assert!(e <= TOL, "{what}: rel L2 {e:e} > {TOL:e}");
}

/// Sequences of LENS tokens appended as `[tokens, n_kv_heads, head_dim]` tensors; attention of
/// each alone, then of all in one batch (another order, one repeated, an explicit scale).
pub fn attention_matches_reference(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut kv = KvCache::new(ctx, &config(LENS.len(), 300)).unwrap();
    let (mut ks, mut vs) = (vec![], vec![]);
    for (s, &len) in LENS.iter().enumerate() {
        let (k, kh) = random(rng, &[len, S.n_kv_heads, S.head_dim], device);
        let (v, vh) = random(rng, &[len, S.n_kv_heads, S.head_dim], device);
        assert_eq!(kv.append_tensor(0, s, &k, &v).unwrap(), len);
        assert_eq!(kv.seq_len(0, s).unwrap(), len);
        ks.push(kh);
        vs.push(vh);
    }
    let scale = default_scale(S.head_dim);
    for s in 0..LENS.len() {
        let (q, qh) = random(rng, &[S.n_heads, S.head_dim], device);
        let out = kv.attention_tensor(0, s, &q, None).unwrap();
        assert_eq!(out.dims(), q.dims());
        assert_eq!(out.dtype(), DType::F32);
        assert!(out.device().same_device(device));
        let got = host(&out);
        check_row(
            &format!("seq {s} (len {})", LENS[s]),
            &got,
            &ks[s],
            &vs[s],
            &qh,
            scale,
        );
        assert_eq!(bits(&got), bits(&buffer_attention(&kv, &[s], &qh, None)));
    }
    let ids = [3, 0, 2, 0, 1];
    let (q, qh) = random(rng, &[ids.len(), S.n_heads, S.head_dim], device);
    let out = kv.attention_batch_tensor(0, &ids, &q, Some(0.07)).unwrap();
    assert_eq!(out.dims(), q.dims());
    let got = host(&out);
    for (r, &s) in ids.iter().enumerate() {
        let rows = r * q_row()..(r + 1) * q_row();
        let what = format!("batch row {r} (seq {s})");
        check_row(
            &what,
            &got[rows.clone()],
            &ks[s],
            &vs[s],
            &qh[rows],
            0.07f32 as f64,
        );
    }
    assert_eq!(
        bits(&got),
        bits(&buffer_attention(&kv, &ids, &qh, Some(0.07)))
    );
}

/// A 33-token prompt after 5 cached tokens (sequence 0, appended flat with explicit counts)
/// and a 1-token one (sequence 1, `[n_kv_heads, head_dim]`), causal attention of both in one
/// call, without and with a window.
pub fn causal_matches_reference(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut kv = KvCache::new(ctx, &config(2, 64)).unwrap();
    let (k0, k0h) = random(rng, &[5 * kv_row()], device);
    let (v0, v0h) = random(rng, &[5 * kv_row()], device);
    kv.append_tensor_batch(0, &[0], &[5], &k0, &v0).unwrap();
    let (k1, k1h) = random(rng, &[33, kv_row()], device);
    let (v1, v1h) = random(rng, &[33, kv_row()], device);
    let (k2, k2h) = random(rng, &[S.n_kv_heads, S.head_dim], device);
    let (v2, v2h) = random(rng, &[S.n_kv_heads, S.head_dim], device);
    kv.append_tensor_batch(0, &[0], &[33], &k1, &v1).unwrap();
    assert_eq!(kv.append_tensor(0, 1, &k2, &v2).unwrap(), 1);
    let k: Vec<Vec<f32>> = vec![[k0h, k1h].concat(), k2h];
    let v: Vec<Vec<f32>> = vec![[v0h, v1h].concat(), v2h];
    let (q, qh) = random(rng, &[34, S.n_heads, S.head_dim], device);
    let scale = default_scale(S.head_dim);
    for window in [None, Some(7)] {
        let out = kv
            .attention_causal_tensor(0, &[0, 1], &[33, 1], &q, None, window)
            .unwrap();
        assert_eq!(out.dims(), q.dims());
        let got = host(&out);
        // Row r: sequence 0's position 5 + r (r < 33), then sequence 1's position 0.
        for r in 0..34 {
            let (s, pos) = if r < 33 { (0, 5 + r) } else { (1, 0) };
            let first = window.map_or(0, |w| (pos + 1usize).saturating_sub(w));
            let span = first * kv_row()..(pos + 1) * kv_row();
            let rows = r * q_row()..(r + 1) * q_row();
            let what = format!("causal row {r} (seq {s}, window {window:?})");
            check_row(
                &what,
                &got[rows.clone()],
                &k[s][span.clone()],
                &v[s][span],
                &qh[rows],
                scale,
            );
        }
    }
}

/// Contiguous views with a start offset are read from that offset; leading dimensions of size
/// 1 are accepted; strided views are refused.
pub fn offsets_and_layouts(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut kv = KvCache::new(ctx, &config(1, 32)).unwrap();
    let (k, kh) = random(rng, &[1, 9, S.n_kv_heads, S.head_dim], device);
    let (v, vh) = random(rng, &[1, 9, S.n_kv_heads, S.head_dim], device);
    assert_eq!(kv.append_tensor(0, 0, &k, &v).unwrap(), 9);
    // Tokens 1 and 2 of a 4-token tensor: a view starting 1 token in.
    let (kb, kbh) = random(rng, &[4, S.n_kv_heads, S.head_dim], device);
    let (vb, vbh) = random(rng, &[4, S.n_kv_heads, S.head_dim], device);
    let (kn, vn) = (kb.narrow(0, 1, 2).unwrap(), vb.narrow(0, 1, 2).unwrap());
    assert_eq!(kn.layout().start_offset(), kv_row());
    assert_eq!(kv.append_tensor(0, 0, &kn, &vn).unwrap(), 2);
    let part = kv_row()..3 * kv_row();
    let (kall, vall) = (
        [kh, kbh[part.clone()].to_vec()].concat(),
        [vh, vbh[part].to_vec()].concat(),
    );
    // Query row 2 of 3.
    let (qb, qbh) = random(rng, &[3, S.n_heads, S.head_dim], device);
    let q = qb.narrow(0, 2, 1).unwrap();
    assert_eq!(q.layout().start_offset(), 2 * q_row());
    let got = host(&kv.attention_tensor(0, 0, &q, None).unwrap());
    let qh = &qbh[2 * q_row()..];
    check_row(
        "q at an offset",
        &got,
        &kall,
        &vall,
        qh,
        default_scale(S.head_dim),
    );
    assert_eq!(bits(&got), bits(&buffer_attention(&kv, &[0], qh, None)));
    // Strided: a transposed q, and K/V of [n_kv_heads, head_dim] made by transposing.
    let qt = random(rng, &[S.head_dim, S.n_heads], device).0.t().unwrap();
    let e = kv.attention_tensor(0, 0, &qt, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("contiguous"), "{e}");
    let kt = random(rng, &[S.head_dim, S.n_kv_heads], device)
        .0
        .t()
        .unwrap();
    let e = kv.append_tensor(0, 0, &kt, &kt).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("contiguous"), "{e}");
    assert_eq!(kv.seq_len(0, 0).unwrap(), 11);
}

/// F16 K/V tensors are stored as they are: the same cache contents as their FP32 widening.
pub fn f16_kv_is_stored_as_given(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut a = KvCache::new(ctx, &config(1, 40)).unwrap();
    let mut b = KvCache::new(ctx, &config(1, 40)).unwrap();
    let dims = [33, S.n_kv_heads, S.head_dim];
    let k = random(rng, &dims, device).0.to_dtype(DType::F16).unwrap();
    let v = random(rng, &dims, device).0.to_dtype(DType::F16).unwrap();
    assert_eq!(a.append_tensor(0, 0, &k, &v).unwrap(), 33);
    let (kw, vw) = (
        k.to_dtype(DType::F32).unwrap(),
        v.to_dtype(DType::F32).unwrap(),
    );
    assert_eq!(b.append_tensor(0, 0, &kw, &vw).unwrap(), 33);
    let stored = a.read_to_host(0, 0, 0, 33).unwrap();
    assert_eq!(stored, b.read_to_host(0, 0, 0, 33).unwrap());
    let given = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<m40llm::f16>().unwrap();
    assert_eq!(stored, (given(&k), given(&v)));
}

/// A decode step from tensors in one call: the same bits as the append and the attention.
pub fn append_attention_batch_matches_two_calls(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut a = KvCache::new(ctx, &config(3, 40)).unwrap();
    let mut b = KvCache::new(ctx, &config(3, 40)).unwrap();
    for s in 0..3 {
        let (k, _) = random(rng, &[s * 15 + 1, S.n_kv_heads, S.head_dim], device);
        let (v, _) = random(rng, &[s * 15 + 1, S.n_kv_heads, S.head_dim], device);
        a.append_tensor(0, s, &k, &v).unwrap();
        b.append_tensor(0, s, &k, &v).unwrap();
    }
    let ids = [2, 0];
    let (k, _) = random(rng, &[2, S.n_kv_heads, S.head_dim], device);
    let (v, _) = random(rng, &[2, S.n_kv_heads, S.head_dim], device);
    let (q, _) = random(rng, &[2, S.n_heads, S.head_dim], device);
    let fused = a
        .append_attention_batch_tensor(0, &ids, &k, &v, &q, None)
        .unwrap();
    b.append_tensor_batch(0, &ids, &[1, 1], &k, &v).unwrap();
    let apart = b.attention_batch_tensor(0, &ids, &q, None).unwrap();
    assert_eq!(fused.dims(), q.dims());
    assert_eq!(bits(&host(&fused)), bits(&host(&apart)));
    assert_eq!(
        (a.seq_len(0, 2).unwrap(), a.seq_len(0, 0).unwrap()),
        (32, 2)
    );
}

fn refused(r: m40llm::Result<impl std::fmt::Debug>, status: Status, words: &[&str]) {
    let e = r.unwrap_err();
    assert_eq!(e.status(), status, "{e}");
    for w in words {
        assert!(e.message().contains(w), "{w:?} not in: {e}");
    }
}

/// Wrong shapes, element counts and dtypes: clear errors, and the cache unchanged.
pub fn bad_input_is_refused_and_writes_nothing(ctx: &Context, device: &Device, rng: &mut Rng) {
    use Status::{InvalidArgument, Unsupported};
    let mut kv = KvCache::new(ctx, &config(1, 8)).unwrap();
    let kv_dims = [2, S.n_kv_heads, S.head_dim];
    let (k, _) = random(rng, &kv_dims, device);
    // The GQA mix-up: a query-shaped K/V row.
    let (qk, _) = random(rng, &[S.n_heads, S.head_dim], device);
    refused(
        kv.append_tensor(0, 0, &qk, &qk),
        InvalidArgument,
        &["n_kv_heads × head_dim", "query"],
    );
    // A layout the shape does not say the token count of, and K/V of different shapes.
    let (flat, _) = random(rng, &[2, kv_row()], device);
    refused(
        kv.append_tensor(0, 0, &flat, &flat),
        InvalidArgument,
        &["append_tensor_batch"],
    );
    let (k1, _) = random(rng, &[1, S.n_kv_heads, S.head_dim], device);
    refused(kv.append_tensor(0, 0, &k, &k1), InvalidArgument, &["shape"]);
    // A count that the elements do not match.
    refused(
        kv.append_tensor_batch(0, &[0], &[3], &k, &k),
        InvalidArgument,
        &["n_kv_heads × head_dim"],
    );
    // dtypes: F64 and I64 K/V, K and V of different dtypes, F64 q.
    for dt in [DType::F64, DType::I64] {
        let kd = k.to_dtype(dt).unwrap();
        refused(kv.append_tensor(0, 0, &kd, &kd), Unsupported, &["dtype"]);
    }
    let kh = k.to_dtype(DType::F16).unwrap();
    refused(kv.append_tensor(0, 0, &k, &kh), InvalidArgument, &["F16"]);
    // Capacity: 9 tokens into 8.
    let (big, _) = random(rng, &[9, S.n_kv_heads, S.head_dim], device);
    refused(kv.append_tensor(0, 0, &big, &big), Status::Capacity, &[]);
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0);
    assert_eq!(kv.append_tensor(0, 0, &k, &k).unwrap(), 2);
    let (q, _) = random(rng, &[S.n_heads, S.head_dim], device);
    let q64 = q.to_dtype(DType::F64).unwrap();
    refused(
        kv.attention_tensor(0, 0, &q64, None),
        Unsupported,
        &["F32, F16 or BF16"],
    );
    let qh = q.to_dtype(DType::F16).unwrap();
    refused(
        kv.append_attention_batch_tensor(0, &[0], &k1, &k1, &qh, None),
        InvalidArgument,
        &["one dtype"],
    );
    let (short, _) = random(rng, &[S.n_heads - 1, S.head_dim], device);
    refused(
        kv.attention_tensor(0, 0, &short, None),
        InvalidArgument,
        &["q has"],
    );
    refused(
        kv.attention_batch_tensor(0, &[0, 0], &q, None),
        InvalidArgument,
        &["q has"],
    );
    refused(
        kv.attention_tensor(0, 1, &q, None),
        Status::OutOfRange,
        &["seq"],
    );
    refused(
        kv.attention_tensor(0, 0, &q, Some(f32::NAN)),
        InvalidArgument,
        &["scale"],
    );
    assert_eq!(kv.seq_len(0, 0).unwrap(), 2);
}

/// Tensors in host memory given to a cache on a GPU (and, on the CPU, nothing to check).
pub fn host_tensors_on_a_gpu_cache_are_refused(ctx: &Context, _device: &Device, rng: &mut Rng) {
    if ctx.backend() == m40llm::Backend::Cpu {
        return;
    }
    let mut kv = KvCache::new(ctx, &config(1, 8)).unwrap();
    let (k, _) = random(rng, &[1, S.n_kv_heads, S.head_dim], &Device::Cpu);
    refused(
        kv.append_tensor(0, 0, &k, &k),
        Status::InvalidArgument,
        &["CPU", "from_candle_device"],
    );
    let (q, _) = random(rng, &[S.n_heads, S.head_dim], &Device::Cpu);
    refused(
        kv.attention_tensor(0, 0, &q, None),
        Status::InvalidArgument,
        &["CPU"],
    );
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0);
}

/// The 16-bit element types of q and out, with their bit patterns.
trait Half16: m40llm::IoElement + candle_core::WithDType {
    const NAN: Self;
    fn bits(self) -> u16;
}
impl Half16 for m40llm::f16 {
    const NAN: Self = m40llm::f16::NAN;
    fn bits(self) -> u16 {
        self.to_bits()
    }
}
impl Half16 for m40llm::bf16 {
    const NAN: Self = m40llm::bf16::NAN;
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

fn bits16<T: Half16>(t: &Tensor) -> Vec<u16> {
    let v = t.flatten_all().unwrap().to_vec1::<T>().unwrap();
    v.into_iter().map(T::bits).collect()
}

/// The library's buffer API on q's values in T (output poisoned first): the output's bits.
fn buffer_api_bits<T: Half16>(ctx: &Context, kv: &KvCache, ids: &[usize], q: &Tensor) -> Vec<u16> {
    let qb =
        DeviceBuffer::from_slice(ctx, &q.flatten_all().unwrap().to_vec1::<T>().unwrap()).unwrap();
    let mut ob = DeviceBuffer::from_slice(ctx, &vec![T::NAN; qb.len()]).unwrap();
    kv.attention_batch(0, ids, &qb, &mut ob, None).unwrap();
    ob.to_vec().unwrap().into_iter().map(T::bits).collect()
}

/// F16 and BF16 q: outputs of q's dtype, bit for bit the library's buffer API, within the
/// output's rounding of the float64 reference over the same (16-bit) q; BF16 K/V stored as
/// their FP32 widening would be.
pub fn half_q_and_kv(ctx: &Context, device: &Device, rng: &mut Rng) {
    let mut kv = KvCache::new(ctx, &config(2, 64)).unwrap();
    let dims = [33, S.n_kv_heads, S.head_dim];
    let (k, kh) = random(rng, &dims, device);
    let (v, vh) = random(rng, &dims, device);
    assert_eq!(kv.append_tensor(0, 0, &k, &v).unwrap(), 33);
    let ids = [0, 0];
    for (dt, tol) in [(DType::F16, 1e-3), (DType::BF16, 8e-3)] {
        let q = random(rng, &[ids.len(), S.n_heads, S.head_dim], device)
            .0
            .to_dtype(dt)
            .unwrap();
        let qw = host(&q.to_dtype(DType::F32).unwrap()); // q's 16-bit values, exactly
        let out = kv.attention_batch_tensor(0, &ids, &q, None).unwrap();
        assert_eq!((out.dtype(), out.dims()), (dt, q.dims()));
        let got = host(&out.to_dtype(DType::F32).unwrap());
        for r in 0..ids.len() {
            let rows = r * q_row()..(r + 1) * q_row();
            let want = reference_attention(
                S,
                &to_f16(&kh),
                &to_f16(&vh),
                &qw[rows.clone()],
                default_scale(S.head_dim),
            );
            let e = rel_l2(&got[rows], &want);
            assert!(e <= tol, "{dt:?} q row {r}: rel L2 {e:e} > {tol:e}");
        }
        let (got, want) = match dt {
            DType::F16 => (
                bits16::<m40llm::f16>(&out),
                buffer_api_bits::<m40llm::f16>(ctx, &kv, &ids, &q),
            ),
            _ => (
                bits16::<m40llm::bf16>(&out),
                buffer_api_bits::<m40llm::bf16>(ctx, &kv, &ids, &q),
            ),
        };
        assert_eq!(got, want, "{dt:?}: not the buffer API's bits");
    }
    // BF16 K/V: the cache holds what their FP32 widening gives.
    let kb = k.to_dtype(DType::BF16).unwrap();
    let vb = v.to_dtype(DType::BF16).unwrap();
    assert_eq!(kv.append_tensor(0, 1, &kb, &vb).unwrap(), 33);
    let mut wide = KvCache::new(ctx, &config(1, 64)).unwrap();
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    wide.append_tensor(0, 0, &f32s(&kb), &f32s(&vb)).unwrap();
    assert_eq!(
        kv.read_to_host(0, 1, 0, 33).unwrap(),
        wide.read_to_host(0, 0, 0, 33).unwrap()
    );
}
