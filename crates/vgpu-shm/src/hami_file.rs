//! Files written by HAMi-core itself (its version 1.2 region, no vgpu extension), read
//! read-only into the same [`TableSnapshot`] a vgpu table gives, so `vgpu status`, `watch` and
//! the exporter also work on nodes still running HAMi-core, as HAMi's monitor does. The file is
//! read with `read(2)` (a copy, never a mapping) and decoded at [`layout`](crate::layout)'s
//! offsets; [`TableSnapshot::to_hami_core_image`] is the inverse, for tests and tools.
//!
//! HAMi-core keeps no liveness record of its own: a slot's `status` (1 running, 2 suspended,
//! 0 dead) is all there is, so that is what `alive` and `suspended` say.

use std::io::Read;
use std::path::Path;

use crate::error::{ImageError, ShmError};
use crate::layout::{
    CLASSES, HAMI_FILE_LEN, HAMI_MAGIC, HAMI_MAJOR, HAMI_MINOR, HAMI_STATUS_RUNNING,
    HAMI_STATUS_SUSPENDED, MAX_DEVICES, MAX_SLOTS, REGION_SIZE, UUID_LEN, memory_limit_of, offsets,
    sm_limit_of, uuid_of,
};
use crate::table::{DeviceSnapshot, ProcessDeviceUsage, ProcessSnapshot, TableSnapshot};
use crate::validate::{Image, check_hami_header};

impl TableSnapshot {
    /// Decode the image of a file written by HAMi-core 1.2 (at least its region; a vgpu
    /// extension after it is ignored). Slots `[0, proc_num)` with a nonzero pid are the
    /// processes, each at `slot == hami_index == j`; a device's `used` is the sum of the slots'
    /// `total` fields, as HAMi's monitor computes it.
    pub fn from_hami_core_image(image: &[u8]) -> Result<Self, ImageError> {
        let short = || ImageError::ShortHamiRegion {
            len: image.len() as u64,
        };
        if image.len() < REGION_SIZE {
            return Err(short());
        }
        check_hami_header(image).map_err(|e| e.unwrap_or_else(short))?;
        // Every offset below lies inside the region, which `image` holds whole.
        let u64_at = |at: usize| image.u64_at(at).unwrap_or(0);
        let i32_at = |at: usize| image.u32_at(at).unwrap_or(0) as i32;
        let device_num = u64_at(offsets::DEVICE_NUM).min(MAX_DEVICES as u64) as usize;
        let proc_num = i32_at(offsets::PROC_NUM);
        let mut devices: Vec<DeviceSnapshot> = (0..device_num)
            .map(|d| {
                let uuid = offsets::uuid(d);
                DeviceSnapshot {
                    index: d as u32,
                    uuid: uuid_of(image[uuid..uuid + UUID_LEN].iter().copied()),
                    limit: memory_limit_of(u64_at(offsets::limit(d))),
                    sm_limit: sm_limit_of(u64_at(offsets::sm_limit(d))),
                    used: 0,
                    context: 0,
                    module: 0,
                    data: 0,
                    host: 0,
                    host_policy: Default::default(),
                    oom_refusals: 0,
                }
            })
            .collect();
        let mut processes = Vec::new();
        // A proc_num beyond the slot count is clamped, not trusted.
        for j in 0..proc_num.clamp(0, MAX_SLOTS as i32) as usize {
            let slot = offsets::slot(j);
            let pid = i32_at(slot + offsets::SLOT_PID);
            if pid == 0 {
                continue;
            }
            let status = i32_at(slot + offsets::SLOT_STATUS);
            let mut usage = Vec::with_capacity(device_num);
            for (d, dev) in devices.iter_mut().enumerate() {
                let memory = slot + offsets::slot_memory(d);
                let [context, module, data] = offsets::MEMORY_CLASSES.map(|c| u64_at(memory + c));
                dev.used = dev
                    .used
                    .saturating_add(u64_at(memory + offsets::MEMORY_TOTAL));
                dev.context = dev.context.saturating_add(context);
                dev.module = dev.module.saturating_add(module);
                dev.data = dev.data.saturating_add(data);
                usage.push(ProcessDeviceUsage {
                    context,
                    module,
                    data,
                    host: 0,
                    sm_util: u64_at(slot + offsets::slot_sm_util(d)),
                    sm_util_at: None,
                });
            }
            processes.push(ProcessSnapshot {
                slot: j,
                hami_index: j as u32,
                pid,
                hostpid: i32_at(slot + offsets::SLOT_HOSTPID),
                start_time: 0,
                alive: status == HAMI_STATUS_RUNNING || status == HAMI_STATUS_SUSPENDED,
                suspended: status == HAMI_STATUS_SUSPENDED,
                swapped_out: false,
                kept_host: None,
                devices: usage,
            });
        }
        Ok(Self {
            devices,
            processes,
            proc_num,
            priority: i32_at(offsets::PRIORITY),
            recent_kernel: i32_at(offsets::RECENT_KERNEL),
            utilization_switch: i32_at(offsets::UTILIZATION_SWITCH),
            last_kernel_time: u64_at(offsets::LAST_KERNEL_TIME),
            kept_host: None,
        })
    }

