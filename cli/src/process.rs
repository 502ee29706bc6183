//! Operating-system helpers for starting and supervising child processes.

use ivme::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

/// How a child ended, as a shell would report it: its exit code, or 128 + the signal that
/// killed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The shell-style code: 0 for success.
    pub code: i32,
    /// The signal that killed the child, if one did.
    pub signal: Option<i32>,
}

impl Outcome {
    /// Reads an [`ExitStatus`].
    pub fn of(status: ExitStatus) -> Outcome {
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(sig) = status.signal() {
                return Outcome {
                    code: 128 + sig,
                    signal: Some(sig),
                };
            }
        }
        Outcome {
            code: status.code().unwrap_or(1),
            signal: None,
        }
    }

    /// A phrase for messages: "exit code 3" or "exit code 137 (killed by signal 9)".
    pub fn describe(&self) -> String {
        match self.signal {
            Some(sig) => format!("exit code {} (killed by signal {sig})", self.code),
            None => format!("exit code {}", self.code),
        }
    }
}

/// Turns a shell-style code into a process exit status that stays non-zero for any failure.
pub fn exit_byte(code: i32) -> u8 {
    match code {
        0 => 0,
        c if (1..=255).contains(&c) => c as u8,
        _ => 1,
    }
}

/// Whether this process runs with root's effective user id (Open MPI refuses root unless told).
pub fn is_root() -> bool {
    #[cfg(unix)]
    {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }
    #[cfg(not(unix))]
    {
        false
    }
}

/// The number of CPUs this process may run on (affinity and cgroup limits included).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The number of physical cores, which Open MPI counts as slots; `None` when unknown.
pub fn physical_cores() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mut cores = std::collections::BTreeSet::new();
    let mut package = String::new();
    for line in info.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key.trim() {
            "physical id" => package = value.trim().to_string(),
            "core id" => {
                cores.insert((package.clone(), value.trim().to_string()));
            }
            _ => {}
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Finds an executable: a name with a `/` is a path (relative to the working directory), any
/// other name is looked up on `path_var` like a shell does. Returns an absolute path.
pub fn find_executable(name: &str, path_var: Option<&str>) -> Result<PathBuf> {
    if name.contains('/') {
        let path = Path::new(name);
        let abs = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir()
                .map_err(|e| Error::io("reading the working directory", e))?
                .join(path)
        };
        return check_executable(name, &abs).map(|()| abs);
    }
    let dirs = path_var.unwrap_or_default();
    let found = std::env::split_paths(dirs)
        .map(|d| d.join(name))
        .find(|p| check_executable(name, p).is_ok());
    found.ok_or_else(|| {
        let hint = if name.ends_with(".rs") {
            " (ivme launches a built program: run `cargo build --release` and pass \
             `./target/release/<name>`)"
        } else {
            ""
        };
        Error::Usage(format!(
            "program `{name}` not found on PATH{hint}; give its path instead, e.g. `./{name}` or \
             `./target/release/{name}`"
        ))
    })
}

