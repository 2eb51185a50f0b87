//! The whole safe API on the CPU backend (runs on any machine).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    check_attention_case, check_causal_case, parse_archs, reference_attention, rel_l2, to_f16, Rng,
    Shape, TOL,
};
use m40llm::{
    build_info, built_with_cuda, cuda_device_count, f16, library_version, Backend, Context,
    DeviceBuffer, DeviceSlice, DeviceSliceMut, Error, Graph, KvCache, KvCacheConfig, KvFormat,
    KvTier, Status, TierPlacement,
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
fn build_info_is_consistent() {
    let b = build_info().unwrap();
    println!("build: {b}");
    assert_eq!(b.cuda, built_with_cuda());
    assert_eq!(build_info().unwrap(), b);
    if !b.cuda {
        assert_eq!(b.cuda_architectures, "");
        assert_eq!(b.cuda_toolkit, None);
        assert!(!b.tensor_cores);
        assert!(b.to_string().contains("without CUDA"));
        return;
    }
    let archs = parse_archs(b.cuda_architectures)
        .unwrap_or_else(|| panic!("{:?}: not NN-real/NN-virtual", b.cuda_architectures));
    // Sorted by architecture, SASS before PTX, without duplicates: the form CMake's build and
    // m40llm-sys's build script both write.
    let key = |&(n, real): &(u32, bool)| (n, !real);
    assert!(
        archs.windows(2).all(|w| key(&w[0]) < key(&w[1])),
        "{:?} is not sorted",
        b.cuda_architectures
    );
    let (major, minor) = b.cuda_toolkit.expect("toolkit version");
    assert!((major, minor) >= (11, 8), "CUDA {major}.{minor}");
    let newest = archs.iter().map(|a| a.0).max().unwrap();
    // m40llm-sys builds the tensor-core kernels whenever an sm_80+ architecture is listed.
    assert_eq!(b.tensor_cores, newest >= 80);
    assert!(b.to_string().contains(b.cuda_architectures));
}

#[test]
fn thread_safety_markers() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Context>();
    send_sync::<KvCache>();
    send_sync::<DeviceBuffer<f32>>();
    send_sync::<DeviceBuffer<f16>>();
    send_sync::<DeviceSlice<'static, f32>>();
    send_sync::<DeviceSliceMut<'static, u16>>();
    send_sync::<Error>();
    send_sync::<KvCacheConfig>();
    send_sync::<Status>();
    send_sync::<Graph>();
    // What must not compile is checked by compile_fail doctests in the crate docs.
}

