//! The allocation table of the process: every live allocation, whatever made it.
//!
//! Entries live in a [`slab::Slab`] (stable [`AllocId`]s, O(1) insert/remove). Every
//! address entry is indexed by its exact base address in a hash map, so a free costs
//! the same with 1 or 100,000 live allocations (HAMi-core walks a linked list). Entries
//! with their own driver allocation are also kept in a `BTreeMap` by base address, so
//! "which allocation contains this address" is one logarithmic range query; the
//! sub-allocations, the numerous small ones, stay out of it and are found through their
//! region instead ([`crate::Allocator::containing`]), which keeps their free path off
//! the tree. Things that are not device addresses (VMM handles, arrays, contexts,
//! modules, graph memory) are indexed by `(kind, handle)`, so one table tracks
//! everything.
//!
//! The table itself is plain data; [`crate::Allocator`] wraps it in its lock.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::backend::{ContextId, DevicePtr};
use crate::ledger::{DeviceIndex, UsageClass};

/// What made an allocation, which decides how it is keyed and which usage class pays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocationKind {
    /// `cuMemAlloc` served straight by the device (size ≥ IPCSIZE, or the fallback).
    Direct,
    /// `cuMemAlloc` served from a region of the sub-allocator.
    SubAllocated,
    /// `cuMemAllocManaged`.
    Managed,
    /// `cuMemAllocPitch`.
    Pitched,
    /// `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` (stream-ordered, from a pool).
    PoolAsync,
    /// `cuMemCreate` physical memory (a `CUmemGenericAllocationHandle`).
    VmmHandle,
    /// `cuArrayCreate` / `cuArray3DCreate` (a `CUarray`).
    Array,
    /// `cuMipmappedArrayCreate` (a `CUmipmappedArray`).
    MipmappedArray,
    /// Graph memory nodes (keyed by the graph exec or node handle, the hook's choice).
    Graph,
    /// A context's own memory (keyed by the `CUcontext`).
    Context,
    /// A loaded module's code and globals (keyed by the `CUmodule`).
    Module,
}

impl AllocationKind {
    /// True for kinds keyed by a device address (freed with `cuMemFree`/`cuMemFreeAsync`).
    pub fn is_address(self) -> bool {
        matches!(
            self,
            Self::Direct | Self::SubAllocated | Self::Managed | Self::Pitched | Self::PoolAsync
        )
    }

    /// The ledger class this kind is accounted in.
    pub fn usage_class(self) -> UsageClass {
        match self {
            Self::Context => UsageClass::Context,
            Self::Module => UsageClass::Module,
            _ => UsageClass::Data,
        }
    }
}

/// Where a live allocation's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Its own driver allocation (direct, or performed by the hook).
    Own,
    /// A run of chunks of a sub-allocator region.
    Chunks {
        /// The region's slot in the allocator.
        region: usize,
        /// First chunk.
        start: u32,
        /// Number of chunks.
        count: u32,
    },
}

/// One live allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// What made it.
    pub kind: AllocationKind,
    /// Its key: the base address for address kinds, the driver handle otherwise.
    pub key: u64,
    /// The device it lives on.
    pub device: DeviceIndex,
    /// The context that owns it.
    pub context: ContextId,
    /// Bytes the program asked for.
    pub requested: u64,
    /// Bytes charged to the ledger for it (0 for sub-allocations, whose region pays).
    pub accounted: u64,
    /// Where its memory comes from.
    pub placement: Placement,
}

impl Allocation {
    /// Base device address (address kinds).
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.key)
    }
}

/// A stable id of a live entry (reused after the entry is removed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocId(pub usize);

/// Inserting a key that is already live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} {key:#x} is already tracked")]
pub struct DuplicateKey {
    /// The kind inserted.
    pub kind: AllocationKind,
    /// The key inserted.
    pub key: u64,
}

/// Hashes driver ids (device addresses, handles, contexts) with one folded multiply
/// (the 128-bit product's halves xored, as foldhash does): addresses are 512-byte or
/// 2 MiB aligned and differ mostly in middle bits, and the high half carries those into
/// the low bits the table indexes by. Four instructions, where splitmix64's finalizer
/// took eleven and SipHash ~100. Not DoS-resistant, and needs not be: the driver, not an
/// attacker, picks the keys.
#[derive(Debug, Default, Clone, Copy)]
pub struct AddressHasher(u64);

