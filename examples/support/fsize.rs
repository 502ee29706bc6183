//! Makes this process's file writes fail past a size, for the examples that show what a
//! failed save does. Include it with `#[path = "support/fsize.rs"] mod fsize;`.

/// Makes writes past `bytes` fail with `EFBIG` (instead of the default `SIGXFSZ`), for files
/// this process writes from now on.
pub fn limit_file_size(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: plain system calls on this process, with a valid pointer to a local.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
    }
}