    /// Read a file written by HAMi-core (its first [`REGION_SIZE`] bytes, by `read(2)`: it
    /// is never mapped nor written; a symbolic link or a FIFO is refused) and decode it with [`Self::from_hami_core_image`].
    pub fn read_hami_core_file(path: impl AsRef<Path>) -> Result<Self, ShmError> {
        let path = path.as_ref();
        let mut image = Vec::with_capacity(REGION_SIZE);
        // Opened as node-side readers open (no link followed, no FIFO waited on).
        let file = crate::file::open_read_only(path)
            .map_err(|e| match e {
                // Opening is part of reading the file, as callers know it.
                crate::file::OpenError::Io(_, source) => crate::file::OpenError::Io("read", source),
                refused => refused,
            })
            .map_err(|e| crate::table::open_error(path, e))?
            .file;
        file.take(REGION_SIZE as u64)
            .read_to_end(&mut image)
            .map_err(|source| ShmError::Io {
                path: path.to_path_buf(),
                op: "read",
                source,
            })?;
        Self::from_hami_core_image(&image).map_err(|source| ShmError::InvalidFile {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The file HAMi-core would have written for this picture ([`HAMI_FILE_LEN`] bytes): the
    /// processes fill slots `[0, n)` in order, each slot's `total` is the sum of its classes,
    /// and `status` is 2 if suspended, else 1 if alive, else 0. `proc_num` is the number of
    /// processes. For tests and tools that need a HAMi-core-written file without HAMi-core.
    pub fn to_hami_core_image(&self) -> Vec<u8> {
        let mut b = vec![0u8; HAMI_FILE_LEN];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(offsets::INITIALIZED_FLAG, &HAMI_MAGIC.to_le_bytes());
        put(offsets::MAJOR_VERSION, &HAMI_MAJOR.to_le_bytes());
        put(offsets::MINOR_VERSION, &HAMI_MINOR.to_le_bytes());
        let devices = &self.devices[..self.devices.len().min(MAX_DEVICES)];
        put(offsets::DEVICE_NUM, &(devices.len() as u64).to_le_bytes());
        for (d, dev) in devices.iter().enumerate() {
            let uuid = &dev.uuid.as_bytes()[..dev.uuid.len().min(UUID_LEN - 1)];
            put(offsets::uuid(d), uuid);
            let limit = dev.limit.unwrap_or(0);
            put(offsets::limit(d), &limit.to_le_bytes());
            let sm_limit = dev.sm_limit.unwrap_or(0);
            put(offsets::sm_limit(d), &sm_limit.to_le_bytes());
        }
        let processes = &self.processes[..self.processes.len().min(MAX_SLOTS)];
        for (j, p) in processes.iter().enumerate() {
            let slot = offsets::slot(j);
            put(slot + offsets::SLOT_PID, &p.pid.to_le_bytes());
            put(slot + offsets::SLOT_HOSTPID, &p.hostpid.to_le_bytes());
            let status = match (p.suspended, p.alive) {
                (true, _) => HAMI_STATUS_SUSPENDED,
                (false, true) => HAMI_STATUS_RUNNING,
                (false, false) => 0,
            };
            put(slot + offsets::SLOT_STATUS, &status.to_le_bytes());
            for (d, u) in p.devices.iter().enumerate().take(MAX_DEVICES) {
                let memory = slot + offsets::slot_memory(d);
                let classes: [u64; CLASSES] = [u.context, u.module, u.data];
                for (at, v) in offsets::MEMORY_CLASSES.iter().zip(classes) {
                    put(memory + at, &v.to_le_bytes());
                }
                put(memory + offsets::MEMORY_TOTAL, &u.total().to_le_bytes());
                put(slot + offsets::slot_sm_util(d), &u.sm_util.to_le_bytes());
            }
        }
        put(offsets::PROC_NUM, &(processes.len() as i32).to_le_bytes());
        put(offsets::PRIORITY, &self.priority.to_le_bytes());
        put(offsets::RECENT_KERNEL, &self.recent_kernel.to_le_bytes());
        put(
            offsets::UTILIZATION_SWITCH,
            &self.utilization_switch.to_le_bytes(),
        );
        put(
            offsets::LAST_KERNEL_TIME,
            &self.last_kernel_time.to_le_bytes(),
        );
        b
    }
}
