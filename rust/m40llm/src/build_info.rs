//! What the linked C/CUDA library was built with.

use std::fmt;

use m40llm_sys as sys;

use crate::error::{check, static_str, Result};

/// What the linked library was built with; see [`build_info`].
///
/// An architecture is a compute capability: `52` for the Tesla M40 (5.2), `90` for an H100.
/// Which of them a GPU runs, and whether it gets the tensor-core path, is in
/// [`DeviceInfo`](crate::DeviceInfo).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BuildInfo {
    /// Whether the library has the CUDA backend (as [`built_with_cuda`](crate::built_with_cuda)).
    pub cuda: bool,
    /// The GPU code built in, in CMake's `CUDA_ARCHITECTURES` form, sorted: `NN-real` is sm_NN
    /// SASS (machine code for GPUs of NN's major version from NN up), `NN-virtual` compute_NN
    /// PTX (JIT-compiled by the driver for a GPU of NN or newer that has no SASS here), e.g.
    /// `"52-real;52-virtual;80-real;90-real"`. Empty without CUDA. `m40llm-sys` picks the list
    /// from `M40LLM_CUDA_ARCHS` or `CUDA_COMPUTE_CAP` at build time.
    pub cuda_architectures: &'static str,
    /// The CUDA toolkit it was built with, `(major, minor)`; `None` without CUDA.
    pub cuda_toolkit: Option<(u32, u32)>,
    /// Whether the tensor-core attention kernels are built in (some architecture is 80 or
    /// newer).
    pub tensor_cores: bool,
}

impl fmt::Display for BuildInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cuda_toolkit {
            Some((major, minor)) if self.cuda => write!(
                f,
                "CUDA {major}.{minor}, architectures {}{}",
                self.cuda_architectures,
                if self.tensor_cores {
                    ", tensor-core kernels"
                } else {
                    ""
                }
            ),
            _ => f.write_str("CPU backend only (built without CUDA)"),
        }
    }
}

/// Describes the linked library's build: CUDA or not, the GPU architectures compiled in, the
/// toolkit. Needs no context and no GPU.
///
/// ```
/// let build = m40llm::build_info()?;
/// assert_eq!(build.cuda, m40llm::built_with_cuda());
/// println!("m40llm {}: {build}", m40llm::library_version());
/// # Ok::<(), m40llm::Error>(())
/// ```
pub fn build_info() -> Result<BuildInfo> {
    let mut info = sys::m40llm_build_info {
        version: sys::M40LLM_BUILD_INFO_VERSION,
        ..Default::default()
    };
    // SAFETY: valid out struct with its version set.
    check(unsafe { sys::m40llm_build_info_get(&mut info) })?;
    let v = info.cuda_toolkit_version;
    Ok(BuildInfo {
        cuda: info.cuda != 0,
        // SAFETY: the library's list has static storage.
        cuda_architectures: unsafe { static_str(info.cuda_architectures) },
        cuda_toolkit: (v > 0).then_some((v as u32 / 1000, v as u32 % 1000 / 10)),
        tensor_cores: info.tensor_cores != 0,
    })
}
