//! Elastic restarts (`--min_machines M`): after a failed attempt of a multi-machine job, the
//! machines that no longer answer over ssh are left out of the next attempt, which runs the
//! ranks the remaining machines ran before, when at least M machines remain. The program
//! resumes from its newest checkpoint on the smaller world: the model, the optimizer and the
//! data position reshard as checkpoints allow, so the epoch still sees each sample once.

use crate::hosts::{Host, Hosts};

/// The machines of `hosts` that ran ranks of a `num_processes` job (filling the slots in
/// order), without those at the indexes `lost`, each with the ranks it ran; and how many ranks
/// they run together.
pub fn without(hosts: &Hosts, num_processes: usize, lost: &[usize]) -> (Hosts, usize) {
    let mut left = num_processes;
    let mut machines = Vec::new();
    for (i, h) in hosts.machines.iter().enumerate() {
        let ran = h.slots.min(left);
        left -= ran;
        if ran > 0 && !lost.contains(&i) {
            machines.push(Host {
                name: h.name.clone(),
                slots: ran,
            });
        }
    }
    let n = machines.iter().map(|h| h.slots).sum();
    let lost: Vec<String> = lost.iter().map(usize::to_string).collect();
    let origin = format!("{} without machine {}", hosts.origin, lost.join(", "));
    (Hosts { origin, machines }, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machines_left_keep_the_ranks_they_ran() {
        let hosts = Hosts::parse("a slots=2\nb slots=2\nc slots=2\nd slots=2\n", "h").unwrap();
        // 5 ranks: a 2, b 2, c 1, d none.
        let (left, n) = without(&hosts, 5, &[1]);
        let names: Vec<(&str, usize)> = left
            .machines
            .iter()
            .map(|h| (h.name.as_str(), h.slots))
            .collect();
        assert_eq!(names, [("a", 2), ("c", 1)]);
        assert_eq!(n, 3);
        assert_eq!(left.origin, "h without machine 1");
        let (left, n) = without(&hosts, 8, &[1, 3]);
        assert_eq!((left.machines.len(), n), (2, 4));
    }
}
