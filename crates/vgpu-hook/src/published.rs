//! A value built once and then shared by every thread for the life of the process: "leak a
//! Box, compare-and-swap a pointer, drop the loser".
//!
//! Invariant **P**: the cell holds null or a pointer from `Box::into_raw` of a value that
//! was fully built before the pointer was stored, and a stored pointer is never freed while
//! the cell lives (the hook's cells are statics: never).
//! - [`Published::publish`] builds nothing under a lock: the caller built the value off to
//!   the side; one compare-and-swap from null (release) installs it. Exactly one thread
//!   wins; every thread, winner or loser, returns the winner's value, and a loser's value,
//!   never seen by anyone, is dropped.
//! - [`Published::get`] is one acquire load: a non-null pointer synchronizes with the
//!   publishing swap, so the value's construction happens before every read through it.
//! - [`Published::forget`] (a forked child's handler) stores null: the value is leaked, not
//!   dropped, so references already handed out stay valid, and its locks, which threads
//!   that were not copied may hold, are never touched again.
//!
//! Nothing here blocks or calls the loader, so a cell can be read and published from inside
//! `dlopen` and from a fork handler. Loom model: `loom_tests`.

use std::marker::PhantomData;
use std::ptr;
use std::sync::atomic::AtomicPtr;

use crate::sync::{Ordering, PtrCell};

/// A value published at most once per cell (see the module's invariant **P**).
pub(crate) struct Published<T, C: PtrCell<T> = AtomicPtr<T>> {
    cell: C,
    /// The cell owns a `T` (raw pointer: the `Send`/`Sync` impls below say when it may be
    /// shared).
    _owns: PhantomData<*mut T>,
}

// SAFETY: sharing the cell hands out `&T` to every thread (needs `T: Sync`) and lets any
// thread move a `T` in or drop a losing one (needs `T: Send`).
unsafe impl<T: Send + Sync, C: PtrCell<T> + Sync> Sync for Published<T, C> {}
// SAFETY: moving the cell moves the owned `T`.
unsafe impl<T: Send, C: PtrCell<T> + Send> Send for Published<T, C> {}

impl<T> Published<T> {
    /// An empty cell (usable in a `static`).
    pub(crate) const fn new() -> Self {
        Self {
            cell: AtomicPtr::new(ptr::null_mut()),
            _owns: PhantomData,
        }
    }
}

impl<T> Default for Published<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, C: PtrCell<T>> Published<T, C> {
    /// A cell over `cell`, which must hold null (the loom model's cells).
    #[cfg(all(test, loom))]
    pub(crate) fn over(cell: C) -> Self {
        assert!(cell.load(Ordering::Relaxed).is_null());
        Self {
            cell,
            _owns: PhantomData,
        }
    }