#[test]
fn graphs_need_the_cuda_backend() {
    let ctx = cpu();
    let mut ran = false;
    let e = assert_status(
        Graph::capture(&ctx, || {
            ran = true;
            Ok(())
        }),
        Status::Unsupported,
    );
    assert!(e.message().contains("CUDA backend"), "{e}");
    assert!(!ran, "the closure ran although no capture began");
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
    assert_eq!(info.kernel_arch, None);
    assert!(!info.native_code && !info.tensor_cores);
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
        Status::ContextLost,
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
fn capacity_planner() {
    // Every format: the answer fits the budget and one position more does not.
    let llama = KvCacheConfig::new(32, 32, 128).kv_heads(8);
    let formats = [
        (KvFormat::F16, None),
        (KvFormat::Q8, None),
        (KvFormat::Q4, None),
        (KvFormat::Q8, Some(KvFormat::Q4)),
    ];
    let budget = 7 << 30;
    let mut previous = 0;
    for (format, v_format) in formats {
        let mut cfg = llama.format(format).max_seqs(8).max_seq_len(usize::MAX);
        if let Some(v) = v_format {
            cfg = cfg.v_format(v);
        }
        let len = cfg.max_seq_len_for_budget(budget).unwrap();
        assert!(cfg.max_seq_len(len).bytes_needed().unwrap() <= budget);
        assert!(cfg.max_seq_len(len + 1).bytes_needed().unwrap() > budget);
        assert!(
            len != previous,
            "{format:?}/{v_format:?} plans as the previous format"
        );
        previous = len;
    }
    // F16: 128 KiB a position, so 7 GiB hold exactly 57344.
    assert_eq!(llama.max_seq_len_for_budget(budget).unwrap(), 57344);
    assert_eq!(llama.max_seq_len_for_budget(131072).unwrap(), 1);
    // Past i32::MAX positions: the answer stops there.
    let tiny = KvCacheConfig::new(1, 1, 1);
    assert_eq!(
        tiny.max_seq_len_for_budget(usize::MAX).unwrap(),
        i32::MAX as usize
    );
    // Not one position, and configs bytes_needed refuses.
    let e = assert_status(llama.max_seq_len_for_budget(131071), Status::Capacity);
    assert!(e.message().contains("one position"), "{e}");
    assert_status(
        KvCacheConfig::new(0, 8, 64).max_seq_len_for_budget(budget),
        Status::InvalidArgument,
    );
    assert_status(
        llama
            .format(KvFormat::Q4)
            .kv_heads(3)
            .max_seq_len_for_budget(budget),
        Status::InvalidArgument,
    );
    assert_status(
        KvCacheConfig::new(1, 8, 48)
            .format(KvFormat::Q8)
            .max_seq_len_for_budget(budget),
        Status::Unsupported,
    );
    // The CPU backend has no device memory to plan against.
    let e = assert_status(
        llama.max_seq_len_on_device(&cpu(), KvCacheConfig::DEVICE_RESERVE_DEFAULT),
        Status::Unsupported,
    );
    assert!(e.message().contains("m40llm_kvcache_max_seq_len"), "{e}");
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
    assert_eq!(kv.context(), &ctx);
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

#[test]
fn causal_attention_on_cpu() {
    let ctx = cpu();
    let mut rng = Rng::fresh("causal_attention_on_cpu");
    for (n_heads, n_kv_heads, head_dim) in [(4, 4, 64), (8, 2, 80), (8, 1, 128)] {
        let s = Shape {
            n_heads,
            n_kv_heads,
            head_dim,
        };
        // Prefill (P = 0), speculative rows on a prefix, a single row, ragged.
        check_causal_case(&ctx, &mut rng, s, &[0, 40, 7, 100], &[33, 4, 1, 16], None);
        check_causal_case(&ctx, &mut rng, s, &[0, 40], &[20, 9], Some(5));
    }
}

#[test]
fn half_and_bf16_q_out_on_cpu() {
    let ctx = cpu();
    let mut rng = Rng::fresh("half_and_bf16_q_out_on_cpu");
    for cfg in [
        KvCacheConfig::new(1, 8, 64)
            .kv_heads(2)
            .max_seqs(4)
            .max_seq_len(300),
        KvCacheConfig::new(1, 6, 64)
            .kv_heads(2)
            .max_seqs(4)
            .max_seq_len(300)
            .format(KvFormat::Q8)
            .v_format(KvFormat::Q4)
            .window(16),
    ] {
        common::check_half_io::<f16>(&ctx, &mut rng, &cfg);
        common::check_half_io::<m40llm::bf16>(&ctx, &mut rng, &cfg);
    }
}

#[test]
fn causal_attention_arguments() {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(1, 2, 8).max_seqs(2).max_seq_len(8);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let kvrow = DeviceBuffer::from_slice(&ctx, &[0.25f32; 3 * 16]).unwrap();
    kv.append(0, 0, &kvrow, &kvrow).unwrap();
    let q = DeviceBuffer::from_slice(&ctx, &[0.5f32; 3 * 16]).unwrap();
    let mut out = DeviceBuffer::from_slice(&ctx, &[7.0f32; 3 * 16]).unwrap();
    // More rows than the sequence holds, an empty sequence, counts of another length, a
    // window of Some(0), rows that do not match q: refused, nothing written.
    let q4 = DeviceBuffer::from_slice(&ctx, &[0.5f32; 4 * 16]).unwrap();
    let mut out4 = DeviceBuffer::from_slice(&ctx, &[7.0f32; 4 * 16]).unwrap();
    let e = assert_status(
        kv.attention_causal(0, &[0], &[4], &q4, &mut out4, None, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("q_counts[0]"), "{e}");
    assert_eq!(out4.to_vec().unwrap(), [7.0f32; 64]);
    assert_status(
        kv.attention_causal(0, &[1], &[3], &q, &mut out, None, None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_causal(0, &[0], &[1, 2], &q, &mut out, None, None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_causal(0, &[0], &[3], &q, &mut out, None, Some(0)),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_causal(0, &[0], &[2], &q, &mut out, None, None),
        Status::InvalidArgument,
    );
    assert_status(
        kv.attention_causal(1, &[0], &[3], &q, &mut out, None, None),
        Status::OutOfRange,
    );
    assert_eq!(out.to_vec().unwrap(), [7.0f32; 48]);
    // Every K the same: each row is the mean of the V rows it sees, here all 0.25.
    kv.attention_causal(0, &[0], &[3], &q, &mut out, None, Some(2))
        .unwrap();
    assert_eq!(out.to_vec().unwrap(), [0.25f32; 48]);
}

#[test]
fn context_handles() {
    let ctx = cpu();
    let other = ctx.clone();
    assert_eq!(ctx, other);
    assert_eq!(ctx.as_raw(), other.as_raw());
    assert_ne!(ctx, cpu());
    // Caches and buffers keep the context alive, whatever the drop order.
    let cfg = KvCacheConfig::new(1, 2, 4).max_seq_len(8);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let k = DeviceBuffer::from_slice(&ctx, &[1.0f32; 8]).unwrap();
    drop(ctx);
    drop(other);
    kv.append_token(0, 0, &k, &k).unwrap();
    drop(k);
    assert_eq!(kv.seq_len(0, 0).unwrap(), 1);
    let q = DeviceBuffer::from_slice(kv.context(), &[1.0f32; 8]).unwrap();
    let mut out = DeviceBuffer::<f32>::zeros(kv.context(), 8).unwrap();
    kv.attention(0, 0, &q, &mut out, None).unwrap();
    drop(kv);
    assert_eq!(out.to_vec().unwrap(), [1.0; 8]); // the buffer outlives the cache
}

/// What an application holds: a context, a cache and its working buffers, no lifetimes.
struct Model {
    ctx: Context,
    kv: KvCache,
    q: DeviceBuffer<f32>,
    out: DeviceBuffer<f32>,
}

#[test]
fn cache_and_context_move_to_another_thread() {
    let mut rng = Rng::fresh("cache_and_context_move_to_another_thread");
    let s = Shape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 16,
    };
    let cfg = KvCacheConfig::new(2, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seq_len(64);
    let row = cfg.kv_row_len();
    let ctx = cpu();
    let mut model = Model {
        kv: KvCache::new(&ctx, &cfg).unwrap(),
        q: DeviceBuffer::zeros(&ctx, cfg.q_row_len()).unwrap(),
        out: DeviceBuffer::zeros(&ctx, cfg.q_row_len()).unwrap(),
        ctx,
    };
    // Prefill here, decode on a worker thread, then use the model here again.
    let (k0, v0) = (rng.normal_vec(5 * row, 1.0), rng.normal_vec(5 * row, 1.0));
    let kb = DeviceBuffer::from_slice(&model.ctx, &k0).unwrap();
    let vb = DeviceBuffer::from_slice(&model.ctx, &v0).unwrap();
    model.kv.append_tokens(1, 0, 5, &kb, &vb).unwrap();
    let (k1, v1) = (rng.normal_vec(3 * row, 1.0), rng.normal_vec(3 * row, 1.0));
    let q = rng.normal_vec(cfg.q_row_len(), 1.0);
    let (k1c, v1c, qc) = (k1.clone(), v1.clone(), q.clone());
    let worker = std::thread::spawn(move || {
        let mut m = model;
        for t in 0..3 {
            let k = DeviceBuffer::from_slice(&m.ctx, &k1c[t * row..(t + 1) * row]).unwrap();
            let v = DeviceBuffer::from_slice(&m.ctx, &v1c[t * row..(t + 1) * row]).unwrap();
            m.kv.append_token(1, 0, &k, &v).unwrap();
        }
        m.q.copy_from_host(&qc).unwrap();
        m.kv.attention(1, 0, &m.q, &mut m.out, None).unwrap();
        let got = m.out.to_vec().unwrap();
        (m, got)
    });
    let (model, got) = worker.join().unwrap();
    drop((kb, vb)); // buffers made here, dropped here after the cache moved and came back
    let k: Vec<f32> = k0.iter().chain(&k1).copied().collect();
    let v: Vec<f32> = v0.iter().chain(&v1).copied().collect();
    let want = reference_attention(
        s,
        &to_f16(&k),
        &to_f16(&v),
        &q,
        common::default_scale(s.head_dim),
    );
    let e = rel_l2(&got, &want);
    assert!(e <= TOL, "rel L2 {e:e}");
    assert_eq!(model.kv.seq_len(1, 0).unwrap(), 8);
    assert_eq!(model.kv.read_to_host(1, 0, 0, 8).unwrap().0, to_f16(&k));
}

#[test]
fn threads_share_one_context_through_clones() {
    let ctx = cpu();
    let s = Shape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 32,
    };
    // Each thread makes its own cache and buffers on the shared context and calls concurrently;
    // the context's lock serializes the calls.
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                let mut rng = Rng::fresh(&format!("threads_share_one_context[{t}]"));
                check_attention_case(&ctx, &mut rng, s, &[40, 3, 17], t % 2 == 1, None)
            })
        })
        .collect();
    for w in workers {
        assert!(w.join().unwrap() <= TOL);
    }

    // One cache shared by threads: attention takes &self (KvCache is Sync), appends go
    // through a Mutex.
    let cfg = KvCacheConfig::new(1, s.n_heads, s.head_dim)
        .kv_heads(s.n_kv_heads)
        .max_seqs(2)
        .max_seq_len(32);
    let kv = Arc::new(Mutex::new(KvCache::new(&ctx, &cfg).unwrap()));
    let mut rng = Rng::fresh("threads_share_one_cache");
    let k = rng.normal_vec(20 * cfg.kv_row_len(), 1.0);
    let writers: Vec<_> = (0..2)
        .map(|seq| {
            let (kv, ctx, k) = (kv.clone(), ctx.clone(), k.clone());
            std::thread::spawn(move || {
                let kb = DeviceBuffer::from_slice(&ctx, &k).unwrap();
                kv.lock()
                    .unwrap()
                    .append_tokens(0, seq, 20, &kb, &kb)
                    .unwrap();
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let kv = Arc::new(Arc::try_unwrap(kv).unwrap().into_inner().unwrap());
    let q = rng.normal_vec(cfg.q_row_len(), 1.0);
    let want = reference_attention(
        s,
        &to_f16(&k),
        &to_f16(&k),
        &q,
        common::default_scale(s.head_dim),
    );
    let readers: Vec<_> = (0..4)
        .map(|t| {
            let (kv, q, want) = (kv.clone(), q.clone(), want.clone());
            std::thread::spawn(move || {
                let ctx = kv.context();
                let qb = DeviceBuffer::from_slice(ctx, &q).unwrap();
                let mut out = DeviceBuffer::<f32>::zeros(ctx, q.len()).unwrap();
                kv.attention(0, t % 2, &qb, &mut out, None).unwrap();
                rel_l2(&out.to_vec().unwrap(), &want)
            })
        })
        .collect();
    for r in readers {
        assert!(r.join().unwrap() <= TOL);
    }
}

#[test]
fn calls_on_one_context_wait_for_its_lock() {
    let ctx = cpu();
    let kv = KvCache::new(&ctx, &KvCacheConfig::new(1, 1, 8)).unwrap();
    let other_ctx = cpu();
    let (held, released) = (mpsc::channel(), Arc::new(AtomicBool::new(false)));
    let holder = {
        let (ctx, tx, released) = (ctx.clone(), held.0, released.clone());
        std::thread::spawn(move || {
            ctx.with_raw(|raw| {
                assert!(!raw.is_null());
                tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
                released.store(true, Ordering::SeqCst);
            })
        })
    };
    held.1.recv().unwrap(); // the other thread holds the context's lock now
                            // Another context does not wait.
    other_ctx.synchronize().unwrap();
    assert!(!released.load(Ordering::SeqCst), "another context waited");
    // A call through a cache of the locked context waits until the lock is released.
    let t0 = Instant::now();
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0);
    assert!(
        released.load(Ordering::SeqCst),
        "a call ran while the lock was held"
    );
    assert!(t0.elapsed() >= Duration::from_millis(100));
    holder.join().unwrap();
}

#[test]
fn append_checks_the_row_length() {
    let ctx = cpu();
    // GQA: 8 query heads share 2 K/V heads; one token of K is 2 x 4 = 8 values, a query row 32.
    let cfg = KvCacheConfig::new(1, 8, 4)
        .kv_heads(2)
        .max_seqs(1)
        .max_seq_len(12);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let data: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let buf = |n: usize| DeviceBuffer::from_slice(&ctx, &data[..n]).unwrap();

    // append: a length that is not a whole number of K/V rows.
    let e = assert_status(kv.append(0, 0, &buf(12), &buf(12)), Status::InvalidArgument);
    assert!(
        e.message().contains("n_kv_heads × head_dim = 2 × 4 = 8") && e.message().contains("12"),
        "{e}"
    );
    assert_status(kv.append(0, 0, &buf(0), &buf(0)), Status::InvalidArgument);
    assert_status(kv.append(0, 0, &buf(8), &buf(16)), Status::InvalidArgument);

    // append_token: exactly one row; a query-shaped row (the GQA mix-up) is named as such.
    let e = assert_status(
        kv.append_token(0, 0, &buf(32), &buf(32)),
        Status::InvalidArgument,
    );
    let m = e.message();
    assert!(m.contains("n_kv_heads × head_dim"), "{e}");
    assert!(m.contains("1 × 2 × 4 = 8"), "{e}");
    assert!(m.contains("32") && m.contains("n_heads = 8"), "{e}");
    let e = assert_status(
        kv.append_token(0, 0, &buf(16), &buf(16)),
        Status::InvalidArgument,
    );
    assert!(!e.message().contains("n_heads ="), "not the GQA case: {e}");
    let e = assert_status(
        kv.append_token(0, 0, &buf(8), &buf(7)),
        Status::InvalidArgument,
    );
    assert!(e.message().starts_with("v has 7 elements"), "{e}");

    // append_tokens: exactly n_tokens rows.
    let e = assert_status(
        kv.append_tokens(0, 0, 3, &buf(16), &buf(16)),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("3 × 2 × 4 = 24"), "{e}");
    let e = assert_status(
        kv.append_tokens(0, 0, 2, &buf(64), &buf(64)),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("n_heads = 8"), "GQA hint: {e}");
    assert_status(
        kv.append_tokens(0, 0, 0, &buf(0), &buf(0)),
        Status::InvalidArgument,
    );
    assert_status(
        kv.append_tokens(0, 0, usize::MAX, &buf(8), &buf(8)),
        Status::InvalidArgument,
    );
    assert_eq!(kv.seq_len(0, 0).unwrap(), 0, "a rejected append wrote");

    // The right lengths work, and indices and capacity are still checked.
    kv.append_token(0, 0, &buf(8), &buf(8)).unwrap();
    kv.append_tokens(0, 0, 3, &buf(24), &buf(24)).unwrap();
    assert_eq!(kv.append(0, 0, &buf(16), &buf(16)).unwrap(), 2);
    assert_eq!(kv.seq_len(0, 0).unwrap(), 6);
    let (k, _) = kv.read_to_host(0, 0, 0, 6).unwrap();
    let want: Vec<f32> = data[..8]
        .iter()
        .chain(&data[..24])
        .chain(&data[..16])
        .copied()
        .collect();
    assert_eq!(k, to_f16(&want));
    assert_status(kv.append_token(1, 0, &buf(8), &buf(8)), Status::OutOfRange);
    assert_status(kv.append_token(0, 1, &buf(8), &buf(8)), Status::OutOfRange);
    assert_status(
        kv.append_tokens(0, 0, 8, &buf(64), &buf(64)),
        Status::Capacity,
    );
    let other = cpu();
    let foreign = DeviceBuffer::from_slice(&other, &data[..8]).unwrap();
    assert_status(
        kv.append_token(0, 0, &foreign, &buf(8)),
        Status::InvalidArgument,
    );
    // f16 input takes the same checks.
    let h = DeviceBuffer::from_slice(&ctx, &to_f16(&data[..32])).unwrap();
    assert_status(kv.append_token(0, 0, &h, &h), Status::InvalidArgument);
    kv.append_token(0, 0, &h.slice(..8), &h.slice(..8)).unwrap();
    assert_eq!(kv.seq_len(0, 0).unwrap(), 7);
}

#[test]
fn append_batch_matches_single_appends() {
    let ctx = cpu();
    let mut rng = Rng::fresh("append_batch_matches_single_appends");
    let base = KvCacheConfig::new(2, 6, 32)
        .kv_heads(2)
        .max_seqs(7)
        .max_seq_len(400);
    for cfg in [
        base,
        base.format(KvFormat::Q8).sinks(2).window(9),
        base.format(KvFormat::F16).v_format(KvFormat::Q4),
    ] {
        common::check_append_batch(&ctx, &mut rng, &cfg);
    }
}

#[test]
fn append_batch_checks_everything_first() {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(1, 4, 8)
        .kv_heads(2)
        .max_seqs(3)
        .max_seq_len(4);
    let row = cfg.kv_row_len();
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let k = DeviceBuffer::from_slice(&ctx, &vec![0.25f32; 5 * row]).unwrap();
    kv.append_tokens(0, 1, 3, &k.slice(..3 * row), &k.slice(..3 * row))
        .unwrap();
    let before = kv.read_to_host(0, 1, 0, 3).unwrap();
    let unchanged = |kv: &KvCache| {
        assert_eq!(
            (0..3)
                .map(|s| kv.seq_len(0, s).unwrap())
                .collect::<Vec<_>>(),
            [0, 3, 0]
        );
        assert!(kv.read_to_host(0, 1, 0, 3).unwrap() == before);
    };
    // Rows must match the counts exactly; a query-shaped row is named as such.
    let e = assert_status(
        kv.append_batch(0, &[0, 2], &[1, 1], &k, &k),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("n_kv_heads × head_dim"), "{e}");
    let q_rows = DeviceBuffer::from_slice(&ctx, &vec![0.0f32; 2 * cfg.q_row_len()]).unwrap();
    let e = assert_status(
        kv.append_token_batch(0, &[0, 2], &q_rows, &q_rows),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("not n_heads"), "{e}");
    let two = k.slice(..2 * row);
    assert_status(
        kv.append_batch(0, &[0, 2], &[1], &two, &two),
        Status::InvalidArgument,
    );
    assert_status(
        kv.append_batch(0, &[], &[], &two, &two),
        Status::InvalidArgument,
    );
    assert_status(
        kv.append_token_batch(1, &[0, 2], &two, &two),
        Status::OutOfRange,
    );
    assert_status(
        kv.append_token_batch(0, &[0, 3], &two, &two),
        Status::OutOfRange,
    );
    // A repeated sequence, or one that would pass max_seq_len, fails the whole batch.
    let e = assert_status(
        kv.append_token_batch(0, &[0, 0], &two, &two),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("repeats"), "{e}");
    let e = assert_status(
        kv.append_batch(
            0,
            &[0, 1],
            &[1, 2],
            &k.slice(..3 * row),
            &k.slice(..3 * row),
        ),
        Status::Capacity,
    );
    assert!(e.message().contains("seq 1"), "{e}");
    unchanged(&kv);
    // Counts of 0 append nothing, with empty buffers.
    let none = DeviceBuffer::<f32>::zeros(&ctx, 0).unwrap();
    kv.append_batch(0, &[2, 0], &[0, 0], &none, &none).unwrap();
    unchanged(&kv);
    kv.append_batch(0, &[2, 1, 0], &[4, 1, 0], &k, &k).unwrap();
    assert_eq!(
        (0..3)
            .map(|s| kv.seq_len(0, s).unwrap())
            .collect::<Vec<_>>(),
        [0, 4, 4]
    );
}

#[test]
fn append_attention_batch_matches_the_two_calls() {
    let ctx = cpu();
    let mut rng = Rng::fresh("append_attention_batch_matches_the_two_calls");
    for cfg in [
        KvCacheConfig::new(1, 8, 32)
            .kv_heads(2)
            .max_seqs(4)
            .max_seq_len(64),
        KvCacheConfig::new(1, 4, 64)
            .kv_heads(1)
            .max_seqs(4)
            .max_seq_len(64)
            .format(KvFormat::Q8)
            .window(3),
    ] {
        let mut a = KvCache::new(&ctx, &cfg).unwrap();
        let mut b = KvCache::new(&ctx, &cfg).unwrap();
        let (row, qrow) = (cfg.kv_row_len(), cfg.q_row_len());
        for step in 0..8 {
            let ids: Vec<usize> = if step % 2 == 0 {
                vec![2, 0, 3]
            } else {
                vec![1, 2]
            };
            let n = ids.len();
            let k = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(n * row, 1.0)).unwrap();
            let v = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(n * row, 1.0)).unwrap();
            let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(n * qrow, 1.0)).unwrap();
            let mut oa = DeviceBuffer::<f32>::zeros(&ctx, n * qrow).unwrap();
            let mut ob = DeviceBuffer::<f32>::zeros(&ctx, n * qrow).unwrap();
            a.append_attention_batch(0, &ids, &k, &v, &q, &mut oa, None)
                .unwrap();
            b.append_token_batch(0, &ids, &k, &v).unwrap();
            b.attention_batch(0, &ids, &q, &mut ob, None).unwrap();
            assert!(oa.to_vec().unwrap() == ob.to_vec().unwrap(), "step {step}");
        }
        // Checked before anything is written: a repeated id, or a wrong-sized out.
        let k = DeviceBuffer::from_slice(&ctx, &vec![0.0f32; 2 * row]).unwrap();
        let q = DeviceBuffer::from_slice(&ctx, &vec![0.0f32; 2 * qrow]).unwrap();
        let mut out = DeviceBuffer::from_slice(&ctx, &vec![7.0f32; 2 * qrow]).unwrap();
        let e = assert_status(
            a.append_attention_batch(0, &[1, 1], &k, &k, &q, &mut out, None),
            Status::InvalidArgument,
        );
        assert!(e.message().contains("repeats"), "{e}");
        let mut short = DeviceBuffer::from_slice(&ctx, &vec![7.0f32; qrow]).unwrap();
        assert_status(
            a.append_attention_batch(0, &[1, 0], &k, &k, &q, &mut short, None),
            Status::InvalidArgument,
        );
        assert_eq!(
            (0..4).map(|s| a.seq_len(0, s).unwrap()).collect::<Vec<_>>(),
            [4, 4, 8, 4]
        );
        assert!(out.to_vec().unwrap().iter().all(|&x| x == 7.0));
    }
}

