//! The `cfg(loom)` switch: the atomic words the hook's lock-free protocols are made of.
//!
//! A protocol's state lives in `static`s, which need `std`'s `const` atomics, and its loom
//! model runs the same code on loom's (`RUSTFLAGS="--cfg loom" cargo test -p vgpu-hook
//! --release --lib loom`). So each protocol type is generic over the word traits here, with
//! `std`'s types as the default: [`PtrCell`] (`published`'s cell), [`Flag`] (`worker`'s
//! controls), [`Word`] (`log::rate`'s bucket). Each trait has the methods the protocols call,
//! with `std`'s signatures, forwarded to `std`'s atomic and, in the model, to loom's.

pub(crate) use std::sync::atomic::Ordering;

/// An atomic pointer (`AtomicPtr<T>`).
pub(crate) trait PtrCell<T> {
    fn load(&self, order: Ordering) -> *mut T;
    fn store(&self, p: *mut T, order: Ordering);
    fn compare_exchange(
        &self,
        current: *mut T,
        new: *mut T,
        success: Ordering,
        failure: Ordering,
    ) -> Result<*mut T, *mut T>;
}

/// An atomic flag (`AtomicBool`).
pub(crate) trait Flag {
    fn load(&self, order: Ordering) -> bool;
    fn store(&self, value: bool, order: Ordering);
    fn swap(&self, value: bool, order: Ordering) -> bool;
    /// A read as a read-modify-write: it reads the latest value in the flag's order.
    fn fetch_or(&self, value: bool, order: Ordering) -> bool;
}

/// An atomic 64-bit word (`AtomicU64`).
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u64;
    fn compare_exchange_weak(
        &self,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64>;
    fn fetch_add(&self, value: u64, order: Ordering) -> u64;
    fn swap(&self, value: u64, order: Ordering) -> u64;
}

/// Implements [`PtrCell`], [`Flag`] and [`Word`] for one library's `AtomicPtr`, `AtomicBool`
/// and `AtomicU64` by forwarding to their own methods.
macro_rules! forward_atomics {
    ($ptr:ty, $bool:ty, $u64:ty) => {
        impl<T> PtrCell<T> for $ptr {
            #[inline(always)]
            fn load(&self, order: Ordering) -> *mut T {
                <$ptr>::load(self, order)
            }
            #[inline]
            fn store(&self, p: *mut T, order: Ordering) {
                <$ptr>::store(self, p, order)
            }
            #[inline]
            fn compare_exchange(
                &self,
                current: *mut T,
                new: *mut T,
                success: Ordering,
                failure: Ordering,
            ) -> Result<*mut T, *mut T> {
                <$ptr>::compare_exchange(self, current, new, success, failure)
            }
        }

        impl Flag for $bool {
            #[inline]
            fn load(&self, order: Ordering) -> bool {
                <$bool>::load(self, order)
            }
            #[inline]
            fn store(&self, value: bool, order: Ordering) {
                <$bool>::store(self, value, order)
            }
            #[inline]
            fn swap(&self, value: bool, order: Ordering) -> bool {
                <$bool>::swap(self, value, order)
            }
            #[inline]
            fn fetch_or(&self, value: bool, order: Ordering) -> bool {
                <$bool>::fetch_or(self, value, order)
            }
        }

        impl Word for $u64 {
            #[inline]
            fn load(&self, order: Ordering) -> u64 {
                <$u64>::load(self, order)
            }
            #[inline]
            fn compare_exchange_weak(
                &self,
                current: u64,
                new: u64,
                success: Ordering,
                failure: Ordering,
            ) -> Result<u64, u64> {
                <$u64>::compare_exchange_weak(self, current, new, success, failure)
            }
            #[inline]
            fn fetch_add(&self, value: u64, order: Ordering) -> u64 {
                <$u64>::fetch_add(self, value, order)
            }
            #[inline]
            fn swap(&self, value: u64, order: Ordering) -> u64 {
                <$u64>::swap(self, value, order)
            }
        }
    };
}

forward_atomics!(
    std::sync::atomic::AtomicPtr<T>,
    std::sync::atomic::AtomicBool,
    std::sync::atomic::AtomicU64
);

#[cfg(all(test, loom))]
forward_atomics!(
    loom::sync::atomic::AtomicPtr<T>,
    loom::sync::atomic::AtomicBool,
    loom::sync::atomic::AtomicU64
);
