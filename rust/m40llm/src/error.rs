//! Errors: a [`Status`] code plus the library's detail message.

use std::ffi::CStr;
use std::fmt;

use m40llm_sys as sys;

/// Why a call failed: the library's `M40LLM_ERR_*` status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// A null pointer, non-positive size, wrong buffer length or inconsistent shape.
    InvalidArgument,
    /// A layer, sequence, position or device index outside its bounds.
    OutOfRange,
    /// An append would pass the cache's `max_seq_len`, or a capacity plan found that not even
    /// one position fits.
    Capacity,
    /// A host or device allocation failed.
    OutOfMemory,
    /// CUDA was requested but there is no usable GPU, or the library was built without CUDA.
    NoDevice,
    /// The CUDA runtime reported an error (a device fault is [`Status::ContextLost`] instead).
    Cuda,
    /// A valid request that this build or backend cannot serve.
    Unsupported,
    /// The context's GPU had a device fault (a sticky CUDA error): every later call on the
    /// context that would use the GPU fails with this at once. Drop its caches and the context;
    /// only a new process can use that GPU again.
    ContextLost,
    /// A code this version of the crate does not know.
    Unknown(i32),
}

impl Status {
    /// Maps a library status code (negative) to a `Status`; `None` for `M40LLM_OK` (0).
    pub fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::M40LLM_OK => return None,
            sys::M40LLM_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::M40LLM_ERR_OUT_OF_RANGE => Status::OutOfRange,
            sys::M40LLM_ERR_CAPACITY => Status::Capacity,
            sys::M40LLM_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::M40LLM_ERR_NO_DEVICE => Status::NoDevice,
            sys::M40LLM_ERR_CUDA => Status::Cuda,
            sys::M40LLM_ERR_UNSUPPORTED => Status::Unsupported,
            sys::M40LLM_ERR_CONTEXT_LOST => Status::ContextLost,
            other => Status::Unknown(other),
        })
    }

    /// The library's numeric code for this status.
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::M40LLM_ERR_INVALID_ARGUMENT,
            Status::OutOfRange => sys::M40LLM_ERR_OUT_OF_RANGE,
            Status::Capacity => sys::M40LLM_ERR_CAPACITY,
            Status::OutOfMemory => sys::M40LLM_ERR_OUT_OF_MEMORY,
            Status::NoDevice => sys::M40LLM_ERR_NO_DEVICE,
            Status::Cuda => sys::M40LLM_ERR_CUDA,
            Status::Unsupported => sys::M40LLM_ERR_UNSUPPORTED,
            Status::ContextLost => sys::M40LLM_ERR_CONTEXT_LOST,
            Status::Unknown(c) => c,
        }
    }

    /// The library's name and meaning of this status (`m40llm_status_string`).
    pub fn description(self) -> &'static str {
        // SAFETY: the library returns a pointer to a static NUL-terminated string for any code.
        unsafe { static_str(sys::m40llm_status_string(self.code())) }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// An error from m40llm: the status code and a detail message.
///
/// For failures inside the C library the message is `m40llm_last_error_message()`, read on the
/// same thread right after the failing call. Failures detected by this crate before calling the
/// library (wrong buffer lengths, indices out of range, mixed contexts) carry the status the
/// library would have used and a message written here.
///
/// `Error` is `Send + Sync` (it owns a `String`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

/// `Result<T, m40llm::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with the given status and message.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// Why the call failed.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The numeric status code (`M40LLM_ERR_*`, negative).
    pub fn code(&self) -> i32 {
        self.status.code()
    }

    /// The detail message (may be empty).
    pub fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }

    pub(crate) fn out_of_range(message: impl Into<String>) -> Error {
        Error::new(Status::OutOfRange, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.status)
        } else {
            write!(f, "{}: {}", self.status, self.message)
        }
    }
}

impl std::error::Error for Error {}

/// Turns a status returned by the C library into a `Result`, reading the thread's last error
/// message on failure. Call it immediately after the FFI call, on the same thread.
pub(crate) fn check(code: i32) -> Result<()> {
    match Status::from_code(code) {
        None => Ok(()),
        Some(status) => {
            // SAFETY: the library returns a valid thread-local NUL-terminated string.
            let message = unsafe { CStr::from_ptr(sys::m40llm_last_error_message()) }
                .to_string_lossy()
                .into_owned();
            Err(Error { status, message })
        }
    }
}

/// # Safety
/// `p` must be null or point to a NUL-terminated string with static storage duration.
pub(crate) unsafe fn static_str(p: *const std::os::raw::c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    CStr::from_ptr(p).to_str().unwrap_or("")
}