    /// The published value, if any (one acquire load).
    #[inline(always)]
    pub(crate) fn get(&self) -> Option<&T> {
        let p = self.cell.load(Ordering::Acquire);
        // SAFETY: (P) non-null pointers come from `Box::into_raw` of a built value, the
        // acquire load synchronizes with the publishing swap, and they are not freed while
        // `self` lives.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Publishes `value` unless a value is published already; returns the published one.
    pub(crate) fn publish(&self, value: T) -> &T {
        let fresh = Box::into_raw(Box::new(value));
        match self.cell.compare_exchange(
            ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            // SAFETY: (P) just published; not freed while `self` lives.
            Ok(_) => unsafe { &*fresh },
            Err(winner) => {
                // SAFETY: `fresh` came from `Box::into_raw` above and was never shared.
                drop(unsafe { Box::from_raw(fresh) });
                // SAFETY: (P) the winner's pointer; the failed swap's acquire load
                // synchronizes with its publication.
                unsafe { &*winner }
            }
        }
    }

    /// The published value, building and publishing one first if there is none (racing
    /// builders may each build; one value wins).
    #[inline]
    pub(crate) fn get_or_publish(&self, build: impl FnOnce() -> T) -> &T {
        match self.get() {
            Some(v) => v,
            None => self.publish(build()),
        }
    }

    /// Empties the cell, leaking the value (a forked child's handler: an atomic store only).
    pub(crate) fn forget(&self) {
        self.cell.store(ptr::null_mut(), Ordering::Release);
    }
}

impl<T, C: PtrCell<T>> Drop for Published<T, C> {
    fn drop(&mut self) {
        // Only cells that are not statics drop (tests): nobody can hold a reference now.
        let p = self.cell.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: (P) from `Box::into_raw`; `&mut self` means no reference is left.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

impl<T: std::fmt::Debug, C: PtrCell<T>> std::fmt::Debug for Published<T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Published").field(&self.get()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    /// Counts its drops.
    struct Counted(u64, Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_first_value_wins_and_a_later_one_is_dropped() {
        let drops = Arc::new(AtomicUsize::new(0));
        let cell = Published::new();
        assert!(cell.get().is_none());
        assert_eq!(cell.publish(Counted(1, drops.clone())).0, 1);
        assert_eq!(cell.publish(Counted(2, drops.clone())).0, 1, "the winner");
        assert_eq!(drops.load(Ordering::Relaxed), 1, "the loser is dropped");
        assert_eq!(cell.get().map(|c| c.0), Some(1));
        drop(cell);
        assert_eq!(
            drops.load(Ordering::Relaxed),
            2,
            "a dropped cell frees its value"
        );
    }

    #[test]
    fn get_or_publish_builds_only_while_empty() {
        let cell = Published::new();
        assert_eq!(*cell.get_or_publish(|| 7), 7);
        assert_eq!(*cell.get_or_publish(|| panic!("built twice")), 7);
    }

    #[test]
    fn forget_leaks_the_value_and_lets_a_new_one_in() {
        let drops = Arc::new(AtomicUsize::new(0));
        let cell = Published::new();
        let old = cell.publish(Counted(1, drops.clone()));
        cell.forget();
        assert!(cell.get().is_none());
        assert_eq!(cell.publish(Counted(2, drops.clone())).0, 2);
        assert_eq!(old.0, 1, "a forgotten value stays readable");
        drop(cell);
        assert_eq!(drops.load(Ordering::Relaxed), 1, "leaked, never dropped");
    }

    #[test]
    fn racing_threads_all_see_one_value() {
        let drops = Arc::new(AtomicUsize::new(0));
        let cell = Published::new();
        let seen: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|i| {
                    let (cell, drops) = (&cell, drops.clone());
                    s.spawn(move || cell.publish(Counted(i, drops)).0)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(seen.iter().all(|&v| v == seen[0]), "{seen:?}");
        assert_eq!(drops.load(Ordering::Relaxed), 7, "every loser dropped");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Run: `RUSTFLAGS="--cfg loom" cargo test -p vgpu-hook --release --lib loom`.
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicPtr as LoomAtomicPtr;
    use loom::sync::atomic::{AtomicU64, AtomicUsize};

    type Cell<T> = Published<T, LoomAtomicPtr<T>>;

    fn cell<T>() -> Cell<T> {
        Published::over(LoomAtomicPtr::new(ptr::null_mut()))
    }

    /// A value whose content is written after it is created, as a table's fields are
    /// filled in: a reader that gets the pointer without synchronizing with its
    /// publication may read the initial 0.
    struct Built {
        id: AtomicU64,
        drops: Arc<AtomicUsize>,
    }

    impl Built {
        fn new(id: u64, drops: &Arc<AtomicUsize>) -> Self {
            let b = Self {
                id: AtomicU64::new(0),
                drops: drops.clone(),
            };
            b.id.store(id, Ordering::Relaxed);
            b
        }
    }

    impl Drop for Built {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A shared cell, the drop counter of its values, and a thread that publishes
    /// `Built::new(id)` into the cell and returns the id of the value it got back.
    fn cell_and_publisher(
        id: u64,
    ) -> (
        Arc<Cell<Built>>,
        Arc<AtomicUsize>,
        loom::thread::JoinHandle<u64>,
    ) {
        let drops = Arc::new(AtomicUsize::new(0));
        let c = Arc::new(cell::<Built>());
        let publisher = {
            let (c, drops) = (c.clone(), drops.clone());
            loom::thread::spawn(move || {
                c.publish(Built::new(id, &drops)).id.load(Ordering::Relaxed)
            })
        };
        (c, drops, publisher)
    }

    #[test]
    fn loom_racing_publishers_agree_and_exactly_the_loser_is_dropped() {
        loom::model(|| {
            let (c, drops, other) = cell_and_publisher(2);
            let mine = c.publish(Built::new(1, &drops)).id.load(Ordering::Relaxed);
            let theirs = other.join().unwrap();
            assert_eq!(
                mine, theirs,
                "both publishers return the one published value"
            );
            assert!(mine == 1 || mine == 2, "a fully built value, not {mine}");
            assert_eq!(drops.load(Ordering::Relaxed), 1, "the loser, only");
            drop(c);
            assert_eq!(drops.load(Ordering::Relaxed), 2);
        });
    }

    #[test]
    fn loom_a_reader_sees_only_a_fully_built_value() {
        loom::model(|| {
            let (c, _drops, publisher) = cell_and_publisher(7);
            if let Some(v) = c.get() {
                assert_eq!(v.id.load(Ordering::Relaxed), 7, "read before it was built");
            }
            publisher.join().unwrap();
            assert_eq!(c.get().map(|v| v.id.load(Ordering::Relaxed)), Some(7));
        });
    }
}
