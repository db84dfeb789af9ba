//! The reservation protocol, generic over its storage so loom can check it.
//!
//! State (per device `d`): a lock word, a `total`, a `limit` (0 = unlimited); per slot `j`:
//! an `ident` word (generation, free/live) and `held[j][d][class]`.
//!
//! Invariant **I**: whenever lock `d` is free, `total[d] == Σ_j Σ_c held[j][d][c]` over the
//! device classes (context, module, data) and `host_total[d] == Σ_j held[j][d][HOST]` (the
//! host-backed class, memory at device `d`'s addresses that lives in host memory).
//! Every write of `total[d]`, `host_total[d]` or any `held[_][d][_]` happens under lock `d`, so:
//! - reserve: under the lock, `total + bytes <= limit` or refuse (nothing written); else
//!   `total += bytes`, then `held += bytes`. Release: `held -= a`, then `total -= a`.
//!   Hence `Σ held <= total <= limit` at every instant (the limit only bounds new reservations).
//!   The host class is bounded by the device's host policy ([`HostPolicy`]) instead, and, with
//!   oversubscription, device and host together by `limit + spill`.
//! - a process killed anywhere inside the lock leaves its owner word in the lock. A waiter that
//!   finds the owner dead (kernel-held liveness lock gone, or its slot reused) takes the lock
//!   over with one CAS (only one waiter can win) and *recomputes* `total[d]` from the `held`
//!   words, which restores **I** whatever step the dead owner stopped at. The owner's partial
//!   effect is then either fully in `held` or not at all, and a dead slot's `held` is given
//!   back by [`normalize`] (under every device lock).
//!
//! Owner words: a slot owner writes `gen << 32 | (j + 1)`; an administrator writes
//! `ADMIN_TAG | epoch`, with a fresh epoch per administrative section, so that a dead
//! administrator's word differs from the current one's and is taken over exactly once.

use crate::layout::CLASSES;

/// The host-backed class's index in [`Store::held`], after the three device classes.
pub(crate) const HOST: usize = CLASSES;
/// Classes the protocol keeps per slot and device: the device ones and [`HOST`].
pub(crate) const LEDGER_CLASSES: usize = CLASSES + 1;

/// How much host-backed memory a device's slots may hold together (read under its lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// Host-backed bytes allowed beyond the device limit (`VGPU_HOST_SPILL`).
    pub spill: u64,
    /// `CUDA_OVERSUBSCRIBE`: host-backed bytes may also stand in for device memory the limit
    /// allows but the GPU has no room for; device plus host then stays within
    /// `limit + spill`, and device reservations check that too.
    pub oversubscribe: bool,
}

impl HostPolicy {
    /// The most host-backed bytes (together with `device` device-resident ones under a
    /// device `limit`, 0 = unlimited) the policy allows.
    fn host_cap(&self, limit: u64, device: u64) -> u64 {
        if !self.oversubscribe {
            self.spill
        } else if limit == 0 {
            u64::MAX
        } else {
            limit.saturating_add(self.spill).saturating_sub(device)
        }
    }
}

/// Which bounds a reservation checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// All of them (a new allocation).
    Full,
    /// Only the device limit: a host-backed allocation moving onto the device, whose bytes
    /// already count against the combined bound (its host bytes are released after the copy).
    DeviceOnly,
    /// None (memory already taken, measured after the fact).
    Unchecked,
}
use crate::sync::{Atomic64, Backoff, Ordering};

/// Set in every administrator's owner word.
pub(crate) const ADMIN_TAG: u64 = 1 << 63;
/// Slot state: free.
pub(crate) const STATE_FREE: u32 = 0;
/// Slot state: registered by a process.
pub(crate) const STATE_LIVE: u32 = 1;

/// Everything the protocol reads or writes. Indices passed in are always in range
/// (`slot < slot_count()`, `device < device_count()`, `class < 3`): the protocol checks any
/// index that comes from shared memory before use.
pub(crate) trait Store {
    type A: Atomic64;
    fn device_count(&self) -> usize;
    fn slot_count(&self) -> usize;
    fn lock_word(&self, device: usize) -> &Self::A;
    fn total(&self, device: usize) -> &Self::A;
    /// The limit in bytes, read fresh on every reservation (the monitor may change it); 0 =
    /// unlimited.
    fn limit(&self, device: usize) -> u64;
    /// `class < LEDGER_CLASSES`; [`HOST`] is the host-backed class.
    fn held(&self, slot: usize, device: usize, class: usize) -> &Self::A;
    /// Host-backed bytes of all slots on `device` (the host class's `total`).
    fn host_total(&self, device: usize) -> &Self::A;
    /// The device's host policy, read fresh on every reservation that it bounds.
    fn host_policy(&self, device: usize) -> HostPolicy {
        HostPolicy {
            spill: self.host_spill(device),
            oversubscribe: self.oversubscribed(device),
        }
    }
    /// [`HostPolicy::spill`] alone.
    fn host_spill(&self, device: usize) -> u64;
    /// [`HostPolicy::oversubscribe`] alone (one load: what a device reservation asks first).
    fn oversubscribed(&self, device: usize) -> bool;
    fn ident(&self, slot: usize) -> &Self::A;
    /// The current administrative epoch.
    fn admin_epoch(&self) -> u64;
    /// Whether the process registered in `slot` is alive (its kernel liveness lock is held).
    /// Must synchronize with the death: values written by the dead process before it died are
    /// visible after this returns `false`.
    fn probe_slot_alive(&self, slot: usize) -> bool;
    /// Whether an administrator currently holds the administrative lock.
    fn probe_admin_alive(&self) -> bool;
    /// Copy slot `slot`'s usage on `device` into any mirror (HAMi's fields). Called under lock
    /// `device`.
    fn mirror(&self, _slot: usize, _device: usize) {}
    /// Rebuild any view of the live slots (HAMi's compacted `procs[]`). Called under every
    /// device lock by an administrator.
    fn rebuild_view(&self) {}
}

/// The owner word a slot's process writes into a device lock.
pub(crate) fn slot_owner_word(slot: usize, generation: u32) -> u64 {
    (u64::from(generation & 0x7fff_ffff) << 32) | (slot as u64 + 1)
}

/// The owner word of the administrator of `epoch`.
pub(crate) fn admin_owner_word(epoch: u64) -> u64 {
    ADMIN_TAG | (epoch & !ADMIN_TAG).max(1)
}

/// An `ident` word.
pub(crate) fn ident_word(generation: u32, state: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(state)
}

/// Split an `ident` word into (generation, state).
pub(crate) fn split_ident(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

/// A simulated death at a named step (tests); production uses [`NoCrash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Died;

/// Where a process may be killed; a test hook that compiles to nothing in production.
pub(crate) trait Crash {
    fn at(&self) -> Result<(), Died>;
}

/// Never crashes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NoCrash;

impl Crash for NoCrash {
    #[inline(always)]
    fn at(&self) -> Result<(), Died> {
        Ok(())
    }
}

/// A refused reservation: nothing was changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub in_use: u64,
    pub limit: u64,
}

