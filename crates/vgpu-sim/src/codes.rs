//! Driver and NVML result codes the simulator returns, with their names and descriptions.

#![allow(missing_docs)]

/// Declares each code as a constant and, for a code with a description, its
/// `(code, name, description)` entry in `$table`; names and descriptions are NUL-terminated
/// so they can be handed out as C strings. One line per code: a code, its name and its
/// description cannot drift apart.
macro_rules! codes {
    ($($(#[$doc:meta])* $table:ident { $($name:ident = $value:literal $(=> $description:literal)?;)* })*) => {$(
        $(pub const $name: u32 = $value;)*

        $(#[$doc])*
        pub const $table: &[(u32, &str, &str)] = &[$($((
            $value,
            concat!(stringify!($name), "\0"),
            concat!($description, "\0"),
        ),)?)*];
    )*};
}

codes! {
    /// Every code `cuGetErrorName`/`cuGetErrorString` know: the ones with a description (the
    /// others the simulator returns, but does not name).
    CUDA_ERRORS {
        CUDA_SUCCESS = 0 => "no error";
        CUDA_ERROR_INVALID_VALUE = 1 => "invalid argument";
        CUDA_ERROR_OUT_OF_MEMORY = 2 => "out of memory";
        CUDA_ERROR_NOT_INITIALIZED = 3 => "initialization error";
        CUDA_ERROR_DEINITIALIZED = 4 => "driver shutting down";
        CUDA_ERROR_NO_DEVICE = 100 => "no CUDA-capable device is detected";
        CUDA_ERROR_INVALID_DEVICE = 101 => "invalid device ordinal";
        CUDA_ERROR_INVALID_IMAGE = 200 => "device kernel image is invalid";
        CUDA_ERROR_INVALID_CONTEXT = 201 => "invalid device context";
        CUDA_ERROR_NOT_MAPPED = 211 => "resource not mapped";
        CUDA_ERROR_FILE_NOT_FOUND = 301 => "file not found";
        CUDA_ERROR_INVALID_HANDLE = 400 => "invalid resource handle";
        CUDA_ERROR_ILLEGAL_STATE = 401;
        CUDA_ERROR_NOT_FOUND = 500 => "named symbol not found";
        CUDA_ERROR_NOT_READY = 600 => "device not ready";
        CUDA_ERROR_ILLEGAL_ADDRESS = 700 => "an illegal memory access was encountered";
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712;
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713;
        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720 => "too many blocks in cooperative launch";
        CUDA_ERROR_NOT_PERMITTED = 800 => "operation not permitted";
        CUDA_ERROR_NOT_SUPPORTED = 801 => "operation not supported";
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900 => "operation not permitted when stream is capturing";
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901 => "operation failed due to a previous error during capture";
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903 => "capture was not initiated in this stream";
        CUDA_ERROR_UNKNOWN = 999 => "unknown error";
    }

    /// What `nvmlErrorString` says of each code.
    NVML_ERRORS {
        NVML_SUCCESS = 0 => "Success";
        NVML_ERROR_UNINITIALIZED = 1 => "Uninitialized";
        NVML_ERROR_INVALID_ARGUMENT = 2 => "Invalid Argument";
        NVML_ERROR_NOT_SUPPORTED = 3 => "Not Supported";
        NVML_ERROR_NOT_FOUND = 6 => "Not Found";
        NVML_ERROR_INSUFFICIENT_SIZE = 7 => "Insufficient Size";
        NVML_ERROR_UNKNOWN = 999 => "Unknown Error";
    }
}

/// Name and description of a driver result code, `None` for codes this driver does not know.
pub fn cuda_error(code: u32) -> Option<(&'static str, &'static str)> {
    CUDA_ERRORS.iter().find(|e| e.0 == code).map(|e| (e.1, e.2))
}

/// NUL-terminated description of an NVML code (NVML's "Unknown Error" for one it does not know).
pub fn nvml_error(code: u32) -> &'static str {
    NVML_ERRORS
        .iter()
        .find(|e| e.0 == code)
        .map_or("Unknown Error\0", |e| e.2)
}
