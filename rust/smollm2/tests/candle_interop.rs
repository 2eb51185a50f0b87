//! m40llm's candle interop on candle's CPU device and m40llm's CPU backend (the checks are in
//! interop/mod.rs; candle_interop_gpu.rs runs them on a CUDA device).

#[path = "../../m40llm/tests/common/mod.rs"]
mod common;
mod interop;

use candle_core::Device;
use m40llm::{Backend, Context};

fn run(name: &str) {
    let (_, check) = interop::CHECKS.iter().find(|(n, _)| *n == name).unwrap();
    let ctx = Context::from_candle_device(&Device::Cpu).unwrap();
    assert_eq!(ctx.backend(), Backend::Cpu);
    check(&ctx, &Device::Cpu, &mut common::Rng::fresh(name));
}

#[test]
fn attention_matches_reference() {
    run("attention_matches_reference");
}

#[test]
fn causal_matches_reference() {
    run("causal_matches_reference");
}

#[test]
fn offsets_and_layouts() {
    run("offsets_and_layouts");
}

#[test]
fn f16_kv_is_stored_as_given() {
    run("f16_kv_is_stored_as_given");
}

#[test]
fn half_q_and_kv() {
    run("half_q_and_kv");
}

#[test]
fn append_attention_batch_matches_two_calls() {
    run("append_attention_batch_matches_two_calls");
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    run("bad_input_is_refused_and_writes_nothing");
}

/// Every check has a test above (host_tensors_on_a_gpu_cache_are_refused needs a GPU cache:
/// candle_interop_gpu.rs).
#[test]
fn every_check_runs_here() {
    let here = include_str!("candle_interop.rs");
    for (name, _) in interop::CHECKS {
        if name != "host_tensors_on_a_gpu_cache_are_refused" {
            assert!(here.contains(&format!("fn {name}()")), "{name} has no test");
        }
    }
}
