//! The config file `ivme config` writes and `ivme launch` reads: where it lives, its keys, and
//! how it is read (strictly: an unknown key or a bad value is an error naming the key, the file
//! and what to write instead).
//!
//! The format is TOML with a `version` key, so a later ivme can tell an old file from a new one
//! instead of misreading it. Every key is optional; what a file leaves out falls back to the
//! launcher's defaults.

use crate::cli;
use crate::table::ROWS;
use ivme::{Error, Precision, Result};
use std::path::{Path, PathBuf};

/// The one config format this ivme reads and writes.
pub const VERSION: i64 = 1;

/// The variable that names a config file, between the `--config_file` flag and the default.
pub const CONFIG_VAR: &str = ivme::env::CONFIG.name;

pub use crate::table::BACKENDS;

pub use crate::table::Settings;

/// The keys a config file may hold, in the order they are written: `version`, then the
/// settings whose rows have a file key.
pub fn keys() -> Vec<&'static str> {
    let rows = ROWS.iter().filter(|r| r.in_file()).map(|r| r.key());
    std::iter::once("version").chain(rows).collect()
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
        let keys = keys();
        for key in table.keys() {
            if !keys.contains(&key.as_str()) {
                let hint = cli::closest(key, keys.iter().copied())
                    .map(|c| format!("did you mean `{c}`? "))
                    .unwrap_or_default();
                return Err(Error::Usage(format!(
                    "the config file {} has an unknown key `{key}`; {hint}the valid keys are: {}",
                    path.display(),
                    keys.join(", ")
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
            if let Some(row) = crate::table::row(key) {
                row.read_file(v, path, &mut c)?;
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
        let mut out = format!(
            "# ivme settings for `ivme launch`; flags given to `ivme launch` override them.\n\
             # Rewrite with `ivme config`; check with `ivme config show`.\nversion = {VERSION}\n"
        );
        for row in ROWS {
            out.extend(row.toml_lines(self));
        }
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