/// How a lock was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acquired {
    /// It was free (or became free).
    Clean,
    /// It was taken over from a dead owner and `total` recomputed; dead usage may be waiting
    /// for a sweep.
    TakenOver,
}

/// Whether the owner of a lock word is alive, as seen by `me`.
pub(crate) fn owner_alive<S: Store>(s: &S, owner: u64, me: u64) -> bool {
    if owner & ADMIN_TAG != 0 {
        if me & ADMIN_TAG != 0 {
            // Administrators are mutually exclusive: another administrator's word is stale.
            return false;
        }
        let epoch = s.admin_epoch();
        return owner == admin_owner_word(epoch) && s.probe_admin_alive();
    }
    let index = (owner & 0xffff_ffff) as usize;
    if index == 0 || index > s.slot_count() {
        return false; // not a word any process writes: garbage from a corrupt file
    }
    let slot = index - 1;
    let (generation, state) = split_ident(s.ident(slot).load(Ordering::Acquire));
    if state != STATE_LIVE || slot_owner_word(slot, generation) != owner {
        return false; // the slot was reclaimed or reused since
    }
    // Another thread of our own process: alive by definition.
    owner == me || s.probe_slot_alive(slot)
}

/// Take lock `device` as `me`, taking it over from a dead owner if needed.
pub(crate) fn lock_device<S: Store, C: Crash>(
    s: &S,
    device: usize,
    me: u64,
    crash: &C,
) -> Result<Acquired, Died> {
    let got = lock_device_or_give_up(s, device, me, crash, || false)?;
    Ok(got.unwrap_or(Acquired::Clean)) // never gives up
}

/// [`lock_device`], except that while a live owner holds the lock, `give_up` is asked at every
/// liveness probe (about every 500 µs) and `Ok(None)` returned, without the lock, once it says so.
pub(crate) fn lock_device_or_give_up<S: Store, C: Crash>(
    s: &S,
    device: usize,
    me: u64,
    crash: &C,
    mut give_up: impl FnMut() -> bool,
) -> Result<Option<Acquired>, Died> {
    let lock = s.lock_word(device);
    let mut backoff = Backoff::new();
    let mut current = 0;
    loop {
        match lock.compare_exchange(current, me, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) if current == 0 => return Ok(Some(Acquired::Clean)),
            Ok(_) => {
                // Taken over from the dead owner `current`: no one else can win this CAS.
                crash.at()?;
                recompute_total(s, device);
                crash.at()?;
                return Ok(Some(Acquired::TakenOver));
            }
            Err(owner) => {
                if owner == 0 {
                    current = 0;
                    continue;
                }
                if backoff.probe_due() {
                    if !owner_alive(s, owner, me) {
                        current = owner;
                        continue;
                    }
                    if give_up() {
                        return Ok(None);
                    }
                }
                current = 0;
                backoff.snooze();
            }
        }
    }
}

/// Release lock `device`.
pub(crate) fn unlock_device<S: Store>(s: &S, device: usize) {
    s.lock_word(device).store(0, Ordering::Release);
}

/// Whether `me` is still the owner word of live `slot` (caller holds a device lock, so the
/// answer cannot change until it unlocks: a slot is freed only under every device lock).
fn still_owner<S: Store>(s: &S, slot: usize, me: u64) -> bool {
    let (generation, state) = split_ident(s.ident(slot).load(Ordering::Relaxed));
    state == STATE_LIVE && slot_owner_word(slot, generation) == me
}

/// Release lock `device` only if `me` still holds it. For a thread whose slot was freed (its
/// process left the table) while it waited for the lock: its owner word no longer names a live
/// slot, so another process may already have taken the lock over as a dead owner's.
fn unlock_if_held<S: Store>(s: &S, device: usize, me: u64) {
    let _ = s
        .lock_word(device)
        .compare_exchange(me, 0, Ordering::Release, Ordering::Relaxed);
}

/// The end of a reservation or release (caller holds lock `device`): update HAMi's mirror of
/// `slot`, then unlock; a process may die before, between or after.
fn mirror_and_unlock<S: Store, C: Crash>(
    s: &S,
    slot: usize,
    device: usize,
    crash: &C,
) -> Result<(), Died> {
    crash.at()?;
    s.mirror(slot, device);
    crash.at()?;
    unlock_device(s, device);
    Ok(())
}

/// Restore invariant **I** for `device` (caller holds its lock).
pub(crate) fn recompute_total<S: Store>(s: &S, device: usize) {
    let (mut sum, mut host): (u64, u64) = (0, 0);
    for slot in 0..s.slot_count() {
        for class in 0..CLASSES {
            sum = sum.saturating_add(s.held(slot, device, class).load(Ordering::Relaxed));
        }
        host = host.saturating_add(s.held(slot, device, HOST).load(Ordering::Relaxed));
    }
    s.total(device).store(sum, Ordering::Relaxed);
    s.host_total(device).store(host, Ordering::Relaxed);
}

/// The total `class` counts in on `device`: `host_total` for [`HOST`], else `total`.
fn total_of<S: Store>(s: &S, device: usize, class: usize) -> &S::A {
    if class == HOST {
        s.host_total(device)
    } else {
        s.total(device)
    }
}

/// What a successful lock-protected operation also reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done<T> {
    pub value: T,
    /// A dead owner's lock was taken over on the way.
    pub took_over: bool,
}

/// What one reservation or release is about: `bytes` of `class` on `device`, charged to `slot`,
/// whose process writes the owner word `me`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Charge {
    pub slot: usize,
    pub me: u64,
    pub device: usize,
    /// `< LEDGER_CLASSES`; [`HOST`] is the host-backed class.
    pub class: usize,
    pub bytes: u64,
}

/// Reserve `charge` within every bound ([`reserve_within`] with [`Bound::Full`]; the models'
/// shorthand).
#[cfg(test)]
pub(crate) fn reserve<S: Store, C: Crash>(
    s: &S,
    charge: Charge,
    crash: &C,
) -> Result<Done<Result<u64, Refusal>>, Died> {
    reserve_within(s, charge, Bound::Full, crash)
}

