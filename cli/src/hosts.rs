//! The machines of a multi-machine run, from an MPI hostfile or from the config's `hosts` list.
//!
//! ivme reads the hostfile itself and hands mpirun the machines as `host:slots` pairs rather
//! than the file: both MPI implementations accept that form, the config's address list takes
//! the same path, and a file that names one machine twice under two names (`localhost` and
//! `127.0.0.1`) still works, where Open MPI refuses such a file.

use ivme::{Error, Result};
use std::path::Path;

/// One machine and how many ranks it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Its name or address.
    pub name: String,
    /// Ranks it runs.
    pub slots: usize,
}

/// The machines of a run, main machine first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// Where the list came from, for messages (`the hostfile h.txt`).
    pub origin: String,
    /// The machines in order; rank 0 runs on the first.
    pub machines: Vec<Host>,
}

impl Hosts {
    /// Reads a hostfile: one machine per line as `host`, `host slots=N` or `host:N`; `#` starts
    /// a comment; a machine named twice gets the slots of both lines.
    pub fn read(path: &Path) -> Result<Hosts> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Usage(format!(
                "cannot read the hostfile {}: {e}; check the path given to `--hostfile`",
                path.display()
            ))
        })?;
        Self::parse(&text, &format!("the hostfile {}", path.display()))
    }

    /// Parses hostfile text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Hosts> {
        let mut machines: Vec<Host> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default();
            let mut words = line.split_whitespace();
            let Some(first) = words.next() else {
                continue;
            };
            let bad = |what: &str| {
                Error::Usage(format!(
                    "{origin}, line {}: {what}; write one machine per line as `node1 slots=4`",
                    i + 1
                ))
            };
            let count = |raw: &str| match raw.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(bad(&format!("`{raw}` is not a slot count of at least 1"))),
            };
            let (name, mut slots) = match first.split_once(':') {
                Some((n, s)) => (n, Some(count(s)?)),
                None => (first, None),
            };
            for w in words {
                match w.split_once('=') {
                    Some(("slots", s)) if slots.is_none() => slots = Some(count(s)?),
                    _ => return Err(bad(&format!("`{w}` is not understood"))),
                }
            }
            let slots = slots.unwrap_or(1);
            match machines.iter_mut().find(|h| h.name == name) {
                Some(h) => h.slots += slots,
                None => machines.push(Host {
                    name: name.to_string(),
                    slots,
                }),
            }
        }
        if machines.is_empty() {
            return Err(Error::Usage(format!(
                "{origin} names no machines; write one per line, e.g. `node1 slots=4`"
            )));
        }
        Ok(Hosts {
            origin: origin.to_string(),
            machines,
        })
    }

    /// Spreads `num_processes` evenly over the machines `names` (the config's `hosts`).
    pub fn from_list(names: &[String], num_processes: usize) -> Result<Hosts> {
        let m = names.len();
        if num_processes.checked_rem(m) != Some(0) {
            return Err(Error::Usage(format!(
                "{num_processes} processes cannot be spread evenly over {m} machines; use a \
                 multiple of {m} for `num_processes`, or a hostfile (`--hostfile`) giving each \
                 machine its own `slots=N`"
            )));
        }
        let machines = names
            .iter()
            .map(|n| Host {
                name: n.clone(),
                slots: num_processes / m,
            })
            .collect();
        Ok(Hosts {
            origin: "the config's `hosts`".into(),
            machines,
        })
    }

    /// Ranks the machines can run in all.
    pub fn slots(&self) -> usize {
        self.machines.iter().map(|h| h.slots).sum()
    }

    /// The most ranks any one machine runs when `num_processes` fill the slots in order.
    pub fn busiest(&self, num_processes: usize) -> usize {
        let mut left = num_processes;
        let mut most = 0;
        for h in &self.machines {
            let here = h.slots.min(left);
            most = most.max(here);
            left -= here;
        }
        most.max(1)
    }

    /// The machines as mpirun's `host:slots,host:slots` list.
    pub fn spec(&self) -> String {
        let parts: Vec<String> = self
            .machines
            .iter()
            .map(|h| format!("{}:{}", h.name, h.slots))
            .collect();
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfile_lines_in_either_spelling_add_up() {
        let h = Hosts::parse("# cluster\nnode1 slots=2\n\nnode2:3 # second\nnode1\n", "f").unwrap();
        assert_eq!(
            h.machines,
            vec![
                Host {
                    name: "node1".into(),
                    slots: 3
                },
                Host {
                    name: "node2".into(),
                    slots: 3
                }
            ]
        );
        assert_eq!(h.slots(), 6);
        assert_eq!(h.spec(), "node1:3,node2:3");
        assert_eq!(h.busiest(4), 3);
        assert_eq!(h.busiest(2), 2);
    }

    #[test]
    fn bad_hostfile_lines_are_named() {
        let e = Hosts::parse("a slots=2\nb max_slots=4\n", "the hostfile h")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the hostfile h, line 2: `max_slots=4` is not understood"),
            "{e}"
        );
        let e = Hosts::parse("a slots=0\n", "f").unwrap_err().to_string();
        assert!(e.contains("`0` is not a slot count"), "{e}");
        let e = Hosts::parse("# none\n", "f").unwrap_err().to_string();
        assert!(e.contains("names no machines"), "{e}");
    }

    #[test]
    fn a_host_list_shares_the_processes_evenly() {
        let names = vec!["m0".to_string(), "m1".to_string()];
        assert_eq!(Hosts::from_list(&names, 4).unwrap().spec(), "m0:2,m1:2");
        let e = Hosts::from_list(&names, 3).unwrap_err().to_string();
        assert!(e.contains("multiple of 2"), "{e}");
    }
}
