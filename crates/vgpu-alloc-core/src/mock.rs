//! An in-memory device for tests, fuzzing, benches and examples (feature `testing`): it
//! hands out disjoint 2 MiB-aligned addresses, checks frees, has a physical capacity per
//! device and can be told to fail. Not part of the default API: embedders implement
//! [`DeviceBackend`] over their own device (or driver).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::allocator::Allocator;
use crate::backend::{BackendError, ContextId, DeviceBackend, DevicePtr, MemoryInfo};
use crate::ledger::{DeviceIndex, InMemoryLedger, MAX_DEVICES};
use crate::tuning::AllocatorConfig;

/// Devices of [`MockBackend::new`].
const MOCK_DEVICES: usize = 16;

/// The mock's granularity: like the driver, every allocation starts on a 2 MiB boundary.
const MOCK_GRANULARITY: u64 = 2 << 20;

#[derive(Debug)]
struct MockState {
    /// Live allocations: base -> (device, context, bytes). A hash map, so the mock adds
    /// no ordered-index cost to what benches measure.
    live: HashMap<u64, (DeviceIndex, ContextId, u64)>,
    used: Vec<u64>,
    next_address: u64,
    fail_next: u32,
}

/// An in-memory device: hands out disjoint 2 MiB-aligned addresses, checks frees,
/// optionally has a physical capacity per device and can be told to fail.
#[derive(Debug)]
pub struct MockBackend {
    state: Mutex<MockState>,
    capacity: Vec<u64>,
    allocate_calls: AtomicU64,
    free_calls: AtomicU64,
}

impl Default for MockBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MockBackend {
    /// A mock of 16 devices with effectively unlimited physical memory (1 PiB each).
    pub fn new() -> Self {
        Self::with_capacity([1 << 50; MOCK_DEVICES])
    }

    /// A mock with one device per entry of `capacity`, device `i` holding at most
    /// `capacity[i]` bytes (counted in whole allocations as requested): beyond it
    /// `allocate` fails with out-of-memory. Other device indices are invalid values.
    pub fn with_capacity(capacity: impl IntoIterator<Item = u64>) -> Self {
        let capacity: Vec<u64> = capacity.into_iter().collect();
        Self {
            state: Mutex::new(MockState {
                live: HashMap::new(),
                used: vec![0; capacity.len()],
                // Start high, like a real UVA address space, so 0 is never handed out.
                next_address: 0x7f00_0000_0000,
                fail_next: 0,
            }),
            capacity,
            allocate_calls: AtomicU64::new(0),
            free_calls: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make the next `n` calls to `allocate` fail with out-of-memory.
    pub fn fail_next_allocations(&self, n: u32) {
        self.lock().fail_next = n;
    }

    /// Injected failures not yet consumed.
    pub fn pending_failures(&self) -> u32 {
        self.lock().fail_next
    }

    /// Number of live allocations (all devices).
    pub fn live_allocations(&self) -> usize {
        self.lock().live.len()
    }

    /// Bytes currently allocated on `device`.
    pub fn used(&self, device: DeviceIndex) -> u64 {
        self.lock()
            .used
            .get(device.as_usize())
            .copied()
            .unwrap_or(0)
    }

    /// Size of the live allocation at `ptr`, if any.
    pub fn allocation_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.lock().live.get(&ptr.0).map(|&(_, _, b)| b)
    }

    /// Live allocations and their bytes on `device`.
    pub fn live_on(&self, device: DeviceIndex) -> (usize, u64) {
        let st = self.lock();
        st.live
            .values()
            .filter(|(d, _, _)| *d == device)
            .fold((0, 0), |(n, b), e| (n + 1, b + e.2))
    }

    /// Emulate `cuCtxDestroy`: the driver frees everything `context` allocated.
    /// Returns how many allocations went.
    pub fn destroy_context(&self, context: ContextId) -> usize {
        let mut st = self.lock();
        let st = &mut *st;
        let before = st.live.len();
        let used = &mut st.used;
        st.live.retain(|_, (d, c, bytes)| {
            if *c == context {
                used[d.as_usize()] -= *bytes;
            }
            *c != context
        });
        before - st.live.len()
    }

    /// How many times `allocate` / `free` were called.
    pub fn calls(&self) -> (u64, u64) {
        (
            self.allocate_calls.load(Ordering::Relaxed),
            self.free_calls.load(Ordering::Relaxed),
        )
    }
}

impl Allocator<MockBackend, InMemoryLedger> {
    /// An allocator of the default configuration over a fresh [`MockBackend`], charging an
    /// [`InMemoryLedger`] that limits device 0 to `limit` bytes (`None`: no limit) and leaves
    /// the other devices unlimited: what the examples measure and the tests check.
    pub fn over_mock(limit: Option<u64>) -> Self {
        let mut limits = [None; MAX_DEVICES];
        limits[0] = limit;
        Self::new(
            AllocatorConfig::default(),
            MockBackend::new(),
            InMemoryLedger::new(limits),
        )
        .expect("the default configuration is valid")
    }
}

impl DeviceBackend for MockBackend {
    fn allocate(
        &self,
        device: DeviceIndex,
        context: ContextId,
        bytes: u64,
    ) -> Result<DevicePtr, BackendError> {
        self.allocate_calls.fetch_add(1, Ordering::Relaxed);
        if bytes == 0 {
            return Err(BackendError::INVALID_VALUE);
        }
        let i = device.as_usize();
        let capacity = *self.capacity.get(i).ok_or(BackendError::INVALID_VALUE)?;
        let mut st = self.lock();
        if st.fail_next > 0 {
            st.fail_next -= 1;
            return Err(BackendError::OUT_OF_MEMORY);
        }
        let used = st.used[i];
        if used.checked_add(bytes).is_none_or(|n| n > capacity) {
            return Err(BackendError::OUT_OF_MEMORY);
        }
        let span = bytes
            .checked_next_multiple_of(MOCK_GRANULARITY)
            .ok_or(BackendError::OUT_OF_MEMORY)?;
        let base = st.next_address;
        st.next_address = base.checked_add(span).ok_or(BackendError::OUT_OF_MEMORY)?;
        st.used[i] = used + bytes;
        st.live.insert(base, (device, context, bytes));
        Ok(DevicePtr(base))
    }

