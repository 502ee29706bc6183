//! What `ivme launch` prints about a plan: the settings block of `--dry_run`, and the message
//! of a machine other than machine 0, which starts nothing itself.

use crate::hosts::Hosts;
use crate::plan::LaunchPlan;
use crate::sources::From;

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
    let value = |key: &str| -> String {
        match key {
            "num_processes" => plan.num_processes.to_string(),
            "cpu" => plan.cpu.to_string(),
            "mixed_precision" => plan.precision.unwrap_or_default().to_string(),
            "sharding" => plan.sharding.unwrap_or_default().to_string(),
            "buffers" => plan.buffers.unwrap_or_default().to_string(),
            "gradient_accumulation_steps" => plan.grad_accum.unwrap_or(1).to_string(),
            "num_machines" => plan.num_machines.to_string(),
            "machine_rank" => plan.machine_rank.to_string(),
            "main_process_ip" => plan.main_process_ip.clone().unwrap_or_else(|| "-".into()),
            "main_process_port" => plan.main_process_port.map_or("-".into(), |p| p.to_string()),
            "hostfile" | "hosts" => plan.hosts.as_ref().map_or("-".into(), Hosts::spec),
            "backend" => "mpi".into(),
            "max_restarts" => plan.max_restarts.to_string(),
            "collective_timeout" => plan
                .collective_timeout
                .map_or("-".into(), |t| format!("{}s", ivme::env::seconds_text(t))),
            "debug_sync" => plan.debug_sync.to_string(),
            "preempt_signals" => plan
                .preempt_signals
                .clone()
                .unwrap_or_else(|| ivme::preempt::DEFAULT_SIGNALS.into()),
            "preempt_grace" => format!(
                "{}s",
                ivme::env::seconds_text(plan.preempt_grace.unwrap_or(ivme::preempt::DEFAULT_GRACE))
            ),
            "requeue_exit_code" => plan.requeue_exit_code.to_string(),
            _ => "?".into(),
        }
    };
    let width = plan.origins.iter().map(|o| o.key.len()).max().unwrap_or(0);
    let mut out = String::from("# settings (value: where it came from):\n");
    for o in &plan.origins {
        // Both describe the machines; show only the one that set them.
        let hostfile_given = plan
            .origins
            .iter()
            .any(|x| x.key == "hostfile" && x.from != From::Default);
        if (o.key == "hosts" && hostfile_given) || (o.key == "hostfile" && !hostfile_given) {
            continue;
        }
        let from = match (o.key, &o.from, &plan.hosts) {
            ("num_processes", From::Default, Some(h)) => {
                format!("every slot of {}", h.origin)
            }
            ("num_machines", From::Default, Some(h)) => {
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
