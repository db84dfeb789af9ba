//! The swap gate for driver functions the declaration list does not name (docs/swap.md).
//!
//! The CUDA runtime resolves every driver function through `cuGetProcAddress`, among them
//! dozens that can touch device memory and that the hook does not list (2D and 3D copies,
//! peer copies, stream memory operations, host functions, prefetches, external semaphores).
//! Listing each needs its exact signature here and an implementation in the simulated driver;
//! without a gate such a program could never be swapped out.
//!
//! So while swapping is on, a lookup of such a function answers a *slot* instead of the real
//! pointer: a stub that keeps the caller's arguments as they are (the six integer and eight
//! vector argument registers, `rax`, and the first `STACK_WORDS` (8) words of its stack
//! arguments), passes the gate ([`super::touching`]: memory swapped out comes back first, and
//! no memory moves while the call runs) and inside it calls the real function with those
//! arguments. Signature-agnostic, so it holds for any driver function of at most
//! 6 + `STACK_WORDS` integer-class arguments and 8 floating-point ones that returns a
//! `CUresult` (in CUDA 12.6's `cuda.h` the unlisted touching functions take at most 6).
//!
//! x86-64 Linux only; elsewhere, when the slots run out, or when swapping is off, the lookup
//! answers the real pointer and the process is never swapped out (as before: the refusal
//! names the function).

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots: each distinct real function resolved gets one (CUDA 12.6's `cuda.h` declares about
/// 70 touching functions the list does not name; with their per-thread variants, far fewer
/// than this).
const SLOTS: usize = 512;

/// The real function of each slot handed out (0: not yet, or never).
static REAL: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];

/// Slots handed out so far (may pass [`SLOTS`]: the ones beyond were refused). Atomics only,
/// no lock: a lookup in a child forked while another thread of the parent was handing a slot
/// out must not wait for that thread.
static USED: AtomicUsize = AtomicUsize::new(0);

/// Whether this process may swap (`VGPU_IDLE_SWAP` other than `off`), read once: a lookup
/// can come before the process state is built, so the environment is asked, not the state.
/// A value the state later finds malformed leaves swapping off: the slots then only pass
/// their calls on.
pub(crate) fn may_swap() -> bool {
    static MAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MAY.get_or_init(|| {
        std::env::var(vgpu_env::ENV_IDLE_SWAP)
            .ok()
            .and_then(|v| vgpu_env::SwapTrigger::parse(&v))
            .is_some_and(|t| t != vgpu_env::SwapTrigger::Off)
    })
}

