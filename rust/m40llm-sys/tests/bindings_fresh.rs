//! With `--features regenerate-bindings` (needs libclang), fails when the committed
//! `src/bindings.rs` differs from what bindgen now generates from `c/include/m40llm.h`.
//! `rust/scripts/regen_bindings.sh` rewrites the committed file.

#[cfg(feature = "regenerate-bindings")]
#[test]
fn committed_bindings_match_a_fresh_generation() {
    let fresh = include_str!(concat!(env!("OUT_DIR"), "/bindings.rs"));
    let committed = include_str!("../src/bindings.rs");
    assert!(
        fresh == committed,
        "m40llm-sys/src/bindings.rs is stale: run rust/scripts/regen_bindings.sh"
    );
}

/// Always runs: the header's version macro agrees with the linked library.
#[test]
fn header_and_library_versions_agree() {
    let v = unsafe { m40llm_sys::m40llm_version_number() };
    assert_eq!(v, m40llm_sys::M40LLM_VERSION_NUMBER);
}