/// A CPU cache of 4/2 heads, head_dim 32, with random sequences of 5 and 9 positions, random q
/// for two rows and an output buffer: the weights and importance tests' setup.
fn weights_cache(
    test: &str,
) -> (
    Context,
    KvCacheConfig,
    KvCache,
    DeviceBuffer<f32>,
    DeviceBuffer<f32>,
) {
    let ctx = cpu();
    let cfg = KvCacheConfig::new(1, 4, 32)
        .kv_heads(2)
        .max_seqs(2)
        .max_seq_len(16);
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    let mut rng = Rng::fresh(test);
    for (seq, len) in [(0, 5), (1, 9)] {
        let k =
            DeviceBuffer::from_slice(&ctx, &rng.normal_vec(len * cfg.kv_row_len(), 1.0)).unwrap();
        let v =
            DeviceBuffer::from_slice(&ctx, &rng.normal_vec(len * cfg.kv_row_len(), 1.0)).unwrap();
        kv.append_tokens(0, seq, len, &k, &v).unwrap();
    }
    let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(2 * cfg.q_row_len(), 1.0)).unwrap();
    let out = DeviceBuffer::<f32>::zeros(&ctx, 2 * cfg.q_row_len()).unwrap();
    (ctx, cfg, kv, q, out)
}