fn check_executable(name: &str, path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|_| {
        Error::Usage(format!(
            "program `{name}` does not exist ({}); check the path, or build it first with \
             `cargo build`",
            path.display()
        ))
    })?;
    if meta.is_dir() {
        return Err(Error::Usage(format!(
            "`{name}` is a folder, not a program; give the path of the executable inside it"
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o111 == 0 {
            return Err(Error::Usage(format!(
                "`{name}` is not executable; make it so with `chmod +x {name}`, or launch the \
                 built binary instead"
            )));
        }
    }
    Ok(())
}

/// Quotes one word for a POSIX shell, leaving plain words bare.
pub fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Joins words into one shell command line.
pub fn shell_join<S: AsRef<str>>(words: &[S]) -> String {
    words
        .iter()
        .map(|w| shell_quote(w.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Makes `cmd`'s child receive SIGTERM when this process dies, so a killed launcher or rank
/// wrapper never leaves orphaned ranks behind.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid is async-signal-safe; the pre_exec closure only makes raw syscalls.
        let parent = unsafe { libc::getpid() };
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() != parent {
                    libc::_exit(143);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

static CHILD: AtomicI32 = AtomicI32::new(0);
static STOPPED_BY: AtomicI32 = AtomicI32::new(0);
static PREEMPTED_BY: AtomicI32 = AtomicI32::new(0);
/// The signals taken as a preemption, one bit per signal number.
static PREEMPT_MASK: AtomicU64 = AtomicU64::new(0);

/// The signal (SIGINT or SIGTERM) that asked this process to stop while it supervised a child.
pub fn stopped_by() -> Option<i32> {
    Some(STOPPED_BY.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// The preemption signal this process received while it supervised a child, if one came.
pub fn preempted_by() -> Option<i32> {
    Some(PREEMPTED_BY.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    let child = CHILD.load(Ordering::SeqCst);
    if (0..64).contains(&sig) && PREEMPT_MASK.load(Ordering::SeqCst) & (1 << sig) != 0 {
        // A preemption is passed on as the relay signal, which mpirun forwards to every rank.
        let _ = PREEMPTED_BY.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
        if child > 0 {
            // SAFETY: kill is async-signal-safe.
            unsafe {
                libc::kill(child, ivme::preempt::RELAY_SIGNAL);
            }
        }
        return;
    }
    STOPPED_BY.store(sig, Ordering::SeqCst);
    // SIGINT from the terminal already reaches the child through the process group, so only
    // SIGTERM, which is aimed at this process alone, is passed on.
    if sig == libc::SIGTERM && child > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe {
            libc::kill(child, libc::SIGTERM);
        }
    }
}

/// How a supervised child is treated on a preemption signal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preempt {
    /// The signals taken as a preemption (passed on as the relay signal, not as a stop).
    pub signals: Vec<i32>,
    /// How long the child may take to stop after one; then it is killed.
    pub grace: Option<Duration>,
}

/// Starts `cmd` and waits for it while this process stays alive through Ctrl-C and passes
/// SIGTERM on, so the caller can still report the outcome and clean up. A signal of
/// `preempt` is passed on as the relay signal; a child still running `grace` (and a few
/// seconds more) after it is killed.
pub fn supervise(cmd: &mut Command, preempt: &Preempt) -> std::io::Result<Outcome> {
    supervise_with(cmd, preempt, |_| {}, None)
}

/// How long mpirun may take to end the job once a rank failed: past it, mpirun is waiting for
/// a machine it cannot reach (a link that went down), and is stopped.
pub const TEARDOWN: Duration = Duration::from_secs(10);

/// [`supervise`], handing the child to `started` right after it starts (to take its piped
/// output, say); with `failed` (whether a rank has recorded a failure), a child still
/// running [`TEARDOWN`] after the first failure is killed.
pub fn supervise_with(
    cmd: &mut Command,
    preempt: &Preempt,
    started: impl FnOnce(&mut Child),
    failed: Option<&dyn Fn() -> bool>,
) -> std::io::Result<Outcome> {
    die_with_parent(cmd);
    let mut child: Child = cmd.spawn()?;
    started(&mut child);
    #[cfg(unix)]
    {
        CHILD.store(child.id() as i32, Ordering::SeqCst);
        let mask = preempt
            .signals
            .iter()
            .filter(|&&s| (0..64).contains(&s))
            .fold(0u64, |m, &s| m | (1 << s));
        PREEMPT_MASK.store(mask, Ordering::SeqCst);
        // Handlers (unlike ignored signals) reset to the default in the exec'd child.
        // SAFETY: the handler only touches atomics and calls kill.
        unsafe {
            let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            let mut signals = vec![libc::SIGINT, libc::SIGTERM];
            signals.extend(preempt.signals.iter().copied());
            for sig in signals {
                // A signal the caller chose to ignore (nohup, a background job) stays ignored.
                if libc::signal(sig, handler) == libc::SIG_IGN {
                    libc::signal(sig, libc::SIG_IGN);
                }
            }
            // A stop asked for before the child existed (between a launcher's restarts)
            // reaches it now.
            if stopped_by().is_some() {
                libc::kill(child.id() as i32, libc::SIGTERM);
            }
        }
    }
    let status = wait_within_grace(&mut child, preempt.grace, failed);
    CHILD.store(0, Ordering::SeqCst);
    status.map(Outcome::of)
}

/// Every process below `root` (children first found, then theirs), from /proc; empty where
/// there is no /proc.
fn descendants(root: u32) -> Vec<u32> {
    let parent_of = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The fields after the command name, which may hold spaces, closed by its last ')'.
        let rest = &stat[stat.rfind(')')? + 2..];
        rest.split(' ').nth(1)?.parse().ok()
    };
    let pids: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| Some((pid, parent_of(pid)?)))
                .collect()
        })
        .unwrap_or_default();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            pids.iter()
                .filter(|(_, p)| *p == parent)
                .map(|(pid, _)| *pid),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Waits for `child`; once a preemption came, for at most `grace` and 5 s more, and once
/// `failed` says a rank failed, for at most [`TEARDOWN`]; then kills it.
fn wait_within_grace(
    child: &mut Child,
    grace: Option<Duration>,
    failed: Option<&dyn Fn() -> bool>,
) -> std::io::Result<ExitStatus> {
    if grace.is_none() && failed.is_none() {
        return child.wait();
    }
    let mut preempted_at: Option<std::time::Instant> = None;
    let mut failed_at: Option<std::time::Instant> = None;
    for tick in 0u64.. {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if let (Some(grace), Some(_)) = (grace, preempted_by()) {
            let at = *preempted_at.get_or_insert_with(std::time::Instant::now);
            if at.elapsed() > grace + Duration::from_secs(5) {
                eprintln!(
                    "ivme: the job did not stop within the preemption grace period ({} s); \
                     killing it",
                    grace.as_secs_f64()
                );
                let _ = child.kill();
                return child.wait();
            }
        }
        // The status folder is read ten times a second, not at every tick.
        if let Some(failed) = failed.filter(|_| failed_at.is_none() && tick % 10 == 0) {
            if failed() {
                failed_at = Some(std::time::Instant::now());
            }
        }
        if failed_at.is_some_and(|at| at.elapsed() > TEARDOWN) {
            eprintln!(
                "ivme: mpirun did not end the job within {} s of the first rank failure (it \
                 cannot reach a machine?); stopping it",
                TEARDOWN.as_secs()
            );
            // Its children too: an ssh to an unreachable machine would wait for TCP's
            // own timeout, minutes away.
            for pid in descendants(child.id()) {
                // SAFETY: kill has no memory effects; a pid gone meanwhile is an error ignored.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            let _ = child.kill();
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    unreachable!("the loop above returns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_processes_below_a_child_are_found() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let mut below = Vec::new();
        for _ in 0..100 {
            below = descendants(child.id());
            if below.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(below.len(), 2, "{below:?}");
        for pid in below {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        assert!(child.wait().unwrap().success());
    }

    #[test]
    fn quoting_round_trips_through_sh() {
        let words = ["plain", "two words", "it's", "", "$HOME", "a\"b"];
        let line = format!("printf '%s\\n' {}", shell_join(&words));
        let out = Command::new("sh").arg("-c").arg(&line).output().unwrap();
        let expect: String = words.iter().map(|w| format!("{w}\n")).collect();
        assert_eq!(String::from_utf8(out.stdout).unwrap(), expect);
    }

    #[test]
    fn outcomes_follow_the_shell_convention() {
        let status = Command::new("sh").args(["-c", "exit 3"]).status().unwrap();
        assert_eq!(
            Outcome::of(status),
            Outcome {
                code: 3,
                signal: None
            }
        );
        let status = Command::new("sh")
            .args(["-c", "kill -9 $$"])
            .status()
            .unwrap();
        let o = Outcome::of(status);
        assert_eq!((o.code, o.signal), (137, Some(9)));
        assert!(o.describe().contains("signal 9"));
        assert_eq!(exit_byte(0), 0);
        assert_eq!(exit_byte(3), 3);
        assert_eq!(exit_byte(256), 1);
        assert_eq!(exit_byte(-1), 1);
    }

    #[test]
    fn executables_are_found_on_path_or_by_path() {
        let path = std::env::var("PATH").ok();
        let sh = find_executable("sh", path.as_deref()).unwrap();
        assert!(sh.is_absolute() && sh.ends_with("sh"));
        let msg = find_executable("no-such-program-ivme", path.as_deref())
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not found on PATH"), "{msg}");
        let msg = find_executable("./no/such/file", None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("does not exist"), "{msg}");
        let msg = find_executable("/", None).unwrap_err().to_string();
        assert!(msg.contains("is a folder"), "{msg}");
        let plain = std::env::temp_dir().join(format!("ivme-noexec-{}", std::process::id()));
        std::fs::write(&plain, "data").unwrap();
        let msg = find_executable(plain.to_str().unwrap(), None)
            .unwrap_err()
            .to_string();
        std::fs::remove_file(&plain).unwrap();
        assert!(msg.contains("chmod +x"), "{msg}");
    }
}