/// `reserve` with the bounds `bound` names: [`Bound::DeviceOnly`] for a move onto the
/// device, [`Bound::Unchecked`] to add bytes that are already taken (measured after the fact),
/// whatever the limit: the total may then end up above it, with the same steps and crash points
/// (an overflow still refuses).
#[inline]
pub(crate) fn reserve_within<S: Store, C: Crash>(
    s: &S,
    charge: Charge,
    bound: Bound,
    crash: &C,
) -> Result<Done<Result<u64, Refusal>>, Died> {
    let Charge {
        slot,
        me,
        device,
        class,
        bytes,
    } = charge;
    let took_over = lock_device(s, device, me, crash)? == Acquired::TakenOver;
    crash.at()?;
    let limit = s.limit(device);
    let device_used = s.total(device).load(Ordering::Relaxed);
    // Read only where it bounds something (the host class, or oversubscription): a device
    // reservation with oversubscription off reads one flag more than before the host class
    // existed. Every write of it happens under this lock, so reading it later reads the same
    // value.
    let host_used = || s.host_total(device).load(Ordering::Relaxed);
    // `cap` bounds this class's total; a refusal reports it as the limit.
    let cap = match bound {
        Bound::Unchecked => u64::MAX,
        _ if class == HOST => s.host_policy(device).host_cap(limit, device_used),
        Bound::Full if limit != 0 && s.oversubscribed(device) => {
            // Device plus host stays within limit + spill: host bytes take device room.
            let policy = HostPolicy {
                spill: s.host_spill(device),
                oversubscribe: true,
            };
            limit.min(policy.host_cap(limit, host_used()))
        }
        Bound::Full | Bound::DeviceOnly => limit_or_max(limit),
    };
    let total = total_of(s, device, class);
    let t = if class == HOST {
        host_used()
    } else {
        device_used
    };
    if !still_owner(s, slot, me) {
        // The process left the table (`depart`) while this thread waited: charge nothing.
        unlock_if_held(s, device, me);
        return Ok(Done {
            value: Err(Refusal { in_use: t, limit }),
            took_over,
        });
    }
    let next = match t.checked_add(bytes) {
        Some(n) if n <= cap => n,
        _ => {
            unlock_device(s, device);
            return Ok(Done {
                value: Err(Refusal { in_use: t, limit }),
                took_over,
            });
        }
    };
    total.store(next, Ordering::Relaxed);
    crash.at()?;
    let held = s.held(slot, device, class);
    held.store(
        held.load(Ordering::Relaxed).saturating_add(bytes),
        Ordering::Relaxed,
    );
    mirror_and_unlock(s, slot, device, crash)?;
    Ok(Done {
        value: Ok(next),
        took_over,
    })
}

fn limit_or_max(limit: u64) -> u64 {
    if limit == 0 { u64::MAX } else { limit }
}

/// Release up to `charge.bytes` of what its slot holds of that class on that device; returns the
/// bytes released (less than asked only if the caller releases more than it holds).
#[inline]
pub(crate) fn release<S: Store, C: Crash>(
    s: &S,
    charge: Charge,
    crash: &C,
) -> Result<Done<u64>, Died> {
    let Charge {
        slot,
        me,
        device,
        class,
        bytes,
    } = charge;
    let took_over = lock_device(s, device, me, crash)? == Acquired::TakenOver;
    crash.at()?;
    if !still_owner(s, slot, me) {
        // The process left the table: its usage was given back already.
        unlock_if_held(s, device, me);
        return Ok(Done {
            value: 0,
            took_over,
        });
    }
    let held = s.held(slot, device, class);
    let h = held.load(Ordering::Relaxed);
    let amount = h.min(bytes);
    held.store(h - amount, Ordering::Relaxed);
    crash.at()?;
    let total = total_of(s, device, class);
    total.store(
        total.load(Ordering::Relaxed).saturating_sub(amount),
        Ordering::Relaxed,
    );
    mirror_and_unlock(s, slot, device, crash)?;
    Ok(Done {
        value: amount,
        took_over,
    })
}

/// Live slots whose process is dead. Death is permanent and, while the caller is the
/// administrator, no slot can be registered, so the answer stays true until [`normalize`].
pub(crate) fn find_dead<S: Store>(s: &S) -> Vec<usize> {
    (0..s.slot_count())
        .filter(|&slot| {
            let (_, state) = split_ident(s.ident(slot).load(Ordering::Acquire));
            state == STATE_LIVE && !s.probe_slot_alive(slot)
        })
        .collect()
}

/// The administrator's sweep (the common case of dead processes): give back the usage of
/// `dead` slots one device at a time (each device lock held only for O(dead) work, relying on
/// invariant **I** at acquisition), then free them and rebuild the view under every device
/// lock. Idempotent; a crash at any step is repaired by the lock takeover (recompute) and the
/// next sweep. Returns how many slots it freed.
pub(crate) fn release_dead<S: Store, C: Crash>(
    s: &S,
    me: u64,
    dead: &[usize],
    crash: &C,
) -> Result<usize, Died> {
    if dead.is_empty() {
        return Ok(0);
    }
    for device in 0..s.device_count() {
        lock_device(s, device, me, crash)?;
        for &slot in dead {
            give_back(s, slot, device, crash)?;
        }
        unlock_device(s, device);
    }
    lock_every_device(s, me, crash)?;
    crash.at()?;
    let mut freed = 0;
    for &slot in dead {
        if free_slot(s, slot) {
            freed += 1;
            crash.at()?;
        }
    }
    rebuild_and_unlock_every_device(s, crash)?;
    Ok(freed)
}

/// A live process leaves the table (normal exit): the administrator `me` takes every device
/// lock *while the leaving process still holds its liveness lock*, so that none of its threads
/// is inside a device lock (they are alive, so their locks are waited for, never taken over);
/// then gives back `slot`'s usage, frees the slot and rebuilds the view. A thread of the
/// leaving process that gets a device lock afterwards finds under it that its owner word no
/// longer names a live slot and changes nothing (`reserve`, `release`). The caller drops the
/// liveness lock after this returns `Ok(true)`.
///
/// `give_up` is asked while a device lock is held by a live owner (for instance the very
/// thread that is exiting, interrupted inside a reservation by a signal handler that calls
/// `exit`); once it says so, every lock taken is released and `Ok(false)` returned with
/// nothing changed. A crash at any step is repaired like one inside [`release_dead`]: the lock
/// takeover recomputes totals, and the next administrator finds `admin_dirty` set.
pub(crate) fn depart<S: Store, C: Crash>(
    s: &S,
    me: u64,
    slot: usize,
    crash: &C,
    mut give_up: impl FnMut() -> bool,
) -> Result<bool, Died> {
    for device in 0..s.device_count() {
        if lock_device_or_give_up(s, device, me, crash, &mut give_up)?.is_none() {
            for d in (0..device).rev() {
                unlock_device(s, d);
            }
            return Ok(false);
        }
    }
    crash.at()?;
    for device in 0..s.device_count() {
        give_back(s, slot, device, crash)?;
    }
    free_slot(s, slot);
    crash.at()?;
    rebuild_and_unlock_every_device(s, crash)?;
    Ok(true)
}

/// The administrator's full repair (after an administrator died inside, or when a sweep is
/// not enough), idempotent and safe to re-run after a crash at any step: under every device
/// lock, give back the usage of `dead` slots (and of any slot not live), free them, recompute
/// every total from the `held` words and rebuild the view. Returns how many slots it freed.
pub(crate) fn normalize<S: Store, C: Crash>(
    s: &S,
    me: u64,
    dead: &[usize],
    crash: &C,
) -> Result<usize, Died> {
    lock_every_device(s, me, crash)?;
    crash.at()?;
    let mut freed = 0;
    for slot in 0..s.slot_count() {
        let ident = s.ident(slot);
        let (generation, state) = split_ident(ident.load(Ordering::Acquire));
        let is_dead = dead.contains(&slot);
        if state == STATE_LIVE && !is_dead {
            continue;
        }
        for device in 0..s.device_count() {
            for class in 0..LEDGER_CLASSES {
                let h = s.held(slot, device, class);
                if h.load(Ordering::Relaxed) != 0 {
                    h.store(0, Ordering::Relaxed);
                    crash.at()?;
                }
            }
        }
        if state != STATE_FREE {
            ident.store(ident_word(generation, STATE_FREE), Ordering::Release);
            freed += 1;
            crash.at()?;
        }
    }
    for device in 0..s.device_count() {
        recompute_total(s, device);
    }
    crash.at()?;
    rebuild_and_unlock_every_device(s, crash)?;
    Ok(freed)
}

