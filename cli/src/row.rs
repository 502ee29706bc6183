//! What one launch setting is, as a row of the table in table.rs: its names (flag, config key,
//! environment variable, the attribute's key), how its text is read and written, and its doc
//! line. Everything that handles settings one by one (the flags, the launcher's environment,
//! the config file, the ranks' environment, `--dry_run`, docs/launch.md) goes through the rows
//! here instead of naming settings itself, so a new setting is one row.

use crate::cli::Checked;
use clap::{Arg, ArgMatches};
use ivme::env::Var;
use ivme::{BufferSync, Error, Precision, Result, Sharding};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The place one setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum From {
    /// A command-line flag.
    Flag,
    /// A variable in the launcher's environment.
    Env(&'static str),
    /// The config file at this path.
    File(PathBuf),
    /// Nothing set it.
    Default,
}

/// One setting's source, and what a weaker source said that it overrode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The setting, spelled as its flag and config key.
    pub key: &'static str,
    /// Where its value came from.
    pub from: From,
    /// The config file's value when a stronger source replaced it.
    pub overrode: Option<String>,
}

impl Origin {
    /// Says where the value came from, for `--dry_run`.
    pub fn describe(&self) -> String {
        let mut s = match &self.from {
            From::Flag => format!("flag --{}", self.key),
            From::Env(var) => format!("environment {var}"),
            From::File(p) => format!("config file {}", p.display()),
            From::Default => "default".to_string(),
        };
        if let Some(v) = &self.overrode {
            s.push_str(&format!("; the config file's {v} is overridden"));
        }
        s
    }
}

/// A setting's command-line flag (its name is the setting's key).
pub struct Flag {
    /// The value's name in `--help` ([`cli::SWITCH`] makes the flag a switch).
    pub value_name: &'static str,
    /// The one-line help.
    pub help: &'static str,
}

/// How a setting's environment variable (its row's in the settings table) is used: read from
/// the launcher's own environment as a layer of settings (`read`), handed to every rank
/// (`to_ranks`), or both.
pub struct Env<T> {
    /// Whether a value already in the launcher's environment counts as the setting.
    pub read: bool,
    /// The variable's value for the ranks, when it is passed to them (`None`: not passed).
    pub to_ranks: fn(&T) -> Option<String>,
}

/// One setting of `ivme launch`: its names, variable and doc line from the settings table
/// (`ivme_settings`), and how the command reads, writes and shows it.
pub struct Row<S: 'static, T: 'static> {
    /// The flag's and the config file's name for it.
    pub key: &'static str,
    /// Its variable, from the settings table; used as `env` says.
    pub var: Option<Var>,
    /// What it is, in one line (the config file's comment).
    pub doc: &'static str,
    /// Its name in the table of docs/launch.md (read by the test that keeps the docs equal).
    #[cfg_attr(not(test), allow(dead_code))]
    pub label: &'static str,
    /// How code sets it (builder and attribute), for docs/launch.md; empty when code cannot.
    #[cfg_attr(not(test), allow(dead_code))]
    pub code: &'static str,
    /// The `#[accelerate]` key that sets the same thing; empty when there is none (a test checks
    /// that the attribute has it, and takes the setting's own name as an alias of it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub attribute: &'static str,
    /// The command-line flag, when there is one.
    pub flag: Option<Flag>,
    /// An example value, used in error messages.
    pub example: &'static str,
    /// Reads the value from text: `(what, raw, example)`, where `what` names the source in the
    /// error (the flag as typed, or a variable).
    pub parse: fn(&str, &str, &str) -> std::result::Result<T, String>,
    /// What a valid value looks like, for errors about the environment and the config file.
    pub want: &'static str,
    /// How its variable is used, when it is.
    pub env: Option<Env<T>>,
    /// Whether the config file has this key.
    pub file: bool,
    /// How the value reads in `--dry_run` and the config file.
    pub show: fn(&T) -> String,
    /// The value that applies when nothing sets it, for `--dry_run` (`None`: shown as `-`).
    pub default: fn() -> Option<T>,
    /// The setting's field in the settings struct `S` (table.rs's `Settings`).
    pub get: fn(&S) -> &Option<T>,
    /// The same field, to fill.
    pub set: fn(&mut S) -> &mut Option<T>,
}

