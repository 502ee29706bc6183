//! A global allocator that keeps the bytes a program holds and their high-water mark: the
//! memory a step needs, apart from what the allocator keeps for later (which VmHWM includes).
//!
//! Include it with `#[path = "support/live_bytes.rs"] mod live_bytes;` and install it with
//! `#[global_allocator] static A: live_bytes::Live = live_bytes::Live;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The system allocator, keeping the live bytes and their peak.
pub struct Live;

fn grow(by: usize) {
    let now = LIVE.fetch_add(by as u64, Relaxed) + by as u64;
    PEAK.fetch_max(now, Relaxed);
}

fn shrink(by: usize) {
    LIVE.fetch_sub(by as u64, Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Live {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grow(new_size);
        shrink(layout.size());
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// The most bytes held at once so far, in MiB.
pub fn peak_mb() -> f64 {
    PEAK.load(Relaxed) as f64 / (1 << 20) as f64
}

/// The bytes held now, in MiB.
#[allow(dead_code)]
pub fn live_mb() -> f64 {
    LIVE.load(Relaxed) as f64 / (1 << 20) as f64
}
