//! The config file `ivme config` writes and `ivme launch` reads: where it lives, its keys, and
//! how it is read (strictly: an unknown key or a bad value is an error naming the key, the file
//! and what to write instead).
//!
//! The format is TOML with a `version` key, so a later ivme can tell an old file from a new one
//! instead of misreading it. Every key is optional; what a file leaves out falls back to the
//! launcher's defaults.

use crate::cli;
use ivme::{BufferSync, Error, Precision, Result, Sharding};
use std::path::{Path, PathBuf};

/// The one config format this ivme reads and writes.
pub const VERSION: i64 = 1;

/// The variable that names a config file, between the `--config_file` flag and the default.
pub const CONFIG_VAR: &str = ivme::env::CONFIG.name;

/// The ways ranks can talk to each other that this build launches.
pub const BACKENDS: &[&str] = &["mpi"];

/// The keys a config file may hold, in the order they are written.
pub const KEYS: &[&str] = &[
    "version",
    "num_processes",
    "cpu",
    "mixed_precision",
    "sharding",
    "buffers",
    "gradient_accumulation_steps",
    "backend",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "hosts",
    "hostfile",
    "max_restarts",
];

/// Every launch setting, each optional: one layer of them (the flags, the launcher's
/// environment or the config file; sources.rs stacks the layers). `None` leaves the setting
/// to a weaker layer, or the default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Settings {
    /// Processes in total, over all machines.
    pub num_processes: Option<usize>,
    /// Compute on the CPU even where a GPU is present.
    pub cpu: Option<bool>,
    /// Compute precision.
    pub mixed_precision: Option<Precision>,
    /// ZeRO sharding stage.
    pub sharding: Option<Sharding>,
    /// How buffers agree across processes.
    pub buffers: Option<BufferSync>,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: Option<usize>,
    /// How the ranks talk (one of [`BACKENDS`]).
    pub backend: Option<String>,
    /// Machines in the run.
    pub num_machines: Option<usize>,
    /// This machine's place among them (0 is the main machine).
    pub machine_rank: Option<usize>,
    /// The main machine's address.
    pub main_process_ip: Option<String>,
    /// The port on the main machine for a rendezvous.
    pub main_process_port: Option<u16>,
    /// Every machine's address, the main one first.
    pub hosts: Option<Vec<String>>,
    /// An MPI hostfile listing the machines (relative paths are read from the file's folder).
    pub hostfile: Option<PathBuf>,
    /// How many times `ivme launch` starts a failed job again.
    pub max_restarts: Option<usize>,
    /// The deadline of every collective (a flag or `IVME_COLLECTIVE_TIMEOUT`; no file key).
    pub collective_timeout: Option<std::time::Duration>,
    /// Whether the ranks compare their collectives (a flag or `IVME_DEBUG_SYNC`; no file key).
    pub debug_sync: Option<bool>,
    /// The signals taken as a preemption (a flag or `IVME_PREEMPT_SIGNALS`; no file key).
    pub preempt_signals: Option<String>,
    /// How long a preempted rank may take (a flag or `IVME_PREEMPT_GRACE`; no file key).
    pub preempt_grace: Option<std::time::Duration>,
    /// The launcher's exit code after a preemption (a flag or `IVME_REQUEUE_EXIT_CODE`).
    pub requeue_exit_code: Option<u8>,
}

/// Where the config file in use was found, and why there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file.
    pub path: PathBuf,
    /// How it was chosen: `--config_file`, `IVME_CONFIG` or the default location.
    pub chosen_by: &'static str,
}

impl Location {
    /// Picks the config file: the flag, else `IVME_CONFIG`, else the default location
    /// (`$XDG_CONFIG_HOME/ivme/default_config.toml`, else `~/.config/ivme/default_config.toml`).
    pub fn find(flag: Option<&Path>, get: impl Fn(&str) -> Option<String>) -> Result<Location> {
        if let Some(p) = flag {
            return Ok(Location {
                path: p.to_path_buf(),
                chosen_by: "--config_file",
            });
        }
        if let Some(p) = get(CONFIG_VAR).filter(|v| !v.trim().is_empty()) {
            return Ok(Location {
                path: PathBuf::from(p),
                chosen_by: CONFIG_VAR,
            });
        }
        let base = match get("XDG_CONFIG_HOME").filter(|v| Path::new(v).is_absolute()) {
            Some(xdg) => PathBuf::from(xdg),
            None => match get("HOME").filter(|v| !v.is_empty()) {
                Some(home) => Path::new(&home).join(".config"),
                None => {
                    return Err(Error::Usage(format!(
                        "cannot find the default config location: neither XDG_CONFIG_HOME nor \
                         HOME is set; give `--config_file PATH` or set {CONFIG_VAR}"
                    )))
                }
            },
        };
        Ok(Location {
            path: base.join("ivme").join("default_config.toml"),
            chosen_by: "the default location",
        })
    }