#[test]
fn attention_weights_and_their_errors() {
    let (ctx, cfg, kv, q, mut out) = weights_cache("attention_weights_and_their_errors");
    let mut w = DeviceBuffer::from_slice(&ctx, &[-1.0f32; 2 * 4 * 9]).unwrap();
    kv.attention_weights(0, &[1, 0], &q, &mut out, &mut w, 9, None)
        .unwrap();
    let got = w.to_vec().unwrap();
    for (row, len) in [(0, 9), (1, 5)] {
        for h in 0..4 {
            let r = &got[(row * 4 + h) * 9..(row * 4 + h + 1) * 9];
            let sum: f32 = r[..len].iter().sum();
            assert!(
                (sum - 1.0).abs() < 1e-5 && r[..len].iter().all(|&x| x > 0.0),
                "{r:?}"
            );
            assert!(r[len..].iter().all(|&x| x == -1.0), "{r:?}");
        }
    }
    // The output is the plain call's, bit for bit on the CPU backend.
    let mut plain = DeviceBuffer::<f32>::zeros(&ctx, 2 * cfg.q_row_len()).unwrap();
    kv.attention_batch(0, &[1, 0], &q, &mut plain, None)
        .unwrap();
    assert_eq!(plain.to_vec().unwrap(), out.to_vec().unwrap());
    // A stride shorter than the longest sequence, and a buffer of the wrong length.
    let e = assert_status(
        kv.attention_weights(0, &[1, 0], &q, &mut out, &mut w.slice_mut(0..64), 8, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("weights_stride is 8"), "{e}");
    let e = assert_status(
        kv.attention_weights(0, &[1, 0], &q, &mut out, &mut w, 8, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("weights has 72 elements"), "{e}");
}

#[test]
fn attention_importance_reduces_the_weights() {
    let (ctx, _, kv, q, mut out) = weights_cache("attention_importance_reduces_the_weights");
    let mut w = DeviceBuffer::<f32>::zeros(&ctx, 2 * 4 * 9).unwrap();
    kv.attention_weights(0, &[1, 0], &q, &mut out, &mut w, 9, None)
        .unwrap();
    let w = w.to_vec().unwrap();
    let start: Vec<f32> = (0..2 * 2 * 9).map(|i| 0.01 * i as f32).collect();
    let mut imp = DeviceBuffer::from_slice(&ctx, &start).unwrap();
    kv.attention_importance(0, &[1, 0], &q, &mut out, &mut imp, 9, 0.5, None)
        .unwrap();
    let got = imp.to_vec().unwrap();
    for (row, len) in [(0, 9), (1, 5)] {
        for g in 0..2 {
            for p in 0..9 {
                let at = (row * 2 + g) * 9 + p;
                if p >= len {
                    assert_eq!(
                        got[at], start[at],
                        "row {row} K/V head {g}: past the length"
                    );
                    continue;
                }
                let most = (2 * g..2 * g + 2)
                    .map(|h| w[(row * 4 + h) * 9 + p])
                    .fold(0.0f32, f32::max);
                let want = 0.5 * start[at] + most;
                assert!(
                    (got[at] - want).abs() <= 1e-6 * want,
                    "{at}: {} {want}",
                    got[at]
                );
            }
        }
    }
    // A decay outside [0, 1], a short stride, a buffer of the wrong length: nothing written.
    for decay in [-0.5, 1.5, f32::NAN] {
        let e = assert_status(
            kv.attention_importance(0, &[1, 0], &q, &mut out, &mut imp, 9, decay, None),
            Status::InvalidArgument,
        );
        assert!(e.message().contains("decay is"), "{e}");
    }
    let e = assert_status(
        kv.attention_importance(
            0,
            &[1, 0],
            &q,
            &mut out,
            &mut imp.slice_mut(0..32),
            8,
            1.0,
            None,
        ),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("importance_stride is 8"), "{e}");
    let e = assert_status(
        kv.attention_importance(0, &[1, 0], &q, &mut out, &mut imp, 8, 1.0, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("importance has 36 elements"), "{e}");
    assert_eq!(imp.to_vec().unwrap(), got);
}

/// 4/2 heads of 64, 2 sequences of 64 positions, no sinks and a window of 4, in these tiers.
fn small_tiered(n_layers: usize, tiers: &[KvTier]) -> KvCacheConfig {
    KvCacheConfig::new(n_layers, 4, 64)
        .kv_heads(2)
        .max_seqs(2)
        .max_seq_len(64)
        .sinks(0)
        .window(4)
        .tiers(tiers)
}

#[test]
fn placement_by_importance_and_its_errors() {
    let ctx = cpu();
    let base = small_tiered(
        1,
        &[
            KvTier::new(KvFormat::Q8, KvFormat::Q8, 4),
            KvTier::new(KvFormat::Q4, KvFormat::Q2, 64),
        ],
    );
    assert_eq!(base.placement, TierPlacement::FirstFree);
    let cfg = base.placement(TierPlacement::Importance);
    // The sums and counts (1 layer x 2 sequences x 64 positions, 8 bytes each), the ranking's
    // counters (2 sequences x 4 tiers, 4 bytes each) and a ranking of each (layer, sequence):
    // 408 bytes and 8 a window row.
    assert_eq!(
        cfg.bytes_needed().unwrap() - base.bytes_needed().unwrap(),
        2 * 64 * 8 + 2 * 4 * 4 + 2 * (408 + 8 * 4)
    );
    let mut kv = KvCache::new(&ctx, &cfg).unwrap();
    assert_eq!(kv.config().placement, TierPlacement::Importance);
    let plain = KvCache::new(&ctx, &base).unwrap();
    let mut rng = Rng::fresh("placement_by_importance_and_its_errors");
    let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(2 * base.q_row_len(), 1.0)).unwrap();
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * base.q_row_len()).unwrap();
    let q1 = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.q_row_len(), 1.0)).unwrap();
    let mut out1 = DeviceBuffer::<f32>::zeros(&ctx, base.q_row_len()).unwrap();
    let e = assert_status(
        plain.attention_observe(0, &[0], &q1, &mut out1, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("PLACE_IMPORTANCE"), "{e}");
    let e = assert_status(
        kv.attention_observe(0, &[1, 1], &q, &mut out, None),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("repeats"), "{e}");
    let untiered = KvCacheConfig::new(1, 4, 64).placement(TierPlacement::Importance);
    let e = assert_status(KvCache::new(&ctx, &untiered), Status::InvalidArgument);
    assert!(e.message().contains("n_tiers"), "{e}");
    // Rows leave the window and cascade; the observe call's output is the plain call's.
    let mut plain_out = DeviceBuffer::<f32>::zeros(&ctx, 2 * base.q_row_len()).unwrap();
    for _ in 0..20 {
        for s in 0..2 {
            let k =
                DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0)).unwrap();
            let v =
                DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0)).unwrap();
            kv.append(0, s, &k, &v).unwrap();
        }
        kv.attention_batch(0, &[0, 1], &q, &mut plain_out, None)
            .unwrap();
        kv.attention_observe(0, &[0, 1], &q, &mut out, None)
            .unwrap();
        assert_eq!(out.to_vec().unwrap(), plain_out.to_vec().unwrap());
    }
    assert_eq!(kv.tier_rows(0, 0).unwrap(), vec![4, 12]);
    let st = kv.tier_stats().unwrap();
    assert!(st.demoted_rows > 0 && st.moved_rows == 0, "{st:?}");
    // An observe call after each plain call: the plain calls never reach the default interval.
    assert_eq!(base.observe_interval, 4);
    assert_eq!(st.observe_calls, 20);
}

