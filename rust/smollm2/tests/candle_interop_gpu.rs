//! m40llm's candle interop on candle's CUDA device 0 (the checks of interop/mod.rs): CUDA
//! tensors as K, V and q, outputs as new CUDA tensors, the m40llm context on candle's stream.
//! A custom harness (`harness = false`) as rust/m40llm/tests/gpu.rs: without a GPU, or built
//! without the `cuda` feature, every check is reported as skipped, never passed
//! (M40LLM_REQUIRE_GPU=1 makes that a failure). Ends with "N passed, N failed[, N skipped]".

#[path = "../../m40llm/tests/common/mod.rs"]
mod common;
mod interop;

use candle_core::Device;
use m40llm::{Backend, Context};

/// candle's CUDA device 0, or why there is none.
fn cuda_device() -> Result<Device, String> {
    if !cfg!(feature = "cuda") {
        return Err("smollm2 was built without its `cuda` feature".into());
    }
    if !common::gpu_present() {
        return Err("no CUDA device, or m40llm was built without CUDA".into());
    }
    Device::new_cuda(0).map_err(|e| format!("candle cannot open CUDA device 0: {e}"))
}

fn main() {
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<_> = interop::CHECKS
        .iter()
        .filter(|(name, _)| filter.is_empty() || filter.iter().any(|f| name.contains(f.as_str())))
        .collect();
    let device = match cuda_device() {
        Ok(d) => d,
        Err(why) => {
            if std::env::var("M40LLM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("M40LLM_REQUIRE_GPU=1 but {why}");
            }
            eprintln!("candle interop GPU tests: skipped: {why}");
            for (name, _) in &selected {
                println!("test {name} ... skipped");
            }
            println!("0 passed, 0 failed, {} skipped", selected.len());
            return;
        }
    };
    let ctx = Context::from_candle_device(&device).expect("a context on candle's stream");
    assert_eq!(ctx.backend(), Backend::Cuda);
    println!("m40llm: {}", ctx.device_info().expect("device info"));
    let mut failed = 0;
    for (name, check) in &selected {
        let run = || check(&ctx, &device, &mut common::Rng::fresh(name));
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
            Ok(()) => println!("test {name} ... ok"),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    ctx.synchronize().expect("synchronize");
    println!("{} passed, {} failed", selected.len() - failed, failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