/// A row with its value type hidden, so the table can hold rows of every type; `S` is the
/// struct that holds one value of each.
pub trait Setting<S>: Sync {
    /// The flag's and the config file's name for it.
    fn key(&self) -> &'static str;
    /// What it is, in one line.
    fn doc(&self) -> &'static str;
    /// The `#[accelerate]` key for the same thing; empty when there is none.
    #[cfg(test)]
    fn attribute(&self) -> &'static str;
    /// An example value.
    fn example(&self) -> &'static str;
    /// What a valid value looks like.
    #[cfg(test)]
    fn want(&self) -> &'static str;
    /// Whether the config file has this key.
    fn in_file(&self) -> bool;
    /// The variable read from the launcher's environment as a layer of settings, if any.
    fn env_layer(&self) -> Option<&'static str>;
    /// The variable the row uses, read or passed, if any.
    #[cfg(test)]
    fn var(&self) -> Option<&'static str>;
    /// The command-line flag, for clap.
    fn arg(&self) -> Option<Arg>;
    /// Reads the flag's value from clap's matches into `s`.
    fn read_flag(&self, m: &ArgMatches, s: &mut S);
    /// Reads the variable from the launcher's environment into `s`, when it is a layer.
    fn read_env(&self, inherited: &[(String, String)], s: &mut S) -> Result<()>;
    /// Reads the config file's value into `s`; `path` names the file.
    fn read_file(&self, v: &toml::Value, path: &Path, s: &mut S) -> Result<()>;
    /// The config file's lines for the value in `s`, when it sets one.
    fn toml_lines(&self, s: &S) -> Option<String>;
    /// The variable and text every rank gets for the value in `s`, when it is passed.
    fn for_ranks(&self, s: &S) -> Option<(&'static str, String)>;
    /// The value in `s`, or the default, as `--dry_run` shows it (`-` for none).
    fn shown(&self, s: &S) -> String;
    /// Takes the value from the strongest layer that sets it into `out`, and says where from.
    fn pick(&self, layers: &Layers<S>, out: &mut S) -> Origin;
    /// Its line of the settings table in docs/launch.md.
    #[cfg(test)]
    fn docs_line(&self) -> String;
}

/// The layers of settings, strongest first, that [`Setting::pick`] chooses from.
pub struct Layers<'a, S> {
    /// What the flags say.
    pub flags: &'a S,
    /// What the launcher's environment says.
    pub env: &'a S,
    /// What the config file says, and its path.
    pub file: (Option<&'a Path>, &'a S),
}

impl<S, T> Setting<S> for Row<S, T>
where
    T: Clone + Send + Sync + 'static + Toml,
{
    fn key(&self) -> &'static str {
        self.key
    }

    fn doc(&self) -> &'static str {
        self.doc.trim()
    }

    #[cfg(test)]
    fn attribute(&self) -> &'static str {
        self.attribute
    }

    fn example(&self) -> &'static str {
        self.example
    }

    #[cfg(test)]
    fn want(&self) -> &'static str {
        self.want
    }

    fn in_file(&self) -> bool {
        self.file
    }

    fn env_layer(&self) -> Option<&'static str> {
        self.env
            .as_ref()
            .filter(|e| e.read)
            .and(self.var)
            .map(|v| v.name)
    }

    #[cfg(test)]
    fn var(&self) -> Option<&'static str> {
        self.env.as_ref().and(self.var).map(|v| v.name)
    }

    fn arg(&self) -> Option<Arg> {
        let flag = self.flag.as_ref()?;
        Some(
            Arg::new(self.key)
                .long(self.key)
                .value_name(flag.value_name)
                .help(flag.help)
                .value_parser(Checked::with_example(self.parse, self.example)),
        )
    }

    fn read_flag(&self, m: &ArgMatches, s: &mut S) {
        if self.flag.is_some() {
            *(self.set)(s) = m.get_one::<T>(self.key).cloned();
        }
    }

    fn read_env(&self, inherited: &[(String, String)], s: &mut S) -> Result<()> {
        let Some(var) = self.env_layer() else {
            return Ok(());
        };
        let Some((_, raw)) = inherited
            .iter()
            .find(|(k, _)| k == var)
            .filter(|(_, v)| !v.trim().is_empty())
        else {
            return Ok(());
        };
        let value = (self.parse)(var, raw.trim(), self.example).map_err(|_| {
            Error::config(
                var,
                raw,
                format!("set by the environment: use {}, or unset it", self.want),
            )
        })?;
        *(self.set)(s) = Some(value);
        Ok(())
    }

    fn read_file(&self, v: &toml::Value, path: &Path, s: &mut S) -> Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let value = T::read(v, dir)
            .and_then(|text| (self.parse)(self.key, &text, self.example).ok())
            .ok_or_else(|| {
                let shown = match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                Error::config(
                    self.key,
                    shown,
                    format!(
                        "in the config file {}: use {} (or run `ivme config` to rewrite it)",
                        path.display(),
                        self.want
                    ),
                )
            })?;
        *(self.set)(s) = Some(value);
        Ok(())
    }

    fn toml_lines(&self, s: &S) -> Option<String> {
        let v = (self.get)(s).as_ref().filter(|_| self.file)?;
        Some(format!(
            "\n# {}\n{} = {}\n",
            self.doc(),
            self.key,
            v.write()
        ))
    }

    fn for_ranks(&self, s: &S) -> Option<(&'static str, String)> {
        let (env, var) = (self.env.as_ref()?, self.var?);
        let text = (env.to_ranks)((self.get)(s).as_ref()?)?;
        Some((var.name, text))
    }

    fn shown(&self, s: &S) -> String {
        (self.get)(s)
            .clone()
            .or_else(self.default)
            .map_or("-".into(), |v| (self.show)(&v))
    }

    fn pick(&self, layers: &Layers<S>, out: &mut S) -> Origin {
        let (path, file) = layers.file;
        let file = (self.get)(file).clone();
        let env = self.env.as_ref().and(self.var).map(|v| v.name);
        let overridden = file.as_ref().map(self.show);
        let (value, from, overrode) = match ((self.get)(layers.flags).clone(), env) {
            (Some(v), _) => (Some(v), From::Flag, overridden),
            (None, Some(var)) if (self.get)(layers.env).is_some() => {
                ((self.get)(layers.env).clone(), From::Env(var), overridden)
            }
            _ => match file {
                Some(v) => (
                    Some(v),
                    From::File(path.unwrap_or(Path::new("")).to_path_buf()),
                    None,
                ),
                None => (None, From::Default, None),
            },
        };
        *(self.set)(out) = value;
        Origin {
            key: self.key,
            from,
            overrode,
        }
    }

    #[cfg(test)]
    fn docs_line(&self) -> String {
        let code = |s: String| if s.is_empty() { "—".to_string() } else { s };
        let switch = self
            .flag
            .as_ref()
            .is_some_and(|f| f.value_name == crate::cli::SWITCH);
        let var = self.env.as_ref().and(self.var);
        let env = var.map_or(String::new(), |v| match switch {
            true => format!("`{}=1`", v.name),
            false => format!("`{}`", v.name),
        });
        format!(
            "| {} | {} | {} | {} | {} |",
            self.label,
            code(self.code.to_string()),
            code(
                self.flag
                    .as_ref()
                    .map_or(String::new(), |_| format!("`--{}`", self.key))
            ),
            code(env),
            code(if self.file {
                format!("`{}`", self.key)
            } else {
                String::new()
            }),
        )
    }
}