/// [`small_tiered`] with K8V8, K8V4 and K4V2 tiers, placed by importance.
fn three_tiers_by_importance(n_layers: usize) -> KvCacheConfig {
    small_tiered(
        n_layers,
        &[
            KvTier::new(KvFormat::Q8, KvFormat::Q8, 4),
            KvTier::new(KvFormat::Q8, KvFormat::Q4, 8),
            KvTier::new(KvFormat::Q4, KvFormat::Q2, 64),
        ],
    )
    .placement(TierPlacement::Importance)
}

#[test]
fn a_demote_margin_keeps_rows_in_their_tiers() {
    let ctx = cpu();
    let base = three_tiers_by_importance(1);
    assert_eq!(base.demote_margin, 0.0);
    for bad in [-0.5f32, f32::NAN, f32::INFINITY] {
        let e = assert_status(
            KvCache::new(&ctx, &base.demote_margin(bad)),
            Status::InvalidArgument,
        );
        assert!(e.message().contains("demote_margin"), "{e}");
    }
    assert_ne!(base.demote_margin(0.5), base);
    // Margins of 0 and 0.25 displace rows; one no score ratio reaches places every row where
    // the default placement (the first free tier) does.
    let mut caches: Vec<KvCache> = [0.0f32, 0.25, 1e30]
        .iter()
        .map(|&m| KvCache::new(&ctx, &base.demote_margin(m)).unwrap())
        .collect();
    let mut first_free = KvCache::new(&ctx, &base.placement(TierPlacement::FirstFree)).unwrap();
    assert_eq!(caches[1].config().demote_margin, 0.25);
    let mut rng = Rng::fresh("a_demote_margin_keeps_rows_in_their_tiers");
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, base.q_row_len()).unwrap();
    for _ in 0..48 {
        let k = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0)).unwrap();
        let v = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0)).unwrap();
        let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.q_row_len(), 1.0)).unwrap();
        first_free.append(0, 0, &k, &v).unwrap();
        for kv in caches.iter_mut() {
            kv.append(0, 0, &k, &v).unwrap();
            kv.attention_observe(0, &[0], &q, &mut out, None).unwrap();
        }
    }
    let demoted: Vec<u64> = caches
        .iter()
        .map(|kv| kv.tier_stats().unwrap().demoted_rows)
        .collect();
    assert!(demoted[0] > 0 && demoted[1] > 0, "{demoted:?}");
    assert_eq!(demoted[2], 0);
    for p in 0..48 {
        assert_eq!(
            caches[2].tier_of(0, 0, p).unwrap(),
            first_free.tier_of(0, 0, p).unwrap(),
            "position {p}"
        );
    }
}

