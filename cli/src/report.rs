//! What `ivme launch` prints about a plan: the settings block of `--dry_run`, and the message
//! of a machine other than machine 0, which starts nothing itself.

use crate::hosts::Hosts;
use crate::plan::LaunchPlan;
use crate::sources::From;
use ivme_settings as table;

/// What `ivme launch` says on a machine other than machine 0, where it starts nothing.
pub fn secondary_message(plan: &LaunchPlan) -> String {
    let main = plan
        .hosts
        .as_ref()
        .map(|h| h.machines[0].name.clone())
        .unwrap_or_else(|| "machine 0".into());
    format!(
        "ivme: this is machine {} of {}, so nothing is started here: `ivme launch` on the main \
         machine ({main}) starts every machine's ranks through mpirun over ssh. Run the same \
         command there (with machine_rank 0); this machine only needs to accept ssh from it and \
         to have {} at the same path.\n",
        plan.machine_rank,
        plan.num_machines,
        plan.program.display()
    )
}

/// The settings block of `--dry_run`: each setting, its value and where it came from.
pub fn describe_settings(plan: &LaunchPlan) -> String {
    let is = |key: &str, row: &table::Setting| row.launch == Some(key);
    let value = |key: &str| -> String {
        match crate::table::row(key) {
            _ if is(key, &table::HOSTFILE) || is(key, &table::HOSTS) => {
                plan.hosts.as_ref().map_or("-".into(), Hosts::spec)
            }
            Some(row) => row.shown(&plan.settings),
            None => "?".into(),
        }
    };
    let width = plan.origins.iter().map(|o| o.key.len()).max().unwrap_or(0);
    let mut out = String::from("# settings (value: where it came from):\n");
    for o in &plan.origins {
        // Both describe the machines; show only the one that set them.
        let hostfile_given = plan
            .origins
            .iter()
            .any(|x| is(x.key, &table::HOSTFILE) && x.from != From::Default);
        if (is(o.key, &table::HOSTS) && hostfile_given)
            || (is(o.key, &table::HOSTFILE) && !hostfile_given)
        {
            continue;
        }
        let from = match (&o.from, &plan.hosts) {
            (From::Default, Some(h)) if is(o.key, &table::NUM_PROCESSES) => {
                format!("every slot of {}", h.origin)
            }
            (From::Default, Some(h)) if is(o.key, &table::NUM_MACHINES) => {
                format!("counted in {}", h.origin)
            }
            _ => o.describe(),
        };
        out.push_str(&format!(
            "#   {:width$} = {:<8} ({from})\n",
            o.key,
            value(o.key)
        ));
    }
    out
}
