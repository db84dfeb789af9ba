//! Validation of a file's contents before anything trusts it.

use crate::error::ImageError;
use crate::layout::{
    self, BASE_FILE_LEN, EXT_MAGIC, EXT_VERSION, Extension, FILE_LEN, HAMI_FILE_LEN, HAMI_MAGIC,
    HAMI_MAJOR, HAMI_MINOR, MAX_DEVICES, MAX_SLOTS, REGION_SIZE, offsets,
};
use crate::sys::Mapping;

/// Read access to file contents: a byte slice (fuzzing, tests) or the live mapping.
pub(crate) trait Image {
    fn len(&self) -> usize;
    fn u32_at(&self, offset: usize) -> Option<u32>;
    fn u64_at(&self, offset: usize) -> Option<u64>;
}

impl Image for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn u32_at(&self, offset: usize) -> Option<u32> {
        let b = self.get(offset..offset.checked_add(4)?)?;
        Some(u32::from_le_bytes(b.try_into().ok()?))
    }
    fn u64_at(&self, offset: usize) -> Option<u64> {
        let b = self.get(offset..offset.checked_add(8)?)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }
}

impl Image for Mapping {
    fn len(&self) -> usize {
        Mapping::len(self)
    }
    fn u32_at(&self, offset: usize) -> Option<u32> {
        self.load_u32(offset)
    }
    fn u64_at(&self, offset: usize) -> Option<u64> {
        self.load_u64(offset)
    }
}

/// What validation learned about a good file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Devices recorded in the file.
    pub device_num: u32,
    /// HAMi's live-slot count.
    pub proc_num: u32,
    /// The extension's minor version (which appended parts the file has; see
    /// `layout::EXT_MINOR`). A file of minor 0 is upgraded in place when opened for writing.
    pub minor_version: u32,
}

/// Check HAMi's magic and layout version (`Err(None)`: too short to hold them).
pub(crate) fn check_hami_header<I: Image + ?Sized>(image: &I) -> Result<(), Option<ImageError>> {
    let flag = image.u32_at(offsets::INITIALIZED_FLAG).ok_or(None)?;
    if flag != HAMI_MAGIC as u32 {
        return Err(Some(ImageError::Foreign { flag }));
    }
    let major = image.u32_at(offsets::MAJOR_VERSION).ok_or(None)?;
    let minor = image.u32_at(offsets::MINOR_VERSION).ok_or(None)?;
    if (major, minor) != (HAMI_MAJOR, HAMI_MINOR) {
        return Err(Some(ImageError::UnsupportedHamiVersion { major, minor }));
    }
    Ok(())
}

/// Check that `image` is an initialized vgpu table this library can use.
pub(crate) fn validate<I: Image + ?Sized>(image: &I) -> Result<ImageInfo, ImageError> {
    let len = image.len();
    let truncated = || ImageError::Truncated {
        len: len as u64,
        expected: BASE_FILE_LEN as u64,
    };
    if len < 16 {
        return Err(truncated()); // not even HAMi's version words
    }
    let flag = image
        .u32_at(offsets::INITIALIZED_FLAG)
        .ok_or_else(truncated)?;
    if flag == 0 {
        // Zero flag: an unfinished initialization if the file has our length, else not ours.
        return Err(
            if [FILE_LEN, layout::MINOR1_FILE_LEN, BASE_FILE_LEN].contains(&len) {
                ImageError::Uninitialized
            } else {
                truncated()
            },
        );
    }
    check_hami_header(image).map_err(|e| e.unwrap_or_else(truncated))?;
    if len < BASE_FILE_LEN {
        return Err(if len == HAMI_FILE_LEN || len == REGION_SIZE {
            ImageError::HamiCoreFile
        } else {
            truncated()
        });
    }
    let magic = image.u64_at(offsets::EXT_MAGIC).ok_or_else(truncated)?;
    if magic != EXT_MAGIC {
        return Err(if magic == 0 {
            ImageError::HamiCoreFile
        } else {
            ImageError::Corrupt {
                field: "extension magic",
                value: magic,
            }
        });
    }
    let version = image.u32_at(offsets::EXT_VERSION).ok_or_else(truncated)?;
    if version > EXT_VERSION {
        return Err(ImageError::NewerVersion {
            found: version,
            supported: EXT_VERSION,
        });
    }
    if version < EXT_VERSION {
        return Err(ImageError::OlderVersion {
            found: version,
            supported: EXT_VERSION,
        });
    }
    let expect = |field: &'static str, offset: usize, want: usize| {
        let value = image.u32_at(offset).ok_or_else(truncated)?;
        if value as usize == want {
            Ok(())
        } else {
            Err(ImageError::Corrupt {
                field,
                value: u64::from(value),
            })
        }
    };
    expect("extension size", offsets::EXT_SIZE, size_of::<Extension>())?;
    expect("extension max_slots", offsets::EXT_MAX_SLOTS, MAX_SLOTS)?;
    expect(
        "extension max_devices",
        offsets::EXT_MAX_DEVICES,
        MAX_DEVICES,
    )?;
    let device_num = image.u64_at(offsets::DEVICE_NUM).ok_or_else(truncated)?;
    if device_num > MAX_DEVICES as u64 {
        return Err(ImageError::Corrupt {
            field: "device_num",
            value: device_num,
        });
    }
    let minor_version = image
        .u32_at(offsets::EXT_MINOR_VERSION)
        .ok_or_else(truncated)?;
    if len < layout::len_of_minor(minor_version) {
        // Says it has an appended part (publish times, host usage), but ends before it.
        return Err(ImageError::Truncated {
            len: len as u64,
            expected: layout::len_of_minor(minor_version) as u64,
        });
    }
    let proc_num = image.u32_at(offsets::PROC_NUM).ok_or_else(truncated)?;
    if proc_num as usize > layout::MAX_SLOTS {
        // Covers negative values too (read as u32).
        return Err(ImageError::Corrupt {
            field: "proc_num",
            value: u64::from(proc_num),
        });
    }
    Ok(ImageInfo {
        device_num: device_num as u32,
        proc_num,
        minor_version,
    })
}