#[test]
fn the_cache_observes_every_nth_plain_call() {
    let ctx = cpu();
    let base = three_tiers_by_importance(2);
    let e = assert_status(
        KvCache::new(&ctx, &base.observe_interval(usize::MAX)),
        Status::InvalidArgument,
    );
    assert!(e.message().contains("observe_interval"), "{e}");
    // The cache's own calls (every 3rd plain call of a layer) against a twin whose caller
    // makes them: the same tiers for every position, the same outputs, the same count.
    let mut auto = KvCache::new(&ctx, &base.observe_interval(3)).unwrap();
    let mut twin = KvCache::new(&ctx, &base.observe_interval(0)).unwrap();
    assert_eq!(auto.config().observe_interval, 3);
    assert_eq!(twin.config().observe_interval, 0);
    let mut rng = Rng::fresh("the_cache_observes_every_nth_plain_call");
    let mut out = DeviceBuffer::<f32>::zeros(&ctx, 2 * base.q_row_len()).unwrap();
    let mut twin_out = DeviceBuffer::<f32>::zeros(&ctx, 2 * base.q_row_len()).unwrap();
    for step in 0..40 {
        let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(2 * base.q_row_len(), 1.0)).unwrap();
        for layer in 0..2 {
            for s in 0..2 {
                let k = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0))
                    .unwrap();
                let v = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.kv_row_len(), 1.0))
                    .unwrap();
                auto.append(layer, s, &k, &v).unwrap();
                twin.append(layer, s, &k, &v).unwrap();
            }
            auto.attention_batch(layer, &[1, 0], &q, &mut out, None)
                .unwrap();
            if step % 3 == 2 {
                twin.attention_observe(layer, &[1, 0], &q, &mut twin_out, None)
                    .unwrap();
            } else {
                twin.attention_batch(layer, &[1, 0], &q, &mut twin_out, None)
                    .unwrap();
            }
            assert_eq!(out.to_vec().unwrap(), twin_out.to_vec().unwrap());
        }
    }
    for layer in 0..2 {
        for s in 0..2 {
            for p in 0..40 {
                assert_eq!(
                    auto.tier_of(layer, s, p).unwrap(),
                    twin.tier_of(layer, s, p).unwrap(),
                    "layer {layer} seq {s} position {p}"
                );
            }
        }
    }
    let (st, twin_st) = (auto.tier_stats().unwrap(), twin.tier_stats().unwrap());
    assert_eq!(st.observe_calls, 2 * 13);
    assert_eq!(st, twin_st);
    assert!(st.demoted_rows > 0, "{st:?}");
}