/// How a setting's value sits in the config file.
pub trait Toml: Sized {
    /// The file's value as the text a row parses; `None` when it is the wrong kind of value.
    /// `dir` is the config file's folder, for relative paths.
    fn read(v: &toml::Value, dir: &Path) -> Option<String>;
    /// The value as the file writes it.
    fn write(&self) -> toml::Value;
}

macro_rules! toml_number {
    ($($t:ty),+) => {$(
        impl Toml for $t {
            fn read(v: &toml::Value, _: &Path) -> Option<String> {
                v.as_integer().map(|n| n.to_string())
            }
            fn write(&self) -> toml::Value {
                toml::Value::Integer(*self as i64)
            }
        }
    )+};
}
toml_number!(usize, u8, u16, u64);

impl Toml for bool {
    fn read(v: &toml::Value, _: &Path) -> Option<String> {
        v.as_bool().map(|b| b.to_string())
    }
    fn write(&self) -> toml::Value {
        toml::Value::Boolean(*self)
    }
}

/// A string without spaces: a name, an address, a word from a list.
fn word(v: &toml::Value) -> Option<String> {
    v.as_str()
        .filter(|s| !s.is_empty() && !s.contains(char::is_whitespace))
        .map(str::to_string)
}

macro_rules! toml_word {
    ($($t:ty),+) => {$(
        impl Toml for $t {
            fn read(v: &toml::Value, _: &Path) -> Option<String> {
                word(v)
            }
            fn write(&self) -> toml::Value {
                toml::Value::String(self.to_string())
            }
        }
    )+};
}
toml_word!(String, Precision, Sharding, BufferSync);

impl Toml for Duration {
    fn read(v: &toml::Value, _: &Path) -> Option<String> {
        word(v).or_else(|| v.as_integer().map(|n| n.to_string()))
    }
    fn write(&self) -> toml::Value {
        toml::Value::String(format!("{}s", ivme::env::seconds_text(*self)))
    }
}

/// A path; a relative one in the config file is read from the file's folder.
impl Toml for PathBuf {
    fn read(v: &toml::Value, dir: &Path) -> Option<String> {
        let s = v.as_str().filter(|s| !s.trim().is_empty())?;
        Some(dir.join(s).display().to_string())
    }
    fn write(&self) -> toml::Value {
        toml::Value::String(self.display().to_string())
    }
}

/// A list of names (machine addresses), as text separated by commas, which no name holds.
impl Toml for Vec<String> {
    fn read(v: &toml::Value, _: &Path) -> Option<String> {
        let list = v.as_array().filter(|a| !a.is_empty())?;
        let words = list
            .iter()
            .map(|w| word(w).filter(|w| !w.contains(',')))
            .collect::<Option<Vec<_>>>()?;
        Some(words.join(","))
    }
    fn write(&self) -> toml::Value {
        toml::Value::Array(self.iter().cloned().map(toml::Value::String).collect())
    }
}
