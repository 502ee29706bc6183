//! A global allocator that counts what the program allocates, for the examples that show how
//! much a training step allocates.
//!
//! Include it with `#[path = "support/count_alloc.rs"] mod count_alloc;` and install it with
//! `#[global_allocator] static A: count_alloc::Counting = count_alloc::Counting;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Blocks of at least this many bytes count as large: tensor and gradient buffers.
pub const LARGE: usize = 16 << 10;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static LARGE_ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting every allocation (a growing `realloc` counts as one).
pub struct Counting;

fn count(size: usize) {
    ALLOCS.fetch_add(1, Relaxed);
    BYTES.fetch_add(size as u64, Relaxed);
    if size >= LARGE {
        LARGE_ALLOCS.fetch_add(1, Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            count(new_size);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations so far: how many, how many large, how many bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Allocations of any size.
    pub allocs: u64,
    /// Allocations of at least [`LARGE`] bytes.
    pub large: u64,
    /// Bytes allocated.
    pub bytes: u64,
}

impl Counts {
    /// The counts now.
    pub fn now() -> Counts {
        Counts {
            allocs: ALLOCS.load(Relaxed),
            large: LARGE_ALLOCS.load(Relaxed),
            bytes: BYTES.load(Relaxed),
        }
    }

    /// What was allocated since `earlier`.
    pub fn since(earlier: Counts) -> Counts {
        let now = Counts::now();
        Counts {
            allocs: now.allocs - earlier.allocs,
            large: now.large - earlier.large,
            bytes: now.bytes - earlier.bytes,
        }
    }

    /// Adds `other` to these counts.
    #[allow(dead_code)] // not every example that includes this file adds counts
    pub fn add(&mut self, other: Counts) {
        self.allocs += other.allocs;
        self.large += other.large;
        self.bytes += other.bytes;
    }
}