#[test]
fn tiers_place_move_and_attend() {
    let ctx = cpu();
    // No window: every row past the 2 sinks is quantized when appended, into the first tier
    // with a free row (ffi_tests/cases_tiers.c checks the values against a model).
    let base = KvCacheConfig::new(1, 4, 64)
        .kv_heads(2)
        .max_seq_len(40)
        .sinks(2)
        .window(0);
    let tiered = base.tiers(&[
        KvTier::new(KvFormat::Q8, KvFormat::Q4, 10),
        KvTier::new(KvFormat::Q4, KvFormat::Q2, 30),
    ]);
    assert_eq!(tiered.format, KvFormat::Q8);
    assert_eq!(tiered.v_format, Some(KvFormat::Q4));
    let mut kt = KvCache::new(&ctx, &tiered).unwrap();
    let ku = KvCache::new(&ctx, &base).unwrap();
    assert_eq!(kt.config().tier_list(), tiered.tier_list());
    let mut rng = Rng::fresh("tiers_place_move_and_attend");
    let rows = 25;
    let k = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(rows * base.kv_row_len(), 1.0)).unwrap();
    let v = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(rows * base.kv_row_len(), 1.0)).unwrap();
    kt.append_tokens(0, 0, rows, &k, &v).unwrap();
    assert_eq!(kt.tier_rows(0, 0).unwrap(), vec![10, 13]);
    assert_eq!(kt.tier_of(0, 0, 1).unwrap(), None);
    assert_eq!(kt.tier_of(0, 0, 2).unwrap(), Some(0));
    assert_eq!(kt.tier_of(0, 0, 12).unwrap(), Some(1));
    let q = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(base.q_row_len(), 1.0)).unwrap();
    let mut ot = DeviceBuffer::<f32>::zeros(&ctx, base.q_row_len()).unwrap();
    kt.attention(0, 0, &q, &mut ot, None).unwrap();
    let before = ot.to_vec().unwrap();
    assert!(before.iter().all(|x| x.is_finite()));
    // Down into tier 1 (re-quantized from its values); tier 0 has no room for all of them back.
    kt.tier_move(0, 0, 0..8, 1).unwrap();
    assert_eq!(kt.tier_rows(0, 0).unwrap(), vec![4, 19]);
    assert_eq!(kt.tier_of(0, 0, 5).unwrap(), Some(1));
    let e = assert_status(kt.tier_move(0, 0, 0..25, 0), Status::Capacity);
    assert!(e.message().contains("none was moved"), "{e}");
    assert_eq!(kt.tier_rows(0, 0).unwrap(), vec![4, 19]);
    kt.attention(0, 0, &q, &mut ot, None).unwrap();
    assert_ne!(
        ot.to_vec().unwrap(),
        before,
        "rows 2..8 now have fewer bits"
    );
    // 23 rows at (8.5 + 5) / 2 (Q8, Q4) or (5 + 3) / 2 (Q4, Q2) bits and a 4-byte slot map
    // entry over 2 x 2 x 64 values, 2 sinks at 16; rows 2..8 moved
    let stats = kt.tier_stats().unwrap();
    assert_eq!(stats.rows, vec![4, 19]);
    assert_eq!(stats.free_rows, vec![6, 11]);
    assert_eq!((stats.kept_rows, stats.moved_rows), (2, 6));
    let map = 32.0 / 256.0;
    let bits = (4.0 * (6.75 + map) + 19.0 * (4.0 + map) + 2.0 * 16.0) / 25.0;
    assert!((stats.bits_per_value - bits).abs() < 1e-12, "{stats:?}");
    kt.truncate(0, 6).unwrap();
    assert_eq!(kt.tier_rows(0, 0).unwrap(), vec![0, 4]);
    assert_eq!(kt.tier_stats().unwrap().rows, vec![0, 4]);
    let e = assert_status(ku.tier_stats(), Status::InvalidArgument);
    assert!(e.message().contains("no tiers"), "{e}");
    // A cache without tiers, and more tiers than there can be.
    let e = assert_status(ku.tier_rows(0, 0), Status::InvalidArgument);
    assert!(e.message().contains("no tiers"), "{e}");
    let five = [KvTier::new(KvFormat::Q4, KvFormat::Q4, 10); 5];
    let e = assert_status(base.tiers(&five).bytes_needed(), Status::InvalidArgument);
    assert!(e.message().contains("at most 4"), "{e}");
}