    fn free(
        &self,
        device: DeviceIndex,
        _context: ContextId,
        ptr: DevicePtr,
    ) -> Result<(), BackendError> {
        self.free_calls.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        match st.live.get(&ptr.0) {
            Some(&(d, _, bytes)) if d == device => {
                st.live.remove(&ptr.0);
                st.used[d.as_usize()] -= bytes;
                Ok(())
            }
            _ => Err(BackendError::INVALID_VALUE),
        }
    }

    fn memory_info(&self, device: DeviceIndex) -> Result<MemoryInfo, BackendError> {
        let i = device.as_usize();
        let total = *self.capacity.get(i).ok_or(BackendError::INVALID_VALUE)?;
        let used = self.lock().used[i];
        Ok(MemoryInfo {
            free: total.saturating_sub(used),
            total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mock_hands_out_disjoint_aligned_addresses_and_checks_frees() {
        let m = MockBackend::with_capacity([10 << 20; 16]);
        let (d, c) = (DeviceIndex(0), ContextId(1));
        let a = m.allocate(d, c, 1).unwrap();
        let b = m.allocate(d, c, 3 << 20).unwrap();
        assert_eq!(a.0 % MOCK_GRANULARITY, 0);
        assert!(b.0 >= a.0 + MOCK_GRANULARITY);
        assert_eq!(m.used(d), (3 << 20) + 1);
        assert_eq!(m.allocate(d, c, 7 << 20), Err(BackendError::OUT_OF_MEMORY));
        assert_eq!(m.allocate(d, c, 0), Err(BackendError::INVALID_VALUE));
        assert_eq!(
            m.free(DeviceIndex(1), c, a),
            Err(BackendError::INVALID_VALUE)
        );
        m.free(d, c, a).unwrap();
        assert_eq!(m.free(d, c, a), Err(BackendError::INVALID_VALUE));
        m.fail_next_allocations(1);
        assert_eq!(m.allocate(d, c, 1), Err(BackendError::OUT_OF_MEMORY));
        let info = m.memory_info(d).unwrap();
        assert_eq!(
            info,
            MemoryInfo {
                free: (10 << 20) - (3 << 20),
                total: 10 << 20
            }
        );
        assert_eq!(
            m.allocate(DeviceIndex(16), c, 1),
            Err(BackendError::INVALID_VALUE)
        );
    }
}