/// Give back everything `slot` holds on `device` (caller holds its lock). Held first, then
/// total: a crash in between leaves total too high, which the next locker's takeover
/// recompute corrects.
fn give_back<S: Store, C: Crash>(s: &S, slot: usize, device: usize, crash: &C) -> Result<(), Died> {
    for class in 0..LEDGER_CLASSES {
        let h = s.held(slot, device, class);
        let bytes = h.load(Ordering::Relaxed);
        if bytes != 0 {
            h.store(0, Ordering::Relaxed);
            crash.at()?;
            let total = total_of(s, device, class);
            total.store(
                total.load(Ordering::Relaxed).saturating_sub(bytes),
                Ordering::Relaxed,
            );
            crash.at()?;
        }
    }
    Ok(())
}

/// Mark `slot` free (caller holds every device lock); whether it was not free already.
fn free_slot<S: Store>(s: &S, slot: usize) -> bool {
    let ident = s.ident(slot);
    let (generation, state) = split_ident(ident.load(Ordering::Acquire));
    if state == STATE_FREE {
        return false;
    }
    ident.store(ident_word(generation, STATE_FREE), Ordering::Release);
    true
}

/// Take every device lock, in device order (the one order every multi-lock holder uses).
fn lock_every_device<S: Store, C: Crash>(s: &S, me: u64, crash: &C) -> Result<(), Died> {
    for device in 0..s.device_count() {
        lock_device(s, device, me, crash)?;
    }
    Ok(())
}