#[test]
fn tiers_planned_for_a_target_hold_every_row_within_it() {
    let ctx = cpu();
    let pairs = [
        (KvFormat::Q8, KvFormat::Q8),
        (KvFormat::Q8, KvFormat::Q4),
        (KvFormat::Q4, KvFormat::Q3),
        (KvFormat::Q4, KvFormat::Q2),
    ];
    let tiers: Vec<KvTier> = pairs.iter().map(|&(k, v)| KvTier::new(k, v, 7)).collect();
    let base = small_tiered(1, &tiers);
    let values = 2.0 * 2.0 * 64.0 * 2.0 * 64.0; // K and V, 2 sequences, 64 positions, 2 x 64
    let mut rng = Rng::fresh("tiers_planned_for_a_target_hold_every_row_within_it");
    for bits in [5.0, 5.75, 6.5, 8.0, 9.5] {
        let cfg = base.tiers_for_bits(bits).unwrap();
        let rows: Vec<usize> = cfg.tier_list().iter().map(|t| t.rows).collect();
        assert_eq!(rows.iter().sum::<usize>(), 64 - 4, "{bits} bits: {rows:?}");
        assert!(
            rows.iter().filter(|&&r| r > 0).count() <= 2,
            "{bits} bits: {rows:?}"
        );
        assert!(cfg.bytes_needed().unwrap() as f64 * 8.0 <= bits * values);
        let mut kv = KvCache::new(&ctx, &cfg).unwrap();
        for s in 0..2 {
            let k = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(64 * cfg.kv_row_len(), 1.0))
                .unwrap();
            let v = DeviceBuffer::from_slice(&ctx, &rng.normal_vec(64 * cfg.kv_row_len(), 1.0))
                .unwrap();
            kv.append(0, s, &k, &v).unwrap();
        }
        let st = kv.tier_stats().unwrap();
        assert!(
            st.bits_per_value <= bits,
            "{} stored for {bits}",
            st.bits_per_value
        );
    }
    let e = assert_status(base.tiers_for_bits(4.0), Status::Capacity);
    assert!(e.message().contains("cheapest"), "{e}");
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_status(base.tiers_for_bits(bad), Status::InvalidArgument);
    }
    let uniform = KvCacheConfig::new(1, 4, 64).format(KvFormat::Q4);
    assert_status(uniform.tiers_for_bits(6.0), Status::InvalidArgument);
}
