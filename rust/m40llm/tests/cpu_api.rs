//! The whole safe API on the CPU backend (runs on any machine).

mod common;

use common::{check_attention_case, Rng, Shape};
use m40llm::{
    built_with_cuda, cuda_device_count, f16, library_version, Backend, Context, DeviceBuffer,
    DeviceSlice, Error, KvCache, KvCacheConfig, Status,
};

fn cpu() -> Context {
    Context::cpu().expect("CPU context")
}

fn assert_status<T: std::fmt::Debug>(r: m40llm::Result<T>, status: Status) -> Error {
    match r {
        Ok(v) => panic!("expected {status:?}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.status(), status, "wrong status: {e}");
            assert_eq!(e.code(), status.code());
            assert!(!e.message().is_empty(), "error without a message: {e:?}");
            e
        }
    }
}

#[test]
fn library_facts() {
    assert_eq!(library_version(), "0.1.0");
    let n = cuda_device_count().unwrap();
    if !built_with_cuda() {
        assert_eq!(n, 0);
    }
}

#[test]
fn thread_safety_markers() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Context>();
    send_sync::<Error>();
    send_sync::<KvCacheConfig>();
    send_sync::<Status>();
    // !Sync for Context and !Send for caches/buffers are checked by compile_fail doctests in
    // the crate docs.
}

#[test]
fn context_cpu() {
    let ctx = cpu();
    assert_eq!(ctx.backend(), Backend::Cpu);
    assert_eq!(ctx.device(), None);
    let info = ctx.device_info().unwrap();
    assert_eq!(info.backend, Backend::Cpu);
    assert_eq!(info.device, None);
    assert_eq!(info.name, "CPU");
    assert_eq!(info.compute_capability, None);
    assert_eq!(info.total_memory, 0);
    assert!(ctx.cuda_stream().is_null());
    ctx.synchronize().unwrap();
    assert!(format!("{info}").contains("CPU"));
    assert!(format!("{ctx:?}").contains("Cpu"));
}

#[test]
fn context_auto_and_cuda_requests() {
    let auto = Context::new(Backend::Auto).unwrap();
    assert_ne!(auto.backend(), Backend::Auto);
    if cuda_device_count().unwrap() == 0 {
        assert_eq!(auto.backend(), Backend::Cpu);
        assert_status(Context::cuda(0), Status::NoDevice);
    } else {
        assert_eq!(auto.backend(), Backend::Cuda);
        assert_status(Context::cuda(10_000), Status::OutOfRange);
    }
}

#[test]
fn context_stream_on_cpu_is_rejected() {
    let mut dummy = 0u8;
    // SAFETY: the library rejects a stream for the CPU backend before using it.
    let b = unsafe {
        Context::builder()
            .backend(Backend::Cpu)
            .cuda_stream((&mut dummy as *mut u8).cast())
    };
    assert_status(b.build(), Status::InvalidArgument);
}

#[test]
fn context_moves_to_another_thread() {
    let ctx = cpu();
    let h = std::thread::spawn(move || {
        let buf = DeviceBuffer::from_slice(&ctx, &[1.0f32, 2.0]).unwrap();
        buf.to_vec().unwrap()
    });
    assert_eq!(h.join().unwrap(), [1.0, 2.0]);
}

#[test]
fn status_and_error() {
    for s in [
        Status::InvalidArgument,
        Status::OutOfRange,
        Status::Capacity,
        Status::OutOfMemory,
        Status::NoDevice,
        Status::Cuda,
        Status::Unsupported,
    ] {
        assert_eq!(Status::from_code(s.code()), Some(s));
        assert!(!s.description().is_empty());
        assert!(s.code() < 0);
    }
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(-99), Some(Status::Unknown(-99)));
    let e = Error::new(Status::Capacity, "full");
    assert_eq!(e.to_string(), format!("{}: full", Status::Capacity));
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(e);
    assert!(boxed.to_string().ends_with("full"));
}

