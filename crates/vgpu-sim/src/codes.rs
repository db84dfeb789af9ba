//! Driver and NVML result codes the simulator returns, with their names and descriptions.

#![allow(missing_docs)]

pub const CUDA_SUCCESS: u32 = 0;
pub const CUDA_ERROR_INVALID_VALUE: u32 = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;
pub const CUDA_ERROR_DEINITIALIZED: u32 = 4;
pub const CUDA_ERROR_NO_DEVICE: u32 = 100;
pub const CUDA_ERROR_INVALID_DEVICE: u32 = 101;
pub const CUDA_ERROR_INVALID_IMAGE: u32 = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: u32 = 201;
pub const CUDA_ERROR_NOT_MAPPED: u32 = 211;
pub const CUDA_ERROR_FILE_NOT_FOUND: u32 = 301;
pub const CUDA_ERROR_INVALID_HANDLE: u32 = 400;
pub const CUDA_ERROR_NOT_FOUND: u32 = 500;
pub const CUDA_ERROR_NOT_READY: u32 = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: u32 = 700;
pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: u32 = 720;
pub const CUDA_ERROR_NOT_PERMITTED: u32 = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: u32 = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: u32 = 903;
pub const CUDA_ERROR_UNKNOWN: u32 = 999;

pub const NVML_SUCCESS: u32 = 0;
pub const NVML_ERROR_UNINITIALIZED: u32 = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: u32 = 2;
pub const NVML_ERROR_NOT_SUPPORTED: u32 = 3;
pub const NVML_ERROR_NOT_FOUND: u32 = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: u32 = 7;
pub const NVML_ERROR_UNKNOWN: u32 = 999;

/// `(code, name, description)` for every code `cuGetErrorName`/`cuGetErrorString` know.
/// Names and descriptions are NUL-terminated so they can be handed out as C strings.
pub const CUDA_ERRORS: &[(u32, &str, &str)] = &[
    (0, "CUDA_SUCCESS\0", "no error\0"),
    (1, "CUDA_ERROR_INVALID_VALUE\0", "invalid argument\0"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY\0", "out of memory\0"),
    (3, "CUDA_ERROR_NOT_INITIALIZED\0", "initialization error\0"),
    (4, "CUDA_ERROR_DEINITIALIZED\0", "driver shutting down\0"),
    (
        100,
        "CUDA_ERROR_NO_DEVICE\0",
        "no CUDA-capable device is detected\0",
    ),
    (
        101,
        "CUDA_ERROR_INVALID_DEVICE\0",
        "invalid device ordinal\0",
    ),
    (
        200,
        "CUDA_ERROR_INVALID_IMAGE\0",
        "device kernel image is invalid\0",
    ),
    (
        201,
        "CUDA_ERROR_INVALID_CONTEXT\0",
        "invalid device context\0",
    ),
    (211, "CUDA_ERROR_NOT_MAPPED\0", "resource not mapped\0"),
    (301, "CUDA_ERROR_FILE_NOT_FOUND\0", "file not found\0"),
    (
        400,
        "CUDA_ERROR_INVALID_HANDLE\0",
        "invalid resource handle\0",
    ),
    (500, "CUDA_ERROR_NOT_FOUND\0", "named symbol not found\0"),
    (600, "CUDA_ERROR_NOT_READY\0", "device not ready\0"),
    (
        700,
        "CUDA_ERROR_ILLEGAL_ADDRESS\0",
        "an illegal memory access was encountered\0",
    ),
    (
        720,
        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE\0",
        "too many blocks in cooperative launch\0",
    ),
    (
        800,
        "CUDA_ERROR_NOT_PERMITTED\0",
        "operation not permitted\0",
    ),
    (
        801,
        "CUDA_ERROR_NOT_SUPPORTED\0",
        "operation not supported\0",
    ),
    (
        900,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED\0",
        "operation not permitted when stream is capturing\0",
    ),
    (
        901,
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED\0",
        "operation failed due to a previous error during capture\0",
    ),
    (
        903,
        "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED\0",
        "capture was not initiated in this stream\0",
    ),
    (999, "CUDA_ERROR_UNKNOWN\0", "unknown error\0"),
];

/// Name and description of a driver result code, `None` for codes this driver does not know.
pub fn cuda_error(code: u32) -> Option<(&'static str, &'static str)> {
    CUDA_ERRORS.iter().find(|e| e.0 == code).map(|e| (e.1, e.2))
}

/// NUL-terminated description of an NVML code.
pub fn nvml_error(code: u32) -> &'static str {
    match code {
        0 => "Success\0",
        1 => "Uninitialized\0",
        2 => "Invalid Argument\0",
        3 => "Not Supported\0",
        6 => "Not Found\0",
        7 => "Insufficient Size\0",
        _ => "Unknown Error\0",
    }
}
