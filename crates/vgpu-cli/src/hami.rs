//! Reading a usage file written by HAMi-core itself (version 1.2 region, no vgpu extension),
//! so `status`, `watch` and the exporter also work on nodes still running HAMi-core, as
//! HAMi's monitor does. Read-only and safe: the file is read with `read(2)` (a copy, never a
//! mapping) and decoded at the offsets of vgpu-shm's layout, which are compile-time checked
//! against HAMi's.
//!
//! HAMi-core keeps no liveness record of its own: a slot's `status` field (1 running,
//! 2 suspended, 0 dead) is all there is, so that is what the report shows.

use std::io::Read;
use std::mem::{offset_of, size_of};
use std::path::Path;

use vgpu_shm::layout::{
    HAMI_MAGIC, HAMI_MAJOR, HAMI_MINOR, HamiDeviceMemory, HamiDeviceUtil, HamiProcSlot, HamiRegion,
    MAX_DEVICES, MAX_SLOTS, REGION_SIZE, UUID_LEN,
};

use crate::report::{DeviceStatus, ProcessDevice, ProcessStatus, SCHEMA, StatusReport};

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
}

fn i32_at(b: &[u8], at: usize) -> i32 {
    u32_at(b, at) as i32
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
}

/// Decode a HAMi-core 1.2 region image into a report; `cache` names the file in it.
pub fn decode(cache: &Path, image: &[u8]) -> Result<StatusReport, String> {
    if image.len() < REGION_SIZE {
        return Err(format!(
            "{}: {} bytes, shorter than a HAMi-core region ({REGION_SIZE})",
            cache.display(),
            image.len()
        ));
    }
    let flag = i32_at(image, offset_of!(HamiRegion, initialized_flag));
    let major = u32_at(image, offset_of!(HamiRegion, major_version));
    let minor = u32_at(image, offset_of!(HamiRegion, minor_version));
    if flag != HAMI_MAGIC || (major, minor) != (HAMI_MAJOR, HAMI_MINOR) {
        return Err(format!(
            "{}: not a HAMi-core 1.2 region (flag {flag:#x}, version {major}.{minor})",
            cache.display()
        ));
    }
    let device_num =
        u64_at(image, offset_of!(HamiRegion, device_num)).min(MAX_DEVICES as u64) as usize;
    let proc_num =
        i32_at(image, offset_of!(HamiRegion, proc_num)).clamp(0, MAX_SLOTS as i32) as usize;
    let slot_at = |j: usize| offset_of!(HamiRegion, procs) + j * size_of::<HamiProcSlot>();
    let mem_at = |j: usize, d: usize| {
        slot_at(j) + offset_of!(HamiProcSlot, used) + d * size_of::<HamiDeviceMemory>()
    };
    let util_at = |j: usize, d: usize| {
        slot_at(j)
            + offset_of!(HamiProcSlot, device_util)
            + d * size_of::<HamiDeviceUtil>()
            + offset_of!(HamiDeviceUtil, sm_util)
    };

    let mut processes = Vec::new();
    let mut sums = vec![[0u64; 4]; device_num]; // context, module, data, sm_util
    for j in 0..proc_num {
        let pid = i32_at(image, slot_at(j) + offset_of!(HamiProcSlot, pid));
        if pid == 0 {
            continue;
        }
        let hostpid = i32_at(image, slot_at(j) + offset_of!(HamiProcSlot, hostpid));
        let status = i32_at(image, slot_at(j) + offset_of!(HamiProcSlot, status));
        let mut devices = Vec::new();
        for (d, sum) in sums.iter_mut().enumerate() {
            let m = mem_at(j, d);
            let context = u64_at(image, m + offset_of!(HamiDeviceMemory, context_size));
            let module = u64_at(image, m + offset_of!(HamiDeviceMemory, module_size));
            let data = u64_at(image, m + offset_of!(HamiDeviceMemory, data_size));
            let total = u64_at(image, m + offset_of!(HamiDeviceMemory, total));
            let sm = u64_at(image, util_at(j, d));
            for (s, v) in sum.iter_mut().zip([context, module, data, sm]) {
                *s = s.saturating_add(v);
            }
            if total > 0 || sm > 0 {
                devices.push(ProcessDevice {
                    index: d as u32,
                    memory_used_bytes: total,
                    context_bytes: context,
                    module_bytes: module,
                    data_bytes: data,
                    sm_utilization_percent: sm,
                });
            }
        }
        let (alive, state) = match status {
            1 => (true, "running"),
            2 => (true, "suspended"),
            _ => (false, "dead"),
        };
        processes.push(ProcessStatus {
            pid,
            host_pid: (hostpid != 0).then_some(hostpid),
            alive,
            state,
            memory_used_bytes: devices
                .iter()
                .map(|d| d.memory_used_bytes)
                .fold(0, u64::saturating_add),
            devices,
        });
    }
    let devices = (0..device_num)
        .map(|d| {
            let uuid_at = offset_of!(HamiRegion, uuids) + d * UUID_LEN;
            let raw = &image[uuid_at..uuid_at + UUID_LEN];
            let uuid = String::from_utf8_lossy(
                &raw[..raw.iter().position(|&b| b == 0).unwrap_or(UUID_LEN)],
            )
            .into_owned();
            let limit = u64_at(image, offset_of!(HamiRegion, limit) + 8 * d);
            let sm = u64_at(image, offset_of!(HamiRegion, sm_limit) + 8 * d);
            let [context, module, data, sm_util] = sums[d];
            // As HAMi's monitor: the sum of the slots' `total` (which includes `offset`).
            let used = processes
                .iter()
                .flat_map(|p| p.devices.iter().filter(|u| u.index as usize == d))
                .map(|u| u.memory_used_bytes)
                .fold(0, u64::saturating_add);
            DeviceStatus {
                index: d as u32,
                uuid: (!uuid.is_empty()).then_some(uuid),
                memory_limit_bytes: (limit != 0).then_some(limit),
                memory_used_bytes: used,
                context_bytes: context,
                module_bytes: module,
                data_bytes: data,
                sm_limit_percent: (sm != 0 && sm < 100).then_some(sm),
                sm_utilization_percent: sm_util,
            }
        })
        .collect();
    Ok(StatusReport {
        schema: SCHEMA,
        cache: cache.display().to_string(),
        devices,
        processes,
    })
}