/// The gated slot for the real function `real` (the same slot for the same function, but for
/// two threads resolving it at once), or
/// `None` where there is none (another architecture, or every slot taken).
pub(crate) fn slot_for(real: *mut c_void) -> Option<*mut c_void> {
    let real = real as usize;
    if real == 0 || !arch::SUPPORTED {
        return None;
    }
    let used = USED.load(Ordering::Acquire).min(SLOTS);
    if let Some(i) = (0..used).find(|&i| REAL[i].load(Ordering::Acquire) == real) {
        return Some(arch::slot_addr(i));
    }
    // Two threads resolving the same function at once may take two slots: both work.
    let i = USED.fetch_add(1, Ordering::AcqRel);
    if i >= SLOTS {
        return None;
    }
    // Release: a call through the slot, and a later lookup, see its target.
    REAL[i].store(real, Ordering::Release);
    Some(arch::slot_addr(i))
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod arch {
    use std::sync::atomic::Ordering;

    use vgpu_cuda_abi::CUresult;

    pub(super) const SUPPORTED: bool = true;

    /// Stack words passed on: the arguments beyond the sixth integer-class one.
    const STACK_WORDS: usize = 8;

    /// What a slot's stub saved of its caller's registers (its layout is the stub's).
    #[repr(C)]
    struct Saved {
        /// `rdi`, `rsi`, `rdx`, `rcx`, `r8`, `r9`, `rax`, and padding.
        int: [u64; 8],
        /// `xmm0`–`xmm7`.
        vector: [[u64; 2]; 8],
    }

    /// A slot's call: the gate around the real function, called with the caller's arguments.
    ///
    /// # Safety
    /// Only the stubs call it, with their slot, their saved registers and their caller's stack
    /// arguments.
    unsafe extern "C" fn dispatch(slot: u32, saved: *const Saved, stack: *const u64) -> CUresult {
        crate::ffi::guard("a driver function gated by its slot", || {
            let real = super::REAL
                .get(slot as usize)
                .map_or(0, |r| r.load(Ordering::Acquire));
            if real == 0 {
                // Never handed out: nothing to call.
                return CUresult::UNKNOWN;
            }
            crate::ffi::code(crate::swap::touching(|| {
                // SAFETY: `real` is the driver function this slot was handed out for, called
                // with the registers and stack words its caller passed (see the module's docs).
                unsafe { vgpu_unlisted_invoke(real, saved, stack) }.ok()
            }))
        })
    }

    // The stubs, 16 bytes apart (15 used): each puts its slot in r11 (neither an argument nor a
    // callee-saved register) and jumps to the common part, which saves the argument
    // registers, and calls `dispatch(slot, saved, the caller's stack arguments)`; its answer
    // is the call's. `vgpu_unlisted_invoke(real, saved, stack)` puts them back, copies the
    // stack words and calls `real`. Stack alignment: 16 at every call.
    std::arch::global_asm!(
        ".pushsection .text.vgpu_unlisted,\"ax\",@progbits",
        // A frame on rbp, with its unwind information.
        ".macro vgpu_unlisted_frame",
        "pushq %rbp",
        ".cfi_def_cfa_offset 16",
        ".cfi_offset %rbp, -16",
        "movq %rsp, %rbp",
        ".cfi_def_cfa_register %rbp",
        ".endm",
        ".p2align 4",
        ".globl vgpu_unlisted_slots",
        ".hidden vgpu_unlisted_slots",
        "vgpu_unlisted_slots:",
        ".set vgpu_unlisted_i, 0",
        ".rept {slots}",
        // A landing pad for indirect calls where control-flow enforcement is on (a no-op
        // elsewhere): the program calls a slot through a pointer.
        "endbr64",
        "movl $vgpu_unlisted_i, %r11d",
        "jmp vgpu_unlisted_common",
        ".p2align 4",
        ".set vgpu_unlisted_i, vgpu_unlisted_i + 1",
        ".endr",
        "",
        ".p2align 4",
        "vgpu_unlisted_common:",
        ".cfi_startproc",
        "vgpu_unlisted_frame",
        "subq $192, %rsp",
        "movq %rdi, 0(%rsp)",
        "movq %rsi, 8(%rsp)",
        "movq %rdx, 16(%rsp)",
        "movq %rcx, 24(%rsp)",
        "movq %r8, 32(%rsp)",
        "movq %r9, 40(%rsp)",
        "movq %rax, 48(%rsp)",
        ".irp n, 0, 1, 2, 3, 4, 5, 6, 7",
        "movdqu %xmm\\n, 64+16*\\n(%rsp)",
        ".endr",
        "movl %r11d, %edi",
        "movq %rsp, %rsi",
        "leaq 16(%rbp), %rdx",
        "call {dispatch}@PLT",
        "leave",
        ".cfi_def_cfa %rsp, 8",
        "ret",
        ".cfi_endproc",
        "",
        ".p2align 4",
        ".globl vgpu_unlisted_invoke",
        ".hidden vgpu_unlisted_invoke",
        "vgpu_unlisted_invoke:",
        ".cfi_startproc",
        "vgpu_unlisted_frame",
        "pushq %rbx",
        "pushq %r12",
        ".cfi_offset %rbx, -24",
        ".cfi_offset %r12, -32",
        "subq ${stack_bytes}, %rsp",
        "movq %rdi, %r10",
        "movq %rsi, %rbx",
        "movq %rdx, %r12",
        "xorl %ecx, %ecx",
        "2:",
        "movq (%r12,%rcx,8), %rax",
        "movq %rax, (%rsp,%rcx,8)",
        "incl %ecx",
        "cmpl ${stack_words}, %ecx",
        "jb 2b",
        ".irp n, 0, 1, 2, 3, 4, 5, 6, 7",
        "movdqu 64+16*\\n(%rbx), %xmm\\n",
        ".endr",
        "movq 0(%rbx), %rdi",
        "movq 8(%rbx), %rsi",
        "movq 16(%rbx), %rdx",
        "movq 24(%rbx), %rcx",
        "movq 32(%rbx), %r8",
        "movq 40(%rbx), %r9",
        "movq 48(%rbx), %rax",
        "call *%r10",
        "leaq -16(%rbp), %rsp",
        "popq %r12",
        "popq %rbx",
        "popq %rbp",
        ".cfi_def_cfa %rsp, 8",
        "ret",
        ".cfi_endproc",
        ".popsection",
        slots = const super::SLOTS,
        stack_words = const STACK_WORDS,
        stack_bytes = const STACK_WORDS * 8,
        dispatch = sym dispatch,
        options(att_syntax),
    );

    unsafe extern "C" {
        static vgpu_unlisted_slots: [u8; super::SLOTS * 16];
        fn vgpu_unlisted_invoke(real: usize, saved: *const Saved, stack: *const u64) -> CUresult;
    }

    /// The address of slot `index`'s stub.
    pub(super) fn slot_addr(index: usize) -> *mut std::ffi::c_void {
        // Only the address of the stubs' code is taken, never read through here.
        let base = std::ptr::addr_of!(vgpu_unlisted_slots) as usize;
        (base + 16 * index) as *mut std::ffi::c_void
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod arch {
    pub(super) const SUPPORTED: bool = false;

    pub(super) fn slot_addr(_index: usize) -> *mut std::ffi::c_void {
        std::ptr::null_mut()
    }
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use vgpu_cuda_abi::CUresult;

    static SEEN: AtomicU64 = AtomicU64::new(0);

    /// Ten integer and three floating-point arguments, four of them on the stack: every
    /// one must arrive as the caller passed it.
    #[allow(clippy::too_many_arguments)]
    extern "C" fn many(
        a: u64,
        b: u32,
        c: u64,
        x: f64,
        d: u16,
        e: u64,
        f: u64,
        y: f32,
        g: u64,
        h: u64,
        i: u8,
        z: f64,
        j: u64,
    ) -> CUresult {
        let ints = [
            a,
            u64::from(b),
            c,
            u64::from(d),
            e,
            f,
            g,
            h,
            u64::from(i),
            j,
        ];
        let sum = ints.iter().enumerate().fold(0u64, |s, (k, v)| {
            s.wrapping_add(v.wrapping_mul(k as u64 + 1))
        });
        let floats = (x * 1000.0) as u64 + (f64::from(y) * 100.0) as u64 + (z * 10.0) as u64;
        SEEN.store(sum ^ (floats << 40), Ordering::SeqCst);
        CUresult(sum as u32 & 0xff)
    }

    type Many =
        extern "C" fn(u64, u32, u64, f64, u16, u64, u64, f32, u64, u64, u8, f64, u64) -> CUresult;

    extern "C" fn one(a: u64) -> CUresult {
        CUresult(a as u32 + 1)
    }

    /// A child forked while another thread looks slots up gets its own at once (nothing of
    /// the parent's thread can be held in the child).
    #[test]
    fn a_child_forked_while_slots_are_looked_up_gets_one_at_once() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let stop = Arc::new(AtomicBool::new(false));
        let busy = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = slot_for(one as *mut c_void);
                }
            })
        };
        let mut stuck = 0;
        for _ in 0..200 {
            // SAFETY: the child only looks a slot up (no allocation, no lock) and `_exit`s.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let ok = slot_for(many as *mut c_void).is_some();
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) };
            }
            assert!(pid > 0, "fork failed");
            let start = std::time::Instant::now();
            let mut status = 0;
            loop {
                // SAFETY: our own child, a valid out-pointer.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    assert_eq!(libc::WEXITSTATUS(status), 0);
                    break;
                }
                if start.elapsed() > std::time::Duration::from_secs(2) {
                    stuck += 1;
                    // SAFETY: our own child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        stop.store(true, Ordering::Relaxed);
        busy.join().unwrap();
        assert_eq!(stuck, 0, "children stuck in a lookup");
    }

    /// Also that the stubs are 16 bytes apart, as `slot_addr` counts (a slot past the first
    /// reaches its own function).
    #[test]
    fn each_function_has_its_own_slot() {
        let a = slot_for(one as *mut c_void).unwrap();
        let b = slot_for(many as *mut c_void).unwrap();
        assert_ne!(a, b);
        // SAFETY: the slot stands for `one`, whose type this is.
        let through: extern "C" fn(u64) -> CUresult = unsafe { std::mem::transmute(a) };
        assert_eq!(through(41), CUresult(42));
    }

    #[test]
    fn a_slot_passes_every_argument_and_the_answer_through() {
        let direct_answer = many(1, 2, 3, 1.5, 4, 5, 6, 2.25, 7, 8, 9, 3.5, u64::MAX - 3);
        let direct = SEEN.swap(0, Ordering::SeqCst);
        let slot = slot_for(many as *mut c_void).expect("a slot on x86-64");
        assert_eq!(
            slot_for(many as *mut c_void),
            Some(slot),
            "one slot per function"
        );
        // SAFETY: the slot stands for `many`, whose type this is.
        let through: Many = unsafe { std::mem::transmute::<*mut c_void, Many>(slot) };
        let answer = through(1, 2, 3, 1.5, 4, 5, 6, 2.25, 7, 8, 9, 3.5, u64::MAX - 3);
        assert_eq!(answer, direct_answer);
        assert_eq!(SEEN.load(Ordering::SeqCst), direct);
        assert_ne!(direct, 0);
    }
}
