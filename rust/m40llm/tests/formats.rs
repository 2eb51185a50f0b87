//! Quantized K/V formats through the safe API on the CPU backend: sizes, and attention over
//! what the cache stores (read back as FP16) against the float64 reference.

mod common;

use common::{reference_attention, rel_l2, Rng, Shape};
use m40llm::{f16, Context, DeviceBuffer, KvCache, KvCacheConfig, KvFormat, Status};

fn config(format: KvFormat, v_format: Option<KvFormat>) -> KvCacheConfig {
    let mut c = KvCacheConfig::new(1, 8, 64)
        .kv_heads(2)
        .max_seqs(1)
        .max_seq_len(300);
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