/// The end of a change to the slot table (caller holds every device lock): rebuild the view,
/// then unlock in reverse order.
fn rebuild_and_unlock_every_device<S: Store, C: Crash>(s: &S, crash: &C) -> Result<(), Died> {
    s.rebuild_view();
    crash.at()?;
    for device in (0..s.device_count()).rev() {
        unlock_device(s, device);
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod model {
    //! A heap store for unit tests and loom models.

    use super::*;
    use crate::sync::AtomicU64;
    use std::cell::Cell;

    /// Dies at the `n`-th crash point it passes (counting from 0); never if `None`.
    #[derive(Debug)]
    pub(crate) struct CrashAfter {
        left: Cell<Option<u32>>,
    }

    impl CrashAfter {
        pub(crate) fn new(n: Option<u32>) -> Self {
            Self { left: Cell::new(n) }
        }
    }

    impl Crash for CrashAfter {
        fn at(&self) -> Result<(), Died> {
            match self.left.get() {
                Some(0) => Err(Died),
                Some(n) => {
                    self.left.set(Some(n - 1));
                    Ok(())
                }
                None => Ok(()),
            }
        }
    }

    /// The models' [`Charge`]: `bytes` of `class` on device 0 (where every model reserves and
    /// releases) to `slot`, whose owner word is `me`.
    pub(crate) fn charge(slot: usize, me: u64, class: usize, bytes: u64) -> Charge {
        Charge {
            slot,
            me,
            device: 0,
            class,
            bytes,
        }
    }

    impl Charge {
        /// The same charge on `device` (the unit tests'; the loom models use device 0 only).
        #[cfg_attr(loom, allow(dead_code))]
        pub(crate) fn on(self, device: usize) -> Self {
            Self { device, ..self }
        }
    }

    #[derive(Debug)]
    pub(crate) struct ModelStore {
        pub devices: usize,
        pub slots: usize,
        pub locks: Vec<AtomicU64>,
        pub totals: Vec<AtomicU64>,
        pub host_totals: Vec<AtomicU64>,
        pub limits: Vec<AtomicU64>,
        /// Per device: host spill bytes, and 1 for oversubscription.
        pub host_spill: Vec<AtomicU64>,
        pub oversubscribe: Vec<AtomicU64>,
        pub held: Vec<AtomicU64>,
        pub idents: Vec<AtomicU64>,
        /// 1 while the slot's process lives (the kernel liveness lock).
        pub alive: Vec<AtomicU64>,
        pub admin_alive: AtomicU64,
        pub admin_epoch: AtomicU64,
    }

    impl ModelStore {
        pub(crate) fn new(devices: usize, slots: usize, limit: u64) -> Self {
            let v = |n: usize, x: u64| (0..n).map(|_| AtomicU64::new(x)).collect::<Vec<_>>();
            Self {
                devices,
                slots,
                locks: v(devices, 0),
                totals: v(devices, 0),
                host_totals: v(devices, 0),
                limits: v(devices, limit),
                host_spill: v(devices, 0),
                oversubscribe: v(devices, 0),
                held: v(slots * devices * LEDGER_CLASSES, 0),
                idents: v(slots, 0),
                alive: v(slots, 0),
                admin_alive: AtomicU64::new(0),
                admin_epoch: AtomicU64::new(1),
            }
        }

        /// Register `slot` as a live process; returns its owner word.
        pub(crate) fn register(&self, slot: usize) -> u64 {
            let (generation, _) = split_ident(self.idents[slot].load(Ordering::Relaxed));
            let generation = generation + 1;
            self.alive[slot].store(1, Ordering::SeqCst);
            self.idents[slot].store(ident_word(generation, STATE_LIVE), Ordering::SeqCst);
            slot_owner_word(slot, generation)
        }

        /// The process in `slot` dies (the kernel drops its liveness lock).
        pub(crate) fn kill(&self, slot: usize) {
            self.alive[slot].store(0, Ordering::Release);
        }

        pub(crate) fn held_by(&self, slot: usize, device: usize) -> u64 {
            (0..CLASSES)
                .map(|c| self.held(slot, device, c).load(Ordering::SeqCst))
                .sum()
        }

        /// Host-backed bytes `slot` holds on `device` (the unit tests'; the loom models
        /// do not look at the host class).
        #[cfg_attr(loom, allow(dead_code))]
        pub(crate) fn host_held_by(&self, slot: usize, device: usize) -> u64 {
            self.held(slot, device, HOST).load(Ordering::SeqCst)
        }

        /// A store with processes live in slots 0 and 1; returns it and their owner words.
        pub(crate) fn with_two_processes(
            devices: usize,
            slots: usize,
            limit: u64,
        ) -> (Self, u64, u64) {
            let s = Self::new(devices, slots, limit);
            let (a, b) = (s.register(0), s.register(1));
            (s, a, b)
        }

        /// A reservation that must be granted (the models' setup); returns the new total.
        pub(crate) fn hold(&self, charge: Charge) -> u64 {
            reserve(self, charge, &NoCrash).unwrap().value.unwrap()
        }

        /// The administrator of `epoch` finds the dead and runs the full repair.
        pub(crate) fn repair(&self, epoch: u64) -> Result<usize, Died> {
            let dead = find_dead(self);
            normalize(self, admin_owner_word(epoch), &dead, &NoCrash)
        }
    }

    impl Store for ModelStore {
        type A = AtomicU64;
        fn device_count(&self) -> usize {
            self.devices
        }
        fn slot_count(&self) -> usize {
            self.slots
        }
        fn lock_word(&self, device: usize) -> &AtomicU64 {
            &self.locks[device]
        }
        fn total(&self, device: usize) -> &AtomicU64 {
            &self.totals[device]
        }
        fn limit(&self, device: usize) -> u64 {
            self.limits[device].load(Ordering::Relaxed)
        }
        fn held(&self, slot: usize, device: usize, class: usize) -> &AtomicU64 {
            &self.held[(slot * self.devices + device) * LEDGER_CLASSES + class]
        }
        fn host_total(&self, device: usize) -> &AtomicU64 {
            &self.host_totals[device]
        }
        fn host_spill(&self, device: usize) -> u64 {
            self.host_spill[device].load(Ordering::Relaxed)
        }
        fn oversubscribed(&self, device: usize) -> bool {
            self.oversubscribe[device].load(Ordering::Relaxed) != 0
        }
        fn ident(&self, slot: usize) -> &AtomicU64 {
            &self.idents[slot]
        }
        fn admin_epoch(&self) -> u64 {
            self.admin_epoch.load(Ordering::Acquire)
        }
        fn probe_slot_alive(&self, slot: usize) -> bool {
            self.alive[slot].load(Ordering::Acquire) == 1
        }
        fn probe_admin_alive(&self) -> bool {
            self.admin_alive.load(Ordering::Acquire) == 1
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::model::*;
    use super::*;

    /// Every crash point of reserve and release, then recovery by a survivor and a sweep:
    /// the totals equal exactly what the survivor holds.
    #[test]
    fn crash_at_every_step_of_reserve_and_release_recovers_exactly() {
        for op in 0..2 {
            for point in 0..16 {
                let (s, victim, survivor) = ModelStore::with_two_processes(1, 3, 100);
                // The victim holds 30 before the storm.
                s.hold(charge(0, victim, 2, 30));
                let died = if op == 0 {
                    reserve(&s, charge(0, victim, 2, 50), &CrashAfter::new(Some(point))).is_err()
                } else {
                    release(&s, charge(0, victim, 2, 20), &CrashAfter::new(Some(point))).is_err()
                };
                s.kill(0);
                // The survivor must not hang on a lock the victim may hold.
                let got = s.hold(charge(1, survivor, 0, 10));
                assert!(got <= 100);
                assert!(s.totals[0].load(Ordering::SeqCst) <= 100);
                let dead = find_dead(&s);
                assert_eq!(dead, vec![0]);
                let admin = admin_owner_word(1);
                assert_eq!(normalize(&s, admin, &dead, &NoCrash), Ok(1));
                assert_eq!(
                    s.totals[0].load(Ordering::SeqCst),
                    10,
                    "op {op} point {point}"
                );
                assert_eq!(s.held_by(0, 0), 0);
                assert_eq!(s.held_by(1, 0), 10);
                assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
                if !died {
                    break; // past the last crash point
                }
            }
        }
    }

    fn policy(s: &ModelStore, device: usize, spill: u64, oversubscribe: bool) {
        s.host_spill[device].store(spill, Ordering::SeqCst);
        s.oversubscribe[device].store(u64::from(oversubscribe), Ordering::SeqCst);
    }

    /// Whether slot 0 (owner word `me`) is granted `bytes` of `class` on device 0 within `bound`.
    fn fits(s: &ModelStore, me: u64, class: usize, bytes: u64, bound: Bound) -> bool {
        reserve_within(s, charge(0, me, class, bytes), bound, &NoCrash)
            .unwrap()
            .value
            .is_ok()
    }

    /// Off: no host byte. Spill: host bytes within the spill, beside a full device limit.
    /// Oversubscription: device and host together within limit + spill, whichever asks.
    #[test]
    fn host_bytes_are_bounded_by_the_devices_host_policy() {
        let s = ModelStore::new(1, 1, 100);
        let me = s.register(0);
        assert!(!fits(&s, me, HOST, 1, Bound::Full), "off: refused");

        policy(&s, 0, 30, false);
        assert!(fits(&s, me, 2, 100, Bound::Full));
        assert!(fits(&s, me, HOST, 30, Bound::Full), "beyond the full limit");
        assert!(!fits(&s, me, HOST, 1, Bound::Full), "past the spill");
        assert!(
            !fits(&s, me, 2, 1, Bound::Full),
            "device still bounded by the limit"
        );
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 100);
        assert_eq!(s.host_totals[0].load(Ordering::SeqCst), 30);

        let s = ModelStore::new(1, 1, 100);
        let me = s.register(0);
        policy(&s, 0, 0, true);
        assert!(fits(&s, me, 2, 60, Bound::Full));
        assert!(
            !fits(&s, me, HOST, 41, Bound::Full),
            "host + device > limit"
        );
        assert!(fits(&s, me, HOST, 40, Bound::Full));
        assert!(
            !fits(&s, me, 2, 1, Bound::Full),
            "device sees the host bytes"
        );
        // A move onto the device needs only device room: its bytes count already.
        assert!(fits(&s, me, 2, 40, Bound::DeviceOnly));
        release(&s, charge(0, me, HOST, 40), &NoCrash).unwrap();
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 100);
        assert_eq!(s.host_totals[0].load(Ordering::SeqCst), 0);
        assert!(
            !fits(&s, me, 2, 1, Bound::DeviceOnly),
            "a move never passes the limit"
        );

        // Both: the spill extends the combined bound; unlimited devices bound nothing.
        let s = ModelStore::new(1, 1, 100);
        let me = s.register(0);
        policy(&s, 0, 50, true);
        assert!(fits(&s, me, HOST, 150, Bound::Full));
        assert!(!fits(&s, me, 2, 1, Bound::Full));
        let s = ModelStore::new(1, 1, 0);
        let me = s.register(0);
        policy(&s, 0, 0, true);
        assert!(fits(&s, me, HOST, u64::MAX / 2, Bound::Full));
    }

    /// A process killed at every step of a host reservation, a host release, and a move onto
    /// the device (device room reserved, host bytes released): after the survivor's takeover
    /// and the repair, both totals equal exactly what the survivor holds.
    #[test]
    fn crash_at_every_step_of_host_reserve_release_and_move_recovers_exactly() {
        for op in 0..3 {
            for point in 0..24 {
                let s = ModelStore::new(1, 2, 100);
                policy(&s, 0, 0, true);
                let victim = s.register(0);
                let survivor = s.register(1);
                s.hold(charge(0, victim, HOST, 30));
                s.hold(charge(1, survivor, HOST, 5));
                let crash = CrashAfter::new(Some(point));
                let died = match op {
                    0 => reserve(&s, charge(0, victim, HOST, 20), &crash).is_err(),
                    1 => release(&s, charge(0, victim, HOST, 10), &crash).is_err(),
                    _ => {
                        reserve_within(&s, charge(0, victim, 2, 30), Bound::DeviceOnly, &crash)
                            .is_err()
                            || release(&s, charge(0, victim, HOST, 30), &crash).is_err()
                    }
                };
                s.kill(0);
                s.hold(charge(1, survivor, 2, 10));
                let combined =
                    s.totals[0].load(Ordering::SeqCst) + s.host_totals[0].load(Ordering::SeqCst);
                assert!(combined <= 100, "op {op} point {point}: {combined}");
                assert_eq!(s.repair(1), Ok(1));
                assert_eq!(
                    s.totals[0].load(Ordering::SeqCst),
                    10,
                    "op {op} point {point}"
                );
                assert_eq!(
                    s.host_totals[0].load(Ordering::SeqCst),
                    5,
                    "op {op} point {point}"
                );
                assert_eq!(s.host_held_by(0, 0), 0);
                assert_eq!(s.host_held_by(1, 0), 5);
                if !died {
                    break;
                }
            }
        }
    }

    /// The lighter sweep gives back a dead process's host bytes too.
    #[test]
    fn the_sweep_gives_back_host_bytes() {
        let s = ModelStore::new(2, 2, 100);
        policy(&s, 1, 40, false);
        let a = s.register(0);
        let b = s.register(1);
        s.hold(charge(0, a, HOST, 25).on(1));
        s.hold(charge(1, b, HOST, 15).on(1));
        s.kill(0);
        let dead = find_dead(&s);
        assert_eq!(
            release_dead(&s, admin_owner_word(1), &dead, &NoCrash),
            Ok(1)
        );
        assert_eq!(s.host_totals[1].load(Ordering::SeqCst), 15);
        assert_eq!(s.host_held_by(0, 1), 0);
    }

    /// Two devices, three slots: process `a` holds `a_on_0` (class 2) on device 0 and 5
    /// (class 0) on device 1, process `b` holds 7 (class 1) on device 0.
    fn a_on_both_devices_b_on_one(a_on_0: u64) -> (ModelStore, u64, u64) {
        let (s, a, b) = ModelStore::with_two_processes(2, 3, 100);
        s.hold(charge(0, a, 2, a_on_0));
        s.hold(charge(0, a, 0, 5).on(1));
        s.hold(charge(1, b, 1, 7));
        (s, a, b)
    }

    /// After `a`'s administrator work was cut at crash `point`: `b` reserves 3 on device 1
    /// (taking over any lock left behind), the next administrator repairs, and the totals are
    /// exactly `b`'s.
    fn b_reserves_and_the_next_repair_is_exact(s: &ModelStore, b: u64, point: u32) {
        s.hold(charge(1, b, 2, 3).on(1));
        s.admin_epoch.store(2, Ordering::SeqCst);
        s.repair(2).unwrap();
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 7, "point {point}");
        assert_eq!(s.totals[1].load(Ordering::SeqCst), 3, "point {point}");
    }

    /// An administrator killed at any step of its repair: the next one finishes the job, and
    /// a reserving process is never stuck meanwhile.
    #[test]
    fn crash_at_every_step_of_normalize_or_sweep_recovers() {
        for (full, point) in (0..64)
            .map(|p| (true, p))
            .chain((0..64).map(|p| (false, p)))
        {
            let (s, _, b) = a_on_both_devices_b_on_one(40);
            s.kill(0);
            s.admin_alive.store(1, Ordering::SeqCst);
            let dead = find_dead(&s);
            let crash = CrashAfter::new(Some(point));
            let first = if full {
                normalize(&s, admin_owner_word(1), &dead, &crash)
            } else {
                release_dead(&s, admin_owner_word(1), &dead, &crash)
            };
            s.admin_alive.store(0, Ordering::SeqCst);
            // A reserving process takes over any lock the dead administrator left; the next
            // administrator finds the dirty flag and runs the full repair.
            b_reserves_and_the_next_repair_is_exact(&s, b, point);
            assert_eq!(
                split_ident(s.idents[0].load(Ordering::SeqCst)).1,
                STATE_FREE
            );
            if first.is_ok() && point > 0 && !full {
                break; // past the sweep's last crash point
            }
        }
    }

    #[test]
    fn refused_reservation_changes_nothing_and_limit_is_read_each_time() {
        let s = ModelStore::new(1, 2, 100);
        let a = s.register(0);
        assert_eq!(
            reserve(&s, charge(0, a, 2, 60), &NoCrash).unwrap().value,
            Ok(60)
        );
        assert_eq!(
            reserve(&s, charge(0, a, 2, 41), &NoCrash).unwrap().value,
            Err(Refusal {
                in_use: 60,
                limit: 100
            })
        );
        assert_eq!(s.held_by(0, 0), 60);
        s.limits[0].store(50, Ordering::SeqCst); // the monitor shrinks the limit
        assert!(!fits(&s, a, 2, 1, Bound::Full));
        assert_eq!(
            release(&s, charge(0, a, 2, 1000), &NoCrash).unwrap().value,
            60
        );
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 0);
        s.limits[0].store(0, Ordering::SeqCst); // unlimited
        assert_eq!(
            reserve(&s, charge(0, a, 2, u64::MAX), &NoCrash)
                .unwrap()
                .value,
            Ok(u64::MAX)
        );
        assert!(!fits(&s, a, 2, 1, Bound::Full)); // overflow
    }

    /// A process leaves while holding memory: its usage is given back at once, the slot is
    /// free, and a thread of it that still uses the old owner word afterwards changes nothing.
    #[test]
    fn depart_gives_back_at_once_and_late_threads_change_nothing() {
        let (s, a, b) = a_on_both_devices_b_on_one(30);
        assert_eq!(
            depart(&s, admin_owner_word(1), 0, &NoCrash, || false),
            Ok(true)
        );
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 7);
        assert_eq!(s.totals[1].load(Ordering::SeqCst), 0);
        assert_eq!(s.held_by(0, 0) + s.held_by(0, 1), 0);
        assert_eq!(
            split_ident(s.idents[0].load(Ordering::SeqCst)).1,
            STATE_FREE
        );
        // A late reservation and release of the departed process (its liveness lock is still
        // held: the caller drops it after `depart`).
        assert!(!fits(&s, a, 2, 10, Bound::Full));
        assert_eq!(release(&s, charge(0, a, 2, 10), &NoCrash).unwrap().value, 0);
        assert_eq!(s.held_by(0, 0), 0);
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 7);
        assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
        // The survivor is unaffected, and the departed slot can be registered again.
        s.hold(charge(1, b, 1, 93));
        let again = s.register(0);
        assert_ne!(again, a);
        assert!(!fits(&s, again, 2, 1, Bound::Full)); // full
        assert!(!fits(&s, a, 2, 0, Bound::Full));
        assert_eq!(s.held_by(0, 0), 0);
    }

    /// A thread whose slot was freed while it waited must not release a lock that another
    /// process took over meanwhile.
    #[test]
    fn a_stale_owner_never_unlocks_someone_elses_lock() {
        let (s, a, b) = ModelStore::with_two_processes(1, 2, 100);
        depart(&s, admin_owner_word(1), 0, &NoCrash, || false).unwrap();
        s.locks[0].store(b, Ordering::SeqCst);
        unlock_if_held(&s, 0, a);
        assert_eq!(s.locks[0].load(Ordering::SeqCst), b);
        // A lock the stale thread holds itself is released.
        s.locks[0].store(a, Ordering::SeqCst);
        unlock_if_held(&s, 0, a);
        assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
    }

    /// A device lock held by a live owner (for instance the exiting thread itself): `depart`
    /// gives up when told to, changing nothing and releasing the locks it took.
    #[test]
    fn depart_gives_up_on_a_lock_held_by_a_live_owner() {
        let s = ModelStore::new(3, 2, 100);
        let a = s.register(0);
        s.hold(charge(0, a, 2, 30));
        s.locks[1].store(a, Ordering::SeqCst); // a thread of `a` is inside device 1's lock
        let mut asked = 0;
        let r = depart(&s, admin_owner_word(1), 0, &NoCrash, || {
            asked += 1;
            asked > 3
        });
        assert_eq!(r, Ok(false));
        assert!(asked > 3);
        assert_eq!(s.locks[0].load(Ordering::SeqCst), 0, "taken locks released");
        assert_eq!(
            s.locks[1].load(Ordering::SeqCst),
            a,
            "the owner's lock untouched"
        );
        assert_eq!(s.held_by(0, 0), 30);
        assert_eq!(
            split_ident(s.idents[0].load(Ordering::SeqCst)).1,
            STATE_LIVE
        );
    }

    /// The leaving process killed at any step of `depart`: the next administrator's repair
    /// leaves exact totals, and a reserving survivor is never stuck.
    #[test]
    fn crash_at_every_step_of_depart_recovers() {
        for point in 0..32 {
            let (s, _, b) = a_on_both_devices_b_on_one(40);
            s.admin_alive.store(1, Ordering::SeqCst);
            let r = depart(
                &s,
                admin_owner_word(1),
                0,
                &CrashAfter::new(Some(point)),
                || false,
            );
            s.admin_alive.store(0, Ordering::SeqCst);
            s.kill(0);
            b_reserves_and_the_next_repair_is_exact(&s, b, point);
            assert_eq!(s.held_by(0, 0) + s.held_by(0, 1), 0, "point {point}");
            if r.is_ok() {
                break; // past the last crash point
            }
        }
    }

    #[test]
    fn a_charge_over_the_limit_is_held_and_released_like_a_reservation() {
        let s = ModelStore::new(1, 2, 100);
        let a = s.register(0);
        assert_eq!(
            reserve(&s, charge(0, a, 2, 80), &NoCrash).unwrap().value,
            Ok(80)
        );
        assert_eq!(
            reserve_within(&s, charge(0, a, 1, 50), Bound::Unchecked, &NoCrash)
                .unwrap()
                .value,
            Ok(130),
            "already-taken memory is recorded above the limit"
        );
        assert_eq!(s.held_by(0, 0), 130);
        assert!(!fits(&s, a, 2, 1, Bound::Full));
        assert_eq!(
            release(&s, charge(0, a, 1, 50), &NoCrash).unwrap().value,
            50
        );
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 80);
        assert!(
            reserve_within(&s, charge(0, a, 1, u64::MAX), Bound::Unchecked, &NoCrash)
                .unwrap()
                .value
                .is_err(),
            "an overflow is still refused"
        );
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 80);
    }

    #[test]
    fn garbage_owner_words_are_taken_over() {
        let s = ModelStore::new(1, 2, 100);
        let a = s.register(0);
        for garbage in [u64::MAX >> 1, 3 | (7 << 32), 0xffff_ffff, ADMIN_TAG | 99] {
            s.locks[0].store(garbage, Ordering::SeqCst);
            let done = reserve(&s, charge(0, a, 2, 1), &NoCrash).unwrap();
            assert!(done.took_over);
            release(&s, charge(0, a, 2, 1), &NoCrash).unwrap();
        }
        assert_eq!(s.totals[0].load(Ordering::SeqCst), 0);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Run: `RUSTFLAGS="--cfg loom" cargo test -p vgpu-shm --release --lib loom`.
    use super::model::*;
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// Runs a model and returns how many interleavings loom explored.
    fn explore(f: impl Fn() + Sync + Send + 'static) -> usize {
        use std::sync::atomic::{AtomicUsize, Ordering as StdOrdering};
        let count = std::sync::Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        builder().check(move || {
            c.fetch_add(1, StdOrdering::Relaxed);
            f();
        });
        let n = count.load(StdOrdering::Relaxed);
        eprintln!("loom explored {n} interleavings");
        n
    }

    fn builder() -> loom::model::Builder {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.max_branches = 50_000;
        b
    }

    /// Two processes reserve 7 each against a limit of 10: exactly one gets it, the other is
    /// refused with the winner's usage, and nothing else changes.
    #[test]
    fn loom_concurrent_reserves_never_exceed_limit() {
        let n = explore(|| {
            let (s, a, b) = ModelStore::with_two_processes(1, 2, 10);
            let s = Arc::new(s);
            let reserver = |slot: usize, me: u64, s: Arc<ModelStore>| {
                move || {
                    reserve(&*s, charge(slot, me, 2, 7), &NoCrash)
                        .unwrap()
                        .value
                }
            };
            let t1 = thread::spawn(reserver(0, a, s.clone()));
            let t2 = thread::spawn(reserver(1, b, s.clone()));
            assert!(s.totals[0].load(Ordering::Relaxed) <= 10);
            let (r1, r2) = (t1.join().unwrap(), t2.join().unwrap());
            assert!(r1.is_ok() != r2.is_ok(), "exactly one fits: {r1:?} {r2:?}");
            let refusal = r1.err().or(r2.err()).unwrap();
            assert_eq!(
                refusal,
                Refusal {
                    in_use: 7,
                    limit: 10
                }
            );
            assert_eq!(s.totals[0].load(Ordering::SeqCst), 7);
            assert_eq!(s.held_by(0, 0) + s.held_by(1, 0), 7);
            assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
        });
        assert!(n > 1, "the model must explore interleavings");
    }

    /// A reservation races a release on a full device: it succeeds exactly when the release
    /// came first, and the end state adds up either way.
    #[test]
    fn loom_reserve_racing_release_is_exact() {
        let n = explore(|| {
            let (s, a, b) = ModelStore::with_two_processes(1, 2, 10);
            let s = Arc::new(s);
            s.hold(charge(1, b, 1, 10));
            let sa = s.clone();
            let t1 =
                thread::spawn(move || reserve(&*sa, charge(0, a, 2, 5), &NoCrash).unwrap().value);
            let sb = s.clone();
            let t2 =
                thread::spawn(move || release(&*sb, charge(1, b, 1, 5), &NoCrash).unwrap().value);
            assert!(s.totals[0].load(Ordering::Relaxed) <= 10);
            let got = t1.join().unwrap();
            assert_eq!(t2.join().unwrap(), 5);
            match got {
                Ok(total) => assert_eq!(total, 10),
                Err(refusal) => assert_eq!(refusal.in_use, 10),
            }
            let want = if got.is_ok() { 10 } else { 5 };
            assert_eq!(s.totals[0].load(Ordering::SeqCst), want);
            assert_eq!(s.held_by(0, 0) + s.held_by(1, 0), want);
        });
        assert!(n > 1, "the model must explore interleavings");
    }

    /// A process dies at every possible step of a reserve or release while another process
    /// reserves; the survivor never hangs, the limit holds throughout, and after the sweep the
    /// total equals exactly what the survivor holds.
    #[test]
    fn loom_crash_during_reserve_release_recovers_exactly() {
        for op in 0..2u32 {
            for point in 0..5u32 {
                let n = explore(move || {
                    let (s, victim, survivor) = ModelStore::with_two_processes(1, 2, 10);
                    let s = Arc::new(s);
                    s.hold(charge(0, victim, 2, 4));
                    let sv = s.clone();
                    let v = thread::spawn(move || {
                        let crash = CrashAfter::new(Some(point));
                        let _ = if op == 0 {
                            reserve(&*sv, charge(0, victim, 2, 3), &crash).map(|_| ())
                        } else {
                            release(&*sv, charge(0, victim, 2, 4), &crash).map(|_| ())
                        };
                        sv.kill(0);
                    });
                    let ss = s.clone();
                    let w = thread::spawn(move || {
                        let got = reserve(&*ss, charge(1, survivor, 2, 4), &NoCrash)
                            .unwrap()
                            .value;
                        assert!(ss.totals[0].load(Ordering::Relaxed) <= 10);
                        got.is_ok()
                    });
                    assert!(s.totals[0].load(Ordering::Relaxed) <= 10);
                    v.join().unwrap();
                    let survivor_holds = if w.join().unwrap() { 4 } else { 0 };
                    // Any lock the victim died in is taken over by the next user, and that
                    // restores invariant I before any repair.
                    s.hold(charge(1, survivor, 2, 0));
                    assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
                    assert_eq!(
                        s.totals[0].load(Ordering::SeqCst),
                        s.held_by(0, 0) + s.held_by(1, 0)
                    );
                    s.repair(1).unwrap();
                    assert_eq!(s.totals[0].load(Ordering::SeqCst), survivor_holds);
                    assert_eq!(s.held_by(1, 0), survivor_holds);
                });
                assert!(n > 1, "the model must explore interleavings");
            }
        }
    }

    /// Two survivors race for the lock a victim died in (at every step of a reservation):
    /// exactly one takes it over, neither hangs, and the books balance.
    #[test]
    fn loom_two_survivors_race_to_take_over() {
        for point in 0..4u32 {
            let mut b = builder();
            b.preemption_bound = Some(2);
            let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let c = count.clone();
            b.check(move || {
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let s = Arc::new(ModelStore::new(1, 3, 12));
                let victim = s.register(0);
                let _ = reserve(&*s, charge(0, victim, 2, 5), &CrashAfter::new(Some(point)));
                s.kill(0);
                let spawn = |slot: usize, s: Arc<ModelStore>| {
                    let me = slot_owner_word(slot, 1);
                    thread::spawn(move || {
                        let got = reserve(&*s, charge(slot, me, 2, 4), &NoCrash)
                            .unwrap()
                            .value;
                        assert!(s.totals[0].load(Ordering::Relaxed) <= 12);
                        got.is_ok()
                    })
                };
                let ids = [s.register(1), s.register(2)];
                assert_eq!(ids, [slot_owner_word(1, 1), slot_owner_word(2, 1)]);
                let t1 = spawn(1, s.clone());
                let t2 = spawn(2, s.clone());
                let granted = [t1.join().unwrap(), t2.join().unwrap()];
                let held = 4 * granted.iter().filter(|&&g| g).count() as u64;
                assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
                let total = s.totals[0].load(Ordering::SeqCst);
                assert_eq!(total, s.held_by(0, 0) + held);
                s.repair(1).unwrap();
                assert_eq!(s.totals[0].load(Ordering::SeqCst), held);
            });
            assert!(count.load(std::sync::atomic::Ordering::Relaxed) > 1);
        }
    }

    /// A thread of a process reserves and releases while another thread of it leaves the table:
    /// whatever the interleaving, nothing stays charged to the freed slot, the survivor's
    /// usage is exact, and no lock stays held.
    #[test]
    fn loom_leaving_while_a_sibling_thread_reserves() {
        let n = explore(|| {
            let (s, a, b) = ModelStore::with_two_processes(1, 2, 10);
            let s = Arc::new(s);
            s.hold(charge(1, b, 1, 3));
            // The leaving thread is the administrator: it holds the administrative lock
            // (set before the sibling starts, as the kernel's lock is taken before any device lock).
            s.admin_alive.store(1, Ordering::SeqCst);
            let st = s.clone();
            let sibling = thread::spawn(move || {
                let got = reserve(&*st, charge(0, a, 2, 4), &NoCrash).unwrap().value;
                release(&*st, charge(0, a, 2, 4), &NoCrash).unwrap();
                let _ = reserve(&*st, charge(0, a, 2, 2), &NoCrash).unwrap().value;
                got.is_ok()
            });
            assert_eq!(
                depart(&*s, admin_owner_word(1), 0, &NoCrash, || false),
                Ok(true)
            );
            s.admin_alive.store(0, Ordering::SeqCst);
            s.kill(0);
            sibling.join().unwrap();
            assert_eq!(s.locks[0].load(Ordering::SeqCst), 0);
            assert_eq!(s.held_by(0, 0), 0);
            assert_eq!(s.totals[0].load(Ordering::SeqCst), 3);
        });
        assert!(n > 1, "the model must explore interleavings");
    }

    /// The administrator dies at any step of its sweep or its full repair while a process
    /// reserves; the process takes over the administrator's locks, and the next repair leaves
    /// exact totals.
    #[test]
    fn loom_crash_during_sweep_or_repair_recovers() {
        for (full, point) in (0..6u32)
            .map(|p| (true, p))
            .chain((0..6u32).map(|p| (false, p)))
        {
            let n = explore(move || {
                let (s, victim, survivor) = ModelStore::with_two_processes(1, 2, 10);
                let s = Arc::new(s);
                s.hold(charge(0, victim, 2, 6));
                s.kill(0);
                s.admin_alive.store(1, Ordering::SeqCst);
                let sa = s.clone();
                let admin = thread::spawn(move || {
                    let dead = find_dead(&*sa);
                    let crash = CrashAfter::new(Some(point));
                    let _ = if full {
                        normalize(&*sa, admin_owner_word(1), &dead, &crash)
                    } else {
                        release_dead(&*sa, admin_owner_word(1), &dead, &crash)
                    };
                    sa.admin_alive.store(0, Ordering::Release);
                });
                let ss = s.clone();
                let w = thread::spawn(move || {
                    reserve(&*ss, charge(1, survivor, 2, 4), &NoCrash)
                        .unwrap()
                        .value
                        .is_ok()
                });
                admin.join().unwrap();
                let holds = if w.join().unwrap() { 4 } else { 0 };
                s.admin_epoch.store(2, Ordering::SeqCst);
                s.repair(2).unwrap();
                assert_eq!(s.totals[0].load(Ordering::SeqCst), holds);
            });
            assert!(n > 1, "the model must explore interleavings");
        }
    }
}
