//! Building an Accelerator tunes glibc's allocator for candle, so a program started without
//! `ivme launch` (whose ranks get glibc's variables) is as fast: tensor-sized blocks come from
//! the heap instead of being mapped and unmapped around every op.
//!
//! One test in its own binary: glibc's parameters are process-wide and only ever rise.

/// Bytes glibc holds in blocks it mapped on their own.
fn mapped() -> usize {
    // SAFETY: reads glibc's allocator statistics.
    unsafe { libc::mallinfo2().hblkhd }
}

/// Whether a block of `bytes` was mapped on its own while it lived.
fn mapped_alone(bytes: usize) -> bool {
    let before = mapped();
    let block = std::hint::black_box(vec![1u8; bytes]);
    let during = mapped();
    drop(block);
    during >= before + bytes
}

#[test]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn building_an_accelerator_serves_tensor_sized_blocks_from_the_heap() {
    assert!(
        std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none(),
        "run without glibc's variables: this test checks what the library sets itself"
    );
    // Turned off, glibc's defaults stay: a 4 MiB block is mapped on its own (its free then
    // raises glibc's dynamic threshold to about 4 MiB).
    let off = ivme::Accelerator::builder()
        .cpu(true)
        .malloc_tuning(false)
        .build()
        .unwrap();
    assert!(mapped_alone(4 << 20), "glibc's default maps a 4 MiB block");
    drop(off);
    // On (the default): blocks up to 32 MiB come from the heap.
    let _on = ivme::Accelerator::builder().cpu(true).build().unwrap();
    assert!(
        !mapped_alone(16 << 20),
        "a 16 MiB block is mapped on its own"
    );
}
