//! Finding `mpirun`, telling Open MPI from MPICH, and writing its command line.

use crate::process;
use ivme::{Error, Result};
use std::path::PathBuf;
use std::process::Command;

/// The environment variable that names an `mpirun` to use instead of the one on PATH.
pub const MPIRUN_VAR: &str = ivme::env::MPIRUN.name;

/// Which MPI implementation an `mpirun` belongs to; their flags differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Open MPI (`mpirun (Open MPI) 4.1.4`).
    OpenMpi,
    /// MPICH's Hydra launcher, also used by Intel MPI and MVAPICH.
    Mpich,
    /// Something else: only the portable `-np` is passed.
    Unknown,
}

impl Flavor {
    /// Recognises the implementation from the output of `mpirun --version`.
    pub fn from_version(text: &str) -> Flavor {
        let lower = text.to_ascii_lowercase();
        if lower.contains("open mpi") || lower.contains("openrte") {
            Flavor::OpenMpi
        } else if lower.contains("hydra")
            || lower.contains("mpich")
            || lower.contains("intel(r) mpi")
        {
            Flavor::Mpich
        } else {
            Flavor::Unknown
        }
    }

    /// The implementation's name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::OpenMpi => "Open MPI",
            Flavor::Mpich => "MPICH",
            Flavor::Unknown => "an unrecognised MPI",
        }
    }
}

/// An `mpirun` found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mpirun {
    /// Its absolute path.
    pub path: PathBuf,
    /// Its implementation.
    pub flavor: Flavor,
    /// The major version `mpirun --version` printed (4 for Open MPI 4.1.4), when it printed one.
    pub major: Option<u32>,
}

/// The major version in the output of `mpirun --version`: the first word shaped like `4.1.4`.
pub fn version_major(text: &str) -> Option<u32> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '(' || c == ')')
        .filter(|w| w.contains('.'))
        .find_map(|w| {
            let (major, rest) = w.trim_start_matches(['v', 'V']).split_once('.')?;
            let minor_digit = rest.chars().next().is_some_and(|c| c.is_ascii_digit());
            major.parse().ok().filter(|_| minor_digit)
        })
}

const INSTALL_HINT: &str = "install Open MPI (`apt-get install openmpi-bin libopenmpi-dev`, or \
     `brew install open-mpi`), or run a single process with `--num_processes 1`";

impl Mpirun {
    /// Finds `mpirun` (or the one `IVME_MPIRUN` names) and asks it what it is.
    pub fn find(get: impl Fn(&str) -> Option<String>) -> Result<Mpirun> {
        let path = match get(MPIRUN_VAR).filter(|v| !v.is_empty()) {
            Some(explicit) => process::find_executable(&explicit, get("PATH").as_deref())
                .map_err(|e| Error::Setup(format!("{MPIRUN_VAR}={explicit:?}: {e}")))?,
            None => process::find_executable("mpirun", get("PATH").as_deref()).map_err(|_| {
                Error::Setup(format!(
                    "more than one process needs `mpirun`, which is not on PATH; {INSTALL_HINT}"
                ))
            })?,
        };
        let out = Command::new(&path).arg("--version").output().map_err(|e| {
            Error::Setup(format!(
                "cannot run `{} --version`: {e}; {INSTALL_HINT}",
                path.display()
            ))
        })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(Mpirun {
            path,
            flavor: Flavor::from_version(&text),
            major: version_major(&text),
        })
    }
}

/// The loopback network, as Open MPI's `*_if_include` parameters take it.
const LOOPBACK: &str = "127.0.0.1/8";

impl Mpirun {
    /// The byte transfer layers for ranks that all share this machine: shared memory and the
    /// loopback to self, never TCP (whose listener binds every address). Open MPI 5 renamed
    /// the shared-memory one from `vader` to `sm`.
    pub fn local_transports(&self) -> &'static str {
        match self.major {
            Some(m) if m >= 5 => "self,sm",
            _ => "self,vader",
        }
    }
}

/// What the mpirun command line depends on besides the plan itself.
#[derive(Debug, Clone)]
pub struct MpiJob<'a> {
    /// Number of ranks.
    pub num_processes: usize,
    /// The machines as `host:slots,...` for a multi-machine run; `None` keeps every rank on
    /// this machine, talking over loopback only.
    pub hosts: Option<&'a str>,
    /// Whether the launcher runs as root (Open MPI refuses unless told).
    pub as_root: bool,
    /// Whether this machine runs more ranks than it has slots.
    pub oversubscribe: bool,
    /// The variables every rank must see, with their values.
    pub env: &'a [(String, String)],
    /// The command each rank runs.
    pub rank_command: &'a [String],
}

