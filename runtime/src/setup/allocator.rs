//! glibc's allocator, tuned for candle's allocation pattern in the process itself.
//!
//! candle allocates and frees a tensor-sized buffer for nearly every op. Under glibc's
//! defaults, blocks above the mmap threshold (128 KiB, raised dynamically up to 32 MiB) are
//! mapped fresh and unmapped on free, and freed heap memory above the trim threshold is handed
//! back to the kernel: every step then page-faults its working set in again, which made a step
//! 1.3–2× slower than with `ivme launch`, whose ranks get `MALLOC_MMAP_THRESHOLD_` and
//! `MALLOC_TRIM_THRESHOLD_`. Building an Accelerator now applies the same with `mallopt`, so a
//! program runs equally fast under `cargo run`, `mpirun`, `srun` or the launcher.
//!
//! Left alone: with `IVME_MALLOC_TUNING=0` or the builder's `.malloc_tuning(false)`, for each
//! setting whose glibc variable the environment already sets, and off glibc (a global allocator
//! of the program's own, such as mimalloc, is not glibc's `malloc` and is unaffected).

/// The largest block served from the heap rather than mapped on its own: 32 MiB, what
/// `ivme launch` sets.
pub(crate) const MMAP_THRESHOLD: usize = 32 << 20;

/// What [`tune`] did, for tests and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Tuned {
    /// The mmap threshold was set.
    pub mmap: bool,
    /// The trim threshold was set.
    pub trim: bool,
}

/// Applies the tuning unless `enabled` is false or the environment already chose; see the
/// module docs.
pub(crate) fn tune(enabled: bool) -> Tuned {
    if !enabled {
        return Tuned::default();
    }
    let unset = |name: &str| std::env::var_os(name).is_none();
    let (mmap, trim) = (
        unset("MALLOC_MMAP_THRESHOLD_"),
        unset("MALLOC_TRIM_THRESHOLD_"),
    );
    set(mmap, trim)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set(mmap: bool, trim: bool) -> Tuned {
    // SAFETY: mallopt only changes glibc's allocator parameters; it is safe to call at any
    // time, from any thread.
    let ok = |param, value: usize| unsafe {
        libc::mallopt(param, value.min(i32::MAX as usize) as libc::c_int) == 1
    };
    Tuned {
        mmap: mmap && ok(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        // "Never" in practice: freed memory stays for the next step.
        trim: trim && ok(libc::M_TRIM_THRESHOLD, i32::MAX as usize),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set(_: bool, _: bool) -> Tuned {
    Tuned::default()
}