/// Read a HAMi-core file (its first [`REGION_SIZE`] bytes) and decode it.
pub fn read(path: &Path) -> Result<StatusReport, String> {
    let mut image = Vec::with_capacity(REGION_SIZE);
    std::fs::File::open(path)
        .and_then(|f| f.take(REGION_SIZE as u64).read_to_end(&mut image))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    decode(path, &image)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A HAMi-core file image built at the byte offsets of docs hami-compat.md (literal
    /// numbers, independent of vgpu-shm's layout module).
    pub(crate) fn hami_image() -> Vec<u8> {
        let mut b = vec![0u8; 2_008_953];
        let put32 =
            |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        let put64 =
            |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        put32(&mut b, 0, 19_920_718);
        put32(&mut b, 4, 1);
        put32(&mut b, 8, 2);
        put64(&mut b, 56, 2);
        b[64..64 + 8].copy_from_slice(b"GPU-abcd");
        b[64 + 96..64 + 96 + 8].copy_from_slice(b"GPU-efgh");
        put64(&mut b, 1600, 4 << 30);
        put64(&mut b, 1728 + 8, 30);
        // Two slots: pid 100 running on device 0, pid 200 dead on device 1.
        for (j, pid, status, dev, ctx, data, sm) in [
            (
                0usize,
                100u32,
                1u32,
                0usize,
                300u64 << 20,
                1u64 << 30,
                40u64,
            ),
            (1, 200, 0, 1, 0, 512 << 20, 0),
        ] {
            let slot = 1856 + j * 1960;
            put32(&mut b, slot, pid);
            put32(&mut b, slot + 4, pid + 1000);
            let m = slot + 8 + dev * 64;
            put64(&mut b, m, ctx);
            put64(&mut b, m + 16, data);
            put64(&mut b, m + 32, ctx + data);
            put64(&mut b, slot + 1160 + dev * 48 + 16, sm);
            put32(&mut b, slot + 1928, status);
        }
        put32(&mut b, 2_008_896, 2);
        b
    }

    #[test]
    fn a_hami_core_file_decodes_at_the_documented_offsets() {
        let r = decode(Path::new("/x.cache"), &hami_image()).unwrap();
        assert_eq!(r.devices.len(), 2);
        let d0 = &r.devices[0];
        assert_eq!(d0.uuid.as_deref(), Some("GPU-abcd"));
        assert_eq!(d0.memory_limit_bytes, Some(4 << 30));
        assert_eq!(
            (d0.context_bytes, d0.data_bytes, d0.memory_used_bytes),
            (300 << 20, 1 << 30, (300 << 20) + (1 << 30))
        );
        assert_eq!(d0.sm_limit_percent, None);
        assert_eq!(d0.sm_utilization_percent, 40);
        let d1 = &r.devices[1];
        assert_eq!(
            (d1.memory_limit_bytes, d1.sm_limit_percent, d1.data_bytes),
            (None, Some(30), 512 << 20)
        );
        assert_eq!(r.processes.len(), 2);
        assert_eq!(
            (
                r.processes[0].pid,
                r.processes[0].host_pid,
                r.processes[0].state
            ),
            (100, Some(1100), "running")
        );
        assert_eq!(
            (
                r.processes[1].pid,
                r.processes[1].alive,
                r.processes[1].state
            ),
            (200, false, "dead")
        );
        assert_eq!(r.processes[1].devices[0].index, 1);
    }

    #[test]
    fn other_files_are_refused() {
        assert!(
            decode(Path::new("/x"), &[0u8; 100])
                .unwrap_err()
                .contains("shorter")
        );
        let mut img = hami_image();
        img[8] = 3;
        assert!(
            decode(Path::new("/x"), &img)
                .unwrap_err()
                .contains("version 1.3")
        );
        // A proc_num beyond the slot count is clamped, not trusted.
        let mut img = hami_image();
        img[2_008_896..2_008_900].copy_from_slice(&i32::MAX.to_le_bytes());
        assert!(decode(Path::new("/x"), &img).is_ok());
    }
}