/// Writes the full `mpirun` command line for `job`.
pub fn command_line(mpirun: &Mpirun, job: &MpiJob<'_>) -> Vec<String> {
    let mut argv = vec![mpirun.path.display().to_string()];
    let mut push = |words: &[&str]| argv.extend(words.iter().map(|w| w.to_string()));
    let np = job.num_processes.to_string();
    match mpirun.flavor {
        Flavor::OpenMpi => {
            if job.as_root {
                push(&["--allow-run-as-root"]);
            }
            if job.oversubscribe {
                push(&["--oversubscribe"]);
            }
            // Rayon already splits the cores between ranks; pinning would stack them.
            push(&["--bind-to", "none"]);
            match job.hosts {
                Some(h) => push(&["--host", h]),
                // One machine needs no network. The ranks move bytes through shared memory
                // only (ob1 with the self and shared-memory transports: UCX, libfabric and
                // TCP would each open network endpoints), and mpirun's own channel to them
                // advertises loopback only (a CIDR, since the interface's name differs).
                None => push(&[
                    "--mca",
                    "pml",
                    "ob1",
                    "--mca",
                    "btl",
                    mpirun.local_transports(),
                    "--mca",
                    "oob_tcp_if_include",
                    LOOPBACK,
                ]),
            }
            push(&["-np", &np]);
            // Open MPI exports to remote hosts only the variables named with -x.
            for (k, _) in job.env {
                push(&["-x", k]);
            }
        }
        Flavor::Mpich => {
            push(&["-bind-to", "none"]);
            if let Some(h) = job.hosts {
                push(&["-hosts", h]);
            }
            push(&["-np", &np]);
            // -genv sets a value without switching Hydra away from passing the whole environment.
            for (k, v) in job.env {
                push(&["-genv", k, v]);
            }
        }
        Flavor::Unknown => {
            if let Some(h) = job.hosts {
                push(&["-host", h]);
            }
            push(&["-np", &np]);
        }
    }
    argv.extend(job.rank_command.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job<'a>(env: &'a [(String, String)], cmd: &'a [String]) -> MpiJob<'a> {
        MpiJob {
            num_processes: 4,
            hosts: None,
            as_root: true,
            oversubscribe: true,
            env,
            rank_command: cmd,
        }
    }

    fn mpirun(flavor: Flavor) -> Mpirun {
        Mpirun {
            path: PathBuf::from("/usr/bin/mpirun"),
            flavor,
            major: Some(4),
        }
    }

    #[test]
    fn flavors_are_told_apart_by_their_version_text() {
        assert_eq!(
            Flavor::from_version(
                "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org"
            ),
            Flavor::OpenMpi
        );
        assert_eq!(
            Flavor::from_version("HYDRA build details:\n    Version: 4.0.2"),
            Flavor::Mpich
        );
        assert_eq!(
            Flavor::from_version("Intel(R) MPI Library for Linux"),
            Flavor::Mpich
        );
        assert_eq!(Flavor::from_version("srun 23.02"), Flavor::Unknown);
    }

    #[test]
    fn the_major_version_is_read_from_the_version_text() {
        let major = |t: &str| version_major(t);
        assert_eq!(
            major("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/"),
            Some(4)
        );
        assert_eq!(major("mpirun (Open MPI) 5.0.3"), Some(5));
        assert_eq!(
            major("HYDRA build details:\n    Version:                                 4.0.2"),
            Some(4)
        );
        assert_eq!(major("mpirun (Open MPI) v5.1.0a1"), Some(5));
        assert_eq!(major("no version here."), None);
    }

    #[test]
    fn one_machine_uses_shared_memory_named_for_the_version() {
        let env = vec![];
        let cmd = vec!["prog".to_string()];
        let mut m = mpirun(Flavor::OpenMpi);
        let line = command_line(&m, &job(&env, &cmd)).join(" ");
        assert!(
            line.contains(
                "--mca pml ob1 --mca btl self,vader --mca oob_tcp_if_include 127.0.0.1/8"
            ),
            "{line}"
        );
        assert!(
            !line.contains("tcp,") && !line.contains("btl_tcp"),
            "{line}"
        );
        m.major = Some(5);
        let line = command_line(&m, &job(&env, &cmd)).join(" ");
        assert!(line.contains("--mca btl self,sm "), "{line}");
        // An unknown version keeps the name Open MPI 4 and earlier use.
        m.major = None;
        assert_eq!(m.local_transports(), "self,vader");
    }

    #[test]
    fn open_mpi_gets_its_own_flags_and_forwards_each_variable() {
        let env = vec![("IVME_CPU".to_string(), "1".to_string())];
        let cmd = vec!["ivme".to_string(), "__rank".to_string()];
        let argv = command_line(&mpirun(Flavor::OpenMpi), &job(&env, &cmd));
        assert_eq!(
            argv.join(" "),
            "/usr/bin/mpirun --allow-run-as-root --oversubscribe --bind-to none \
             --mca pml ob1 --mca btl self,vader --mca oob_tcp_if_include 127.0.0.1/8 -np 4 \
             -x IVME_CPU ivme __rank"
        );
        let mut j = job(&env, &cmd);
        j.as_root = false;
        j.oversubscribe = false;
        j.hosts = Some("n1:2,n2:2");
        let line = command_line(&mpirun(Flavor::OpenMpi), &j).join(" ");
        assert!(
            !line.contains("root") && !line.contains("oversubscribe"),
            "{line}"
        );
        assert!(line.contains("--host n1:2,n2:2 -np 4"), "{line}");
        assert!(
            !line.contains("127.0.0.1") && !line.contains("btl") && !line.contains("pml"),
            "several machines need the network: {line}"
        );
    }

    #[test]
    fn mpich_never_sees_open_mpi_flags() {
        let env = vec![("IVME_CPU".to_string(), "1".to_string())];
        let cmd = vec!["prog".to_string()];
        let mut j = job(&env, &cmd);
        j.hosts = Some("n1:2,n2:2");
        let line = command_line(&mpirun(Flavor::Mpich), &j).join(" ");
        assert_eq!(
            line,
            "/usr/bin/mpirun -bind-to none -hosts n1:2,n2:2 -np 4 -genv IVME_CPU 1 prog"
        );
        let line = command_line(&mpirun(Flavor::Unknown), &job(&env, &cmd)).join(" ");
        assert_eq!(line, "/usr/bin/mpirun -np 4 prog");
    }

    #[test]
    fn a_missing_mpirun_says_how_to_install_open_mpi() {
        let msg = Mpirun::find(|k| (k == "PATH").then(|| "/nonexistent-ivme".to_string()))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("apt-get install openmpi-bin libopenmpi-dev"),
            "{msg}"
        );
    }
}