    /// Whether the user named this file explicitly (so a missing file is an error).
    pub fn explicit(&self) -> bool {
        self.chosen_by != "the default location"
    }

    /// Reads the file: `Ok(None)` when a default-location file does not exist.
    pub fn load(&self) -> Result<Option<Settings>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => Settings::parse(&text, &self.path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !self.explicit() => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::Usage(format!(
                "the config file {} (from {}) does not exist; create it with `ivme config \
                 --config_file {}` or `ivme config default --config_file {}`",
                self.path.display(),
                self.chosen_by,
                self.path.display(),
                self.path.display()
            ))),
            Err(e) => Err(Error::io(
                format!("reading the config file {}", self.path.display()),
                e,
            )),
        }
    }
}

fn bad_value(key: &str, value: &toml::Value, path: &Path, want: &str) -> Error {
    let shown = match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Error::config(
        key,
        shown,
        format!(
            "in the config file {}: {want} (or run `ivme config` to rewrite it)",
            path.display()
        ),
    )
}

fn whole(key: &str, v: &toml::Value, path: &Path, min: i64, max: i64) -> Result<i64> {
    match v.as_integer() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ if max == i64::MAX => Err(bad_value(
            key,
            v,
            path,
            &format!("use a whole number of at least {min}"),
        )),
        _ => Err(bad_value(
            key,
            v,
            path,
            &format!("use a whole number from {min} to {max}"),
        )),
    }
}

fn word<'a>(key: &str, v: &'a toml::Value, path: &Path, valid: Option<&[&str]>) -> Result<&'a str> {
    let want = match valid {
        Some(list) => format!("use one of {}", list.join(", ")),
        None => "use a non-empty string without spaces, in quotes".to_string(),
    };
    match v.as_str() {
        Some(s)
            if valid.is_none_or(|l| l.contains(&s))
                && !s.is_empty()
                && !s.contains(char::is_whitespace) =>
        {
            Ok(s)
        }
        _ => Err(bad_value(key, v, path, &want)),
    }
}

impl Settings {
    /// The config `ivme config default` writes: one process on one machine, the CPU unless this
    /// build has CUDA, full precision, no accumulation.
    pub fn sane_default() -> Settings {
        Settings {
            num_processes: Some(1),
            cpu: Some(!cfg!(feature = "cuda")),
            mixed_precision: Some(Precision::No),
            gradient_accumulation_steps: Some(1),
            backend: Some(BACKENDS[0].to_string()),
            num_machines: Some(1),
            ..Settings::default()
        }
    }