#[test]
fn buffers() {
    let ctx = cpu();
    let mut b = DeviceBuffer::<f32>::zeros(&ctx, 5).unwrap();
    assert_eq!(b.len(), 5);
    assert!(!b.is_empty());
    assert_eq!(b.size_in_bytes(), 20);
    assert_eq!(b.to_vec().unwrap(), [0.0; 5]);
    b.copy_from_host(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
    let mut host = [0.0f32; 5];
    b.copy_to_host(&mut host).unwrap();
    assert_eq!(host, [1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(
        b.as_ptr() as usize % 256,
        0,
        "allocations are 256-byte aligned"
    );

    // Wrong lengths are errors.
    assert_status(b.copy_from_host(&[1.0; 4]), Status::InvalidArgument);
    assert_status(b.copy_to_host(&mut [0.0; 6]), Status::InvalidArgument);

    // Slices.
    assert_eq!(b.slice(1..3).to_vec().unwrap(), [2.0, 3.0]);
    assert_eq!(b.slice(..=1).to_vec().unwrap(), [1.0, 2.0]);
    assert_eq!(b.slice(4..).len(), 1);
    assert!(b.slice(5..).is_empty());
    b.slice_mut(3..).copy_from_host(&[9.0, 8.0]).unwrap();
    b.slice_mut(..1).memset(0).unwrap();
    assert_eq!(b.to_vec().unwrap(), [0.0, 2.0, 3.0, 9.0, 8.0]);
    {
        let mut s = b.slice_mut(1..4);
        let mut inner = s.slice_mut(1..);
        inner.copy_from_host(&[7.0, 7.0]).unwrap();
        assert_eq!(s.slice(..).to_vec().unwrap(), [2.0, 7.0, 7.0]);
    }
    let sub: DeviceSlice<'_, f32> = b.slice(1..4);
    assert_eq!(sub.slice(2..).to_vec().unwrap(), [7.0]);

    // Device-to-device copies.
    let src = DeviceBuffer::from_slice(&ctx, &[4.0f32, 3.0]).unwrap();
    b.slice_mut(0..2).copy_from_device(&src).unwrap();
    assert_eq!(b.to_vec().unwrap(), [4.0, 3.0, 7.0, 7.0, 8.0]);
    assert_status(b.copy_from_device(&src), Status::InvalidArgument);
    let other = cpu();
    let foreign = DeviceBuffer::from_slice(&other, &[0.0f32; 5]).unwrap();
    assert_status(b.copy_from_device(&foreign), Status::InvalidArgument);

    // memset is per byte.
    let mut u = DeviceBuffer::<u16>::zeros(&ctx, 3).unwrap();
    u.memset(0xab).unwrap();
    assert_eq!(u.to_vec().unwrap(), [0xabab; 3]);

    // f16 buffers.
    let h = DeviceBuffer::from_slice(&ctx, &[f16::from_f32(1.5), f16::from_f32(-2.0)]).unwrap();
    assert_eq!(h.to_vec().unwrap()[1].to_f32(), -2.0);

    // Empty buffers need no allocation.
    let e = DeviceBuffer::<f32>::zeros(&ctx, 0).unwrap();
    assert!(e.is_empty());
    assert!(e.to_vec().unwrap().is_empty());
    assert!(format!("{e:?}").contains("f32"));
}

#[test]
#[should_panic(expected = "out of range")]
fn slice_out_of_bounds_panics() {
    let ctx = cpu();
    let b = DeviceBuffer::<f32>::zeros(&ctx, 2).unwrap();
    let _ = b.slice(1..3);
}

#[test]
fn config_and_planner() {
    let cfg = KvCacheConfig::new(2, 8, 64);
    assert_eq!(
        (cfg.n_kv_heads, cfg.max_seqs, cfg.max_seq_len),
        (8, 1, 2048)
    );
    let cfg = cfg.kv_heads(2).max_seqs(3).max_seq_len(100);
    assert_eq!(cfg.q_row_len(), 8 * 64);
    assert_eq!(cfg.kv_row_len(), 2 * 64);
    assert_eq!(cfg.bytes_needed().unwrap(), 2 * 3 * 2 * 100 * 64 * 2 * 2);

    let bad = [
        KvCacheConfig::new(0, 8, 64),
        KvCacheConfig::new(1, 8, 64).kv_heads(3),
        KvCacheConfig::new(1, 8, 0),
        KvCacheConfig::new(1, 8, 257),
        KvCacheConfig::new(1, 8, 64).max_seqs(0),
        KvCacheConfig::new(1, 8, 64).max_seq_len(0),
        KvCacheConfig::new(1, 8, 64).max_seq_len(usize::MAX),
    ];
    let ctx = cpu();
    for cfg in bad {
        assert_status(cfg.bytes_needed(), Status::InvalidArgument);
        assert_status(KvCache::new(&ctx, &cfg), Status::InvalidArgument);
    }
    // Too big for memory: the planner reports it without allocating.
    let huge = KvCacheConfig::new(1 << 20, 256, 256)
        .max_seqs(1 << 20)
        .max_seq_len(1 << 30);
    assert_status(huge.bytes_needed(), Status::OutOfMemory);
}

#[test]
fn sequence_operations() {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(2, 4, 8)
        .kv_heads(2)
        .max_seqs(3)
        .max_seq_len(10);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    assert_eq!(kv.config(), &cfg);
    assert!(std::ptr::eq(kv.context(), &ctx));
    let row = cfg.kv_row_len();
    let data: Vec<f32> = (0..6 * row).map(|i| i as f32 * 0.5).collect();
    let k = DeviceBuffer::from_slice(&ctx, &data).unwrap();
    let v = DeviceBuffer::from_slice(&ctx, &data.iter().map(|x| -x).collect::<Vec<_>>()).unwrap();

    // Many tokens, then one token (a slice), to layer 0 only.
    assert_eq!(
        kv.append(0, 1, &k.slice(..4 * row), &v.slice(..4 * row))
            .unwrap(),
        4
    );
    assert_eq!(
        kv.append(0, 1, &k.slice(4 * row..5 * row), &v.slice(4 * row..5 * row))
            .unwrap(),
        1
    );
    assert_eq!(kv.seq_len(0, 1).unwrap(), 5);
    assert_eq!(kv.seq_len(1, 1).unwrap(), 0);
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0);
    kv.append(1, 1, &k.slice(..2 * row), &v.slice(..2 * row))
        .unwrap();

    // Read back (device buffers and host helper); f32 input was rounded to f16.
    let (kh, vh) = kv.read_to_host(0, 1, 1, 3).unwrap();
    let want: Vec<f16> = data[row..4 * row]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    assert_eq!(kh, want);
    assert_eq!(vh, want.iter().map(|x| -*x).collect::<Vec<_>>());
    let mut kout = DeviceBuffer::<u16>::zeros(&ctx, 2 * row).unwrap();
    let mut vout = DeviceBuffer::<u16>::zeros(&ctx, 2 * row).unwrap();
    kv.read_f16(0, 1, 3, &mut kout, &mut vout).unwrap();
    assert_eq!(
        kout.to_vec().unwrap()[0],
        f16::from_f32(data[3 * row]).to_bits()
    );
    let mut konly = DeviceBuffer::<f16>::zeros(&ctx, row).unwrap();
    kv.read_k_f16(0, 1, 4, &mut konly).unwrap();
    assert_eq!(konly.to_vec().unwrap()[1], f16::from_f32(data[4 * row + 1]));
    let mut vonly = DeviceBuffer::<f16>::zeros(&ctx, row).unwrap();
    kv.read_v_f16(0, 1, 0, &mut vonly).unwrap();
    assert_eq!(vonly.to_vec().unwrap()[2], f16::from_f32(-data[2]));
    // Reading past the length, or a bad output size.
    assert_status(kv.read_to_host(0, 1, 3, 3), Status::OutOfRange);
    let mut odd = DeviceBuffer::<f16>::zeros(&ctx, row + 1).unwrap();
    assert_status(kv.read_k_f16(0, 1, 0, &mut odd), Status::InvalidArgument);
    let mut short = DeviceBuffer::<u16>::zeros(&ctx, row).unwrap();
    assert_status(
        kv.read_f16(0, 1, 0, &mut kout, &mut short),
        Status::InvalidArgument,
    );

    // Fork copies contents and lengths in every layer.
    kv.fork(2, 1).unwrap();
    assert_eq!(kv.seq_len(0, 2).unwrap(), 5);
    assert_eq!(kv.seq_len(1, 2).unwrap(), 2);
    assert_eq!(
        kv.read_to_host(0, 2, 0, 5).unwrap(),
        kv.read_to_host(0, 1, 0, 5).unwrap()
    );
    assert_status(kv.fork(1, 1), Status::InvalidArgument);
    assert_status(kv.fork(3, 1), Status::OutOfRange);

    // Truncate: layers already shorter keep their length.
    kv.truncate(2, 3).unwrap();
    assert_eq!(
        (kv.seq_len(0, 2).unwrap(), kv.seq_len(1, 2).unwrap()),
        (3, 2)
    );
    kv.truncate(2, 100).unwrap();
    assert_eq!(kv.seq_len(0, 2).unwrap(), 3);
    kv.reset(2).unwrap();
    assert_eq!(
        (kv.seq_len(0, 2).unwrap(), kv.seq_len(1, 2).unwrap()),
        (0, 0)
    );
    assert_eq!(
        kv.seq_len(0, 1).unwrap(),
        5,
        "reset touched another sequence"
    );

    // Capacity: nothing is written and the length stays.
    assert_status(kv.append(0, 1, &k, &v), Status::Capacity);
    assert_eq!(kv.seq_len(0, 1).unwrap(), 5);
    kv.append(0, 1, &k.slice(..5 * row), &v.slice(..5 * row))
        .unwrap();
    assert_eq!(kv.seq_len(0, 1).unwrap(), 10);

    // Indices and sizes.
    assert_status(kv.seq_len(2, 0), Status::OutOfRange);
    assert_status(kv.seq_len(0, 3), Status::OutOfRange);
    assert_status(kv.reset(3), Status::OutOfRange);
    assert_status(
        kv.append(0, 0, &k.slice(..row), &v.slice(..2 * row)),
        Status::InvalidArgument,
    );
    assert_status(
        kv.append(0, 0, &k.slice(..row - 1), &v.slice(..row - 1)),
        Status::InvalidArgument,
    );
    assert_status(
        kv.append(0, 0, &k.slice(..0), &v.slice(..0)),
        Status::InvalidArgument,
    );
    let other = cpu();
    let foreign = DeviceBuffer::from_slice(&other, &data[..row]).unwrap();
    assert_status(
        kv.append(0, 0, &foreign, &k.slice(..row)),
        Status::InvalidArgument,
    );
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0);
    assert!(format!("{kv:?}").contains("KvCache"));
}

#[test]
fn append_f16_and_u16_inputs() {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(1, 2, 4).max_seqs(1).max_seq_len(4);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let vals: Vec<f16> = (0..cfg.kv_row_len())
        .map(|i| f16::from_f32(i as f32 / 3.0))
        .collect();
    let kb = DeviceBuffer::from_slice(&ctx, &vals).unwrap();
    kv.append(0, 0, &kb, &kb).unwrap();
    let bits: Vec<u16> = vals.iter().map(|x| x.to_bits()).collect();
    let ub = DeviceBuffer::from_slice(&ctx, &bits).unwrap();
    kv.append(0, 0, &ub, &ub).unwrap();
    let (k, v) = kv.read_to_host(0, 0, 0, 2).unwrap();
    assert_eq!(&k[..vals.len()], &vals[..]);
    assert_eq!(&k[vals.len()..], &vals[..]);
    assert_eq!(k, v);
}

#[test]
fn attention_arguments() {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(1, 4, 8)
        .kv_heads(2)
        .max_seqs(2)
        .max_seq_len(8);
    let kv = KvCache::new(&ctx, &cfg).unwrap();
    let q = DeviceBuffer::from_slice(&ctx, &vec![1.0f32; 2 * cfg.q_row_len()]).unwrap();
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * cfg.q_row_len()).unwrap();
    let n = cfg.q_row_len();

    // Empty sequences yield zeros.
    out.memset(0xff).unwrap();
    kv.attention(0, 0, &q.slice(..n), &mut out.slice_mut(..n), None)
        .unwrap();
    assert!(out.slice(..n).to_vec().unwrap().iter().all(|&x| x == 0.0));
    kv.attention_batch(0, &[1, 0], &q, &mut out, Some(0.5))
        .unwrap();
    assert!(out.to_vec().unwrap().iter().all(|&x| x == 0.0));

    // Sizes, indices, scale.
    assert_status(
        kv.attention(0, 0, &q, &mut out.slice_mut(..n), None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention(0, 0, &q.slice(..n), &mut out, None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention(1, 0, &q.slice(..n), &mut out.slice_mut(..n), None),
        Status::OutOfRange,
    );
    assert_status(
        kv.attention(0, 2, &q.slice(..n), &mut out.slice_mut(..n), None),
        Status::OutOfRange,
    );
    assert_status(
        kv.attention_batch(0, &[0], &q, &mut out, None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_batch(0, &[], &q.slice(..0), &mut out.slice_mut(..0), None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_batch(0, &[0, 2], &q, &mut out, None),
        Status::OutOfRange,
    );
    for bad in [0.0, f32::NAN, f32::INFINITY] {
        assert_status(
            kv.attention(0, 0, &q.slice(..n), &mut out.slice_mut(..n), Some(bad)),
            Status::InvalidArgument,
        );
    }
    let other = cpu();
    let foreign = DeviceBuffer::<f32>::zeros(&other, n).unwrap();
    assert_status(
        kv.attention(0, 0, &foreign, &mut out.slice_mut(..n), None),
        Status::InvalidArgument,
    );

    // Overlapping q and out (only constructible unsafely) are rejected before the call.
    let mut alias = DeviceBuffer::<f32>::zeros(&ctx, n + 4).unwrap();
    let p = alias.as_mut_ptr();
    // SAFETY: the views are only used to check that the overlap is rejected.
    let (qv, mut ov) = unsafe {
        (
            DeviceSlice::from_raw_parts(&ctx, p as *const f32, n),
            m40llm::DeviceSliceMut::from_raw_parts(&ctx, p.add(4), n),
        )
    };
    assert_eq!(qv.len(), n);
    assert_status(
        kv.attention(0, 0, &qv, &mut ov, None),
        Status::InvalidArgument,
    );
}

#[test]
fn attention_matches_reference_on_cpu() {
    let ctx = cpu();
    let mut rng = Rng::fresh("attention_matches_reference_on_cpu");
    for head_dim in [64, 128] {
        for (n_heads, n_kv_heads) in [(4, 4), (8, 2)] {
            let s = Shape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            for len in [1, 31, 33, 257] {
                check_attention_case(&ctx, &mut rng, s, &[len], false, None);
            }
            // Batched, ragged, with an empty sequence; FP16 input; explicit scale.
            check_attention_case(&ctx, &mut rng, s, &[5, 0, 31, 33, 1, 64], true, Some(0.07));
        }
    }
    // A long one, once (the CPU backend is the slow path).
    let s = Shape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let e = check_attention_case(&ctx, &mut rng, s, &[4099, 17], false, None);
    println!("worst rel L2 at 4099: {e:e}");
}