impl Hasher for AddressHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let p = u128::from(self.0 ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15;
        (p as u64) ^ ((p >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        // One u64 (an address) hashes as itself; a tuple's parts are rotated apart.
        self.0 = self.0.rotate_left(29) ^ v;
    }
}

/// A hash map keyed by driver ids (addresses, handles, contexts) with [`AddressHasher`].
pub type IdHashMap<K, V> = HashMap<K, V, BuildHasherDefault<AddressHasher>>;

type AddressMap = IdHashMap<u64, usize>;

/// Every live allocation of the process, indexed by address and by handle.
#[derive(Debug, Default)]
pub struct AllocationTable {
    entries: slab::Slab<Allocation>,
    /// Every address entry by exact base.
    by_address: AddressMap,
    /// Address entries with their own driver allocation, ordered, for range queries.
    ranges: BTreeMap<u64, usize>,
    by_handle: IdHashMap<(AllocationKind, u64), usize>,
}

impl AllocationTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of live entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Track `a`. Address kinds share one namespace of base addresses; each handle kind
    /// has its own.
    #[inline]
    pub fn insert(&mut self, a: Allocation) -> Result<AllocId, DuplicateKey> {
        let dup = DuplicateKey {
            kind: a.kind,
            key: a.key,
        };
        if a.kind.is_address() {
            // One hash probe: the entry API both checks and inserts.
            let std::collections::hash_map::Entry::Vacant(v) = self.by_address.entry(a.key) else {
                return Err(dup);
            };
            let id = self.entries.insert(a);
            v.insert(id);
            if a.placement == Placement::Own {
                self.ranges.insert(a.key, id);
            }
            Ok(AllocId(id))
        } else {
            match self.by_handle.entry((a.kind, a.key)) {
                std::collections::hash_map::Entry::Occupied(_) => Err(dup),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let id = self.entries.insert(a);
                    v.insert(id);
                    Ok(AllocId(id))
                }
            }
        }
    }

    /// The entry `id`.
    pub fn get(&self, id: AllocId) -> Option<&Allocation> {
        self.entries.get(id.0)
    }

    /// The address entry whose base is exactly `ptr`.
    pub fn get_address(&self, ptr: DevicePtr) -> Option<(AllocId, &Allocation)> {
        let &id = self.by_address.get(&ptr.0)?;
        self.entries.get(id).map(|a| (AllocId(id), a))
    }

    /// The handle entry `(kind, handle)`.
    pub fn get_handle(&self, kind: AllocationKind, handle: u64) -> Option<(AllocId, &Allocation)> {
        let &id = self.by_handle.get(&(kind, handle))?;
        self.entries.get(id).map(|a| (AllocId(id), a))
    }

    /// The entry with its own driver allocation whose `[base, base + max(requested, 1))`
    /// contains `addr`. Sub-allocations are not searched here: their region knows them
    /// ([`crate::Allocator::containing`] asks both).
    pub fn containing(&self, addr: DevicePtr) -> Option<(AllocId, &Allocation)> {
        let (_, &id) = self.ranges.range(..=addr.0).next_back()?;
        let a = self.entries.get(id)?;
        (addr.0 - a.key < a.requested.max(1)).then_some((AllocId(id), a))
    }

    /// Remove the address entry whose base is exactly `ptr`.
    #[inline]
    pub fn remove_address(&mut self, ptr: DevicePtr) -> Option<Allocation> {
        let id = self.by_address.remove(&ptr.0)?;
        let a = self.entries.try_remove(id)?;
        if a.placement == Placement::Own {
            self.ranges.remove(&ptr.0);
        }
        Some(a)
    }

    /// Remove the handle entry `(kind, handle)`.
    pub fn remove_handle(&mut self, kind: AllocationKind, handle: u64) -> Option<Allocation> {
        let id = self.by_handle.remove(&(kind, handle))?;
        self.entries.try_remove(id)
    }

    /// Remove whichever entry `(kind, key)` names (address kinds must match `kind`).
    pub fn remove(&mut self, kind: AllocationKind, key: u64) -> Option<Allocation> {
        if kind.is_address() {
            let &id = self.by_address.get(&key)?;
            if self.entries.get(id)?.kind != kind {
                return None;
            }
            self.remove_address(DevicePtr(key))
        } else {
            self.remove_handle(kind, key)
        }
    }

    /// Remove and return every entry of `context` (O(n): contexts die rarely).
    pub fn drain_context(&mut self, context: ContextId) -> Vec<Allocation> {
        let ids: Vec<usize> = self
            .entries
            .iter()
            .filter(|(_, a)| a.context == context)
            .map(|(id, _)| id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let a = self.entries.remove(id);
            if a.kind.is_address() {
                self.by_address.remove(&a.key);
                self.ranges.remove(&a.key);
            } else {
                self.by_handle.remove(&(a.kind, a.key));
            }
            out.push(a);
        }
        out
    }

    /// Every live entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (AllocId, &Allocation)> {
        self.entries.iter().map(|(id, a)| (AllocId(id), a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(kind: AllocationKind, key: u64, requested: u64, ctx: u64) -> Allocation {
        Allocation {
            kind,
            key,
            device: DeviceIndex(0),
            context: ContextId(ctx),
            requested,
            accounted: requested,
            placement: Placement::Own,
        }
    }

    #[test]
    fn addresses_and_handles_are_separate_namespaces() {
        let mut t = AllocationTable::new();
        let a = t
            .insert(entry(AllocationKind::Direct, 0x1000, 0x100, 1))
            .unwrap();
        t.insert(entry(AllocationKind::Array, 0x1000, 64, 1))
            .unwrap();
        t.insert(entry(AllocationKind::VmmHandle, 0x1000, 64, 1))
            .unwrap();
        assert_eq!(
            t.insert(entry(AllocationKind::Managed, 0x1000, 1, 1)),
            Err(DuplicateKey {
                kind: AllocationKind::Managed,
                key: 0x1000
            })
        );
        assert_eq!(t.len(), 3);
        assert_eq!(t.get_address(DevicePtr(0x1000)).unwrap().0, a);
        assert_eq!(t.containing(DevicePtr(0x10ff)).unwrap().0, a);
        assert!(t.containing(DevicePtr(0x1100)).is_none());
        assert!(t.containing(DevicePtr(0xfff)).is_none());
        assert!(
            t.remove(AllocationKind::Managed, 0x1000).is_none(),
            "kind must match"
        );
        assert_eq!(
            t.remove(AllocationKind::Array, 0x1000).unwrap().kind,
            AllocationKind::Array
        );
        assert!(t.get_handle(AllocationKind::Array, 0x1000).is_none());
        assert!(t.get_handle(AllocationKind::VmmHandle, 0x1000).is_some());
        assert_eq!(
            t.remove_address(DevicePtr(0x1000)).unwrap().requested,
            0x100
        );
        assert!(t.remove_address(DevicePtr(0x1000)).is_none());
        assert_eq!(t.len(), 1);
    }

    /// Aligned addresses must spread over the low bits the hash table indexes by (one
    /// multiply alone would leave them all zero and put every address in one bucket).
    #[test]
    fn aligned_addresses_spread_over_low_hash_bits() {
        use std::hash::BuildHasher;
        let build = BuildHasherDefault::<AddressHasher>::default();
        for align in [512u64, 2 << 20] {
            let mut seen = std::collections::HashSet::new();
            for i in 0..4096u64 {
                seen.insert(build.hash_one(0x7f00_0000_0000 + i * align) & 0xfff);
            }
            // 4096 random draws from 4096 buckets fill about 63%; demand over half.
            assert!(seen.len() > 2048, "align {align}: {} buckets", seen.len());
        }
    }

    #[test]
    fn drain_context_takes_only_that_context() {
        let mut t = AllocationTable::new();
        for i in 0..10u64 {
            t.insert(entry(AllocationKind::Direct, 0x1000 * (i + 1), 16, i % 2))
                .unwrap();
            t.insert(entry(AllocationKind::Module, i, 16, i % 2))
                .unwrap();
        }
        let drained = t.drain_context(ContextId(1));
        assert_eq!(drained.len(), 10);
        assert!(drained.iter().all(|a| a.context == ContextId(1)));
        assert_eq!(t.len(), 10);
        assert!(t.iter().all(|(_, a)| a.context == ContextId(0)));
        assert!(t.get_address(DevicePtr(0x2000)).is_none());
        assert!(t.get_handle(AllocationKind::Module, 1).is_none());
        assert!(t.get_handle(AllocationKind::Module, 2).is_some());
    }
}