    /// Reads a config file's text; `path` names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Settings> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            Error::Usage(format!(
                "the config file {} is not valid TOML: {}; fix it, or rewrite it with `ivme config`",
                path.display(),
                e.to_string().trim_end()
            ))
        })?;
        for key in table.keys() {
            if !KEYS.contains(&key.as_str()) {
                let hint = cli::closest(key, KEYS.iter().copied())
                    .map(|c| format!("did you mean `{c}`? "))
                    .unwrap_or_default();
                return Err(Error::Usage(format!(
                    "the config file {} has an unknown key `{key}`; {hint}the valid keys are: {}",
                    path.display(),
                    KEYS.join(", ")
                )));
            }
        }
        match table.get("version") {
            None => {
                return Err(Error::Usage(format!(
                    "the config file {} has no `version`; add `version = {VERSION}` at the top, or \
                     rewrite it with `ivme config`",
                    path.display()
                )))
            }
            Some(v) if v.as_integer() != Some(VERSION) => {
                return Err(Error::config(
                    "version",
                    v,
                    format!(
                        "the config file {} has a format this ivme ({}) cannot read; it reads \
                         version {VERSION}: rewrite the file with `ivme config`",
                        path.display(),
                        env!("CARGO_PKG_VERSION")
                    ),
                ))
            }
            Some(_) => {}
        }
        let mut c = Settings::default();
        for (key, v) in &table {
            let k = key.as_str();
            match k {
                "version" => {}
                "num_processes" => c.num_processes = Some(whole(k, v, path, 1, i64::MAX)? as usize),
                "gradient_accumulation_steps" => {
                    c.gradient_accumulation_steps = Some(whole(k, v, path, 1, i64::MAX)? as usize)
                }
                "num_machines" => c.num_machines = Some(whole(k, v, path, 1, i64::MAX)? as usize),
                "machine_rank" => c.machine_rank = Some(whole(k, v, path, 0, i64::MAX)? as usize),
                "max_restarts" => c.max_restarts = Some(whole(k, v, path, 0, i64::MAX)? as usize),
                "main_process_port" => {
                    c.main_process_port = Some(whole(k, v, path, 1, 65535)? as u16)
                }
                "cpu" => {
                    c.cpu = Some(
                        v.as_bool()
                            .ok_or_else(|| bad_value(k, v, path, "use true or false"))?,
                    )
                }
                "mixed_precision" => {
                    let s = word(k, v, path, Some(Precision::VALID))?;
                    c.mixed_precision = Some(s.parse()?);
                }
                "sharding" => {
                    let s = word(k, v, path, Some(Sharding::VALID))?;
                    c.sharding = Some(s.parse()?);
                }
                "buffers" => {
                    let s = word(k, v, path, Some(BufferSync::VALID))?;
                    c.buffers = Some(s.parse()?);
                }
                "backend" => c.backend = Some(word(k, v, path, Some(BACKENDS))?.to_string()),
                "main_process_ip" => c.main_process_ip = Some(word(k, v, path, None)?.to_string()),
                "hosts" => {
                    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
                        bad_value(
                            k,
                            v,
                            path,
                            "use a list of machine addresses, e.g. [\"node1\", \"node2\"]",
                        )
                    })?;
                    let hosts = list
                        .iter()
                        .map(|h| word(k, h, path, None).map(str::to_string))
                        .collect::<Result<Vec<_>>>()?;
                    c.hosts = Some(hosts);
                }
                "hostfile" => {
                    let s = v.as_str().filter(|s| !s.trim().is_empty()).ok_or_else(|| {
                        bad_value(k, v, path, "use the hostfile's path, in quotes")
                    })?;
                    // A relative hostfile sits beside the config, wherever the launch starts.
                    let dir = path.parent().unwrap_or(Path::new("."));
                    c.hostfile = Some(dir.join(s));
                }
                _ => unreachable!("unknown keys were refused above"),
            }
        }
        if c.hosts.is_some() && c.hostfile.is_some() {
            return Err(Error::Usage(format!(
                "the config file {} sets both `hosts` and `hostfile`; keep one list of machines",
                path.display()
            )));
        }
        Ok(c)
    }

    /// Writes the config as commented TOML, with only the keys it sets.
    pub fn to_toml(&self) -> String {
        let q = |s: &str| toml::Value::String(s.to_string()).to_string();
        let mut out = format!(
            "# ivme settings for `ivme launch`; flags given to `ivme launch` override them.\n\
             # Rewrite with `ivme config`; check with `ivme config show`.\nversion = {VERSION}\n"
        );
        let mut put = |comment: &str, line: Option<String>| {
            if let Some(line) = line {
                out.push_str(&format!("\n# {comment}\n{line}\n"));
            }
        };
        put(
            "Processes in total, over all machines.",
            self.num_processes.map(|n| format!("num_processes = {n}")),
        );
        put(
            "Compute on the CPU even where a GPU is present.",
            self.cpu.map(|b| format!("cpu = {b}")),
        );
        put(
            "Compute precision: no, fp16 or bf16.",
            self.mixed_precision
                .map(|p| format!("mixed_precision = {}", q(p.as_str()))),
        );
        put(
            "ZeRO sharding: no, optimizer (stage 1) or gradients (stage 2); docs/sharding.md.",
            self.sharding
                .map(|s| format!("sharding = {}", q(s.as_str()))),
        );
        put(
            "Buffers (BatchNorm statistics): broadcast, average or local; docs/buffers.md.",
            self.buffers.map(|b| format!("buffers = {}", q(b.as_str()))),
        );
        put(
            "Micro-batches per optimizer step.",
            self.gradient_accumulation_steps
                .map(|n| format!("gradient_accumulation_steps = {n}")),
        );
        put(
            &format!("How the processes talk: {}.", BACKENDS.join(", ")),
            self.backend
                .as_deref()
                .map(|b| format!("backend = {}", q(b))),
        );
        put(
            "Machines in the run.",
            self.num_machines.map(|n| format!("num_machines = {n}")),
        );
        put(
            "This machine's rank; only rank 0 runs `ivme launch`, which starts every machine's ranks.",
            self.machine_rank.map(|n| format!("machine_rank = {n}")),
        );
        put(
            "The main machine's (rank 0's) address.",
            self.main_process_ip
                .as_deref()
                .map(|s| format!("main_process_ip = {}", q(s))),
        );
        put(
            "The rendezvous port on the main machine.",
            self.main_process_port
                .map(|p| format!("main_process_port = {p}")),
        );
        put(
            "Every machine's address, the main one first.",
            self.hosts.as_ref().map(|h| {
                let list: Vec<String> = h.iter().map(|s| q(s)).collect();
                format!("hosts = [{}]", list.join(", "))
            }),
        );
        put(
            "MPI hostfile listing the machines (`host slots=N` per line).",
            self.hostfile
                .as_ref()
                .map(|p| format!("hostfile = {}", q(&p.display().to_string()))),
        );
        put(
            "Start a failed job again up to this many times (from its newest checkpoint).",
            self.max_restarts.map(|n| format!("max_restarts = {n}")),
        );
        out
    }

    /// Writes the config to `path`, creating its folder.
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        std::fs::write(path, self.to_toml())
            .map_err(|e| Error::io(format!("writing the config file {}", path.display()), e))
    }
}

#[cfg(test)]
#[path = "settings_tests.rs"]
mod tests;
