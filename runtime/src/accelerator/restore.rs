//! Loading training state all or nothing.
//!
//! [`Accelerator::check_checkpoint`] reads every file this rank needs (the model and optimizer
//! state of the saved ranks that hold its part, in any layout; the loaders, RNG, scaler,
//! partial sums and registered objects of the saved rank of the same index, or of rank 0 for a
//! rank the saving run did not have) exactly once,
//! checks each against the manifest's checksum on the bytes as they arrive (the tensors land
//! straight in staging buffers), and parses and compares every piece with the live objects
//! (component counts, tensor names, shapes and dtypes, the JSON of each position and state)
//! without changing anything. Only when every rank's check passed does
//! [`Accelerator::apply_plan`] change state, from memory (the disk is not read again, so a file
//! changed after the check cannot leave anything half loaded): registered objects and
//! optimizers first (each refusal undoes the ones already loaded), then the small pieces, and
//! the model weights last. Staging costs one extra copy of the weights in memory until they
//! are applied.

use crate::accelerator::Accelerator;
use crate::checkpoint::format::unfit;
use crate::checkpoint::layout::Layout;
use crate::checkpoint::names;
use crate::checkpoint::names::Kind;
use crate::checkpoint::own_state::{read_own, Expected, OwnState};
use crate::checkpoint::plan::Assembled;
use crate::checkpoint::plan::Checked;
use crate::checkpoint::plan::Counts;
use crate::checkpoint::plan::ModelLoad;
use crate::checkpoint::plan::Plan;
use crate::checkpoint::plan::{load_all_or_none, Target};
use crate::checkpoint::store;
use crate::checkpoint::RankState;
use crate::error::Result;
use crate::stateful::StateDict;
use crate::stateful::Stateful;
use candle_core::Tensor;
use std::collections::BTreeSet;
use std::path::Path;

impl Accelerator {
    fn live_counts(&self) -> Counts {
        Counts {
            models: self.training.models().len(),
            optimizers: self.training.optimizers().len(),
            loaders: self.data.loaders().len(),
            registered: self.checkpoints.registered().len(),
        }
    }

    /// The component names saved rank `rank` holds, given the prepared objects: the models
    /// and optimizers are on rank 0, or on every rank of a `sharded` layout.
    fn expected_components(&self, rank: usize, sharded: bool) -> BTreeSet<String> {
        let mut out = BTreeSet::from([names::RNG.to_string(), names::TRAINING.to_string()]);
        let n = |kind: Kind, k: usize| (0..k).map(move |i| kind.name(i));
        if rank == 0 || sharded {
            out.extend(n(Kind::Model, self.training.models().len()));
            out.extend(n(Kind::Optimizer, self.training.optimizers().len()));
        }
        out.extend(n(Kind::Loader, self.data.loaders().len()));
        out.extend(n(Kind::Custom, self.checkpoints.registered().len()));
        out
    }

    /// Refuses a fine-tune's checkpoint unless this run opened the same base it was trained
    /// over (the manifest records each base file's size and checksum).
    fn check_base(&self, dir: &Path, manifest: &store::Manifest) -> Result<()> {
        let saved = &manifest.extra["base"];
        if saved.is_null() {
            return Ok(());
        }
        let unfit = |msg: String| unfit(dir, msg);
        let saved: crate::finetune::BaseRecord = serde_json::from_value(saved.clone())
            .map_err(|e| unfit(format!("records a base this build cannot read ({e})")))?;
        saved
            .check(self.finetune.base.lock().as_ref())
            .map_err(unfit)
    }

    /// Refuses a saved rank's state whose components are not exactly the ones this run saves.
    fn check_components(
        &self,
        dir: &Path,
        rank: usize,
        s: &RankState,
        sharded: bool,
    ) -> Result<()> {
        let found: BTreeSet<String> = s.components.iter().map(|c| c.name.clone()).collect();
        let want = self.expected_components(rank, sharded);
        if found == want {
            return Ok(());
        }
        let count = |kind: Kind| names::count(&found, kind);
        let mut saved = Counts {
            loaders: count(Kind::Loader),
            registered: count(Kind::Custom),
            ..Counts::default()
        };
        let mut live = self.live_counts();
        if rank == 0 || sharded {
            saved.models = count(Kind::Model);
            saved.optimizers = count(Kind::Optimizer);
        } else {
            (live.models, live.optimizers) = (0, 0);
        }
        let msg = if saved != live {
            format!(
                "holds {} for rank {rank} but this run prepared {}; prepare and register the \
                 same objects, in the same order, as the run that saved it before load_state",
                saved.describe(),
                live.describe()
            )
        } else {
            let odd: Vec<&String> = found.symmetric_difference(&want).collect();
            format!("has components {odd:?} for rank {rank} that this run does not save or expects but does not find; was it saved by this program?")
        };
        Err(unfit(dir, msg))
    }

    /// Reads and checks everything this rank would load from `dir`; changes nothing.
    pub(crate) fn check_checkpoint(&self, dir: &Path) -> Result<Plan> {
        match self.classify_checkpoint(dir)? {
            Checked::Ready(plan) => Ok(*plan),
            Checked::Damaged(e) => Err(e),
        }
    }

    /// [`check_checkpoint`](Self::check_checkpoint), telling a damaged checkpoint (a file
    /// that does not match its manifest, which an older checkpoint may stand in for) from one
    /// that is sound but does not fit this run (an error).
    pub(crate) fn classify_checkpoint(&self, dir: &Path) -> Result<Checked> {
        crate::checkpoint::plan::classify(dir, self.plan_checkpoint(dir))
    }

    fn plan_checkpoint(&self, dir: &Path) -> Result<Plan> {
        let manifest = store::read_manifest(dir)?;
        self.check_base(dir, &manifest)?;
        let rank = self.process_index();
        let moved = manifest.world_size != self.num_processes();
        // The saved rank whose own state (positions, RNG, registered objects) this rank takes.
        let own = if rank < manifest.world_size { rank } else { 0 };
        let (mine, models, optimizers) = self.read_weights(dir, &manifest, own)?;
        let expected = Expected {
            loader_files: self.data.loader_files(),
            registered: self.checkpoints.registered().len(),
            scales_loss: self.mixed.scales_loss(),
            saved_world: manifest.world_size,
            moved,
        };
        let own_state = read_own(dir, own, &mine, &expected)?;
        let sums_file = dir.join(format!("rank{own}/training.safetensors"));
        let sums = self.check_sums(&sums_file, &own_state.sums)?;
        let OwnState {
            loaders,
            rng,
            auto_micro_step,
            macro_loop,
            scaler,
            custom,
            ..
        } = own_state;
        let rng = (rank < manifest.world_size).then_some(rng);
        Ok(Plan {
            moved_from: moved.then_some(manifest.world_size),
            dir: dir.to_path_buf(),
            models,
            optimizers,
            loaders,
            rng,
            auto_micro_step,
            macro_loop,
            scaler,
            sums,
            custom,
        })
    }

    /// Reads saved rank `own`'s folder and, from the saved ranks that hold this process's part,
    /// the model and optimizer state (each file once, checked against the manifest as it
    /// arrives), checks every rank's components, and puts the weights in this run's layout.
    fn read_weights(
        &self,
        dir: &Path,
        manifest: &store::Manifest,
        own: usize,
    ) -> Result<(RankState, Vec<ModelLoad>, Vec<StateDict>)> {
        let layout = Layout::of(dir, manifest)?;
        let sharded = layout.is_sharded();
        let sources = self.source_ranks(&layout);
        let weights = names::is_weights;
        // Models whose file may go straight into their variables: only checked here.
        let direct = self.direct_candidates(&layout);
        let later = |c: &str| direct.iter().any(|d| d.as_deref() == Some(c));
        // Every other file is read once, here; the tensors wait in memory until every check
        // passed.
        let (mut mine, mut listed) = store::read_rank_in(dir, manifest, own, |c| {
            (sources.contains(&own) || !weights(c)) && !later(c)
        })?;
        self.check_components(dir, own, &mine, sharded)?;
        let mut others = Vec::new();
        for &k in sources.iter().filter(|&&k| k != own) {
            let (s, l) = store::read_rank_in(dir, manifest, k, |c| weights(c) && !later(c))?;
            self.check_components(dir, k, &s, sharded)?;
            if k == 0 {
                listed = l;
            }
            others.push(s);
        }
        let mut states: Vec<&mut RankState> = others.iter_mut().collect();
        // This rank's own folder last: an optimizer's scalars come from the first that has it.
        states.push(&mut mine);
        let direct = self.fit_direct(dir, manifest, &direct, &listed, &mut states)?;
        let Assembled { models, optimizers } = self.assemble(dir, &layout, &mut states, &direct)?;
        let models = models
            .into_iter()
            .zip(direct)
            .map(|(staged, d)| d.map_or(ModelLoad::Staged(staged), ModelLoad::Direct))
            .collect();
        drop(others);
        Ok((mine, models, optimizers))
    }

    /// Places each saved partial sum (`{model}::{variable}`) after checking it fits.
    fn check_sums(
        &self,
        file: &Path,
        saved: &[(String, Tensor)],
    ) -> Result<Vec<Vec<Option<Tensor>>>> {
        let models = self.training.models();
        let mut by_model: Vec<Vec<(String, &Tensor)>> = vec![Vec::new(); models.len()];
        for (key, t) in saved {
            let place = key.split_once("::").and_then(|(i, name)| {
                let i: usize = i.parse().ok()?;
                models.get(i)?.sum_slot(name).map(|_| (i, name))
            });
            let Some((i, name)) = place else {
                return Err(unfit(
                    file,
                    format!(
                        "holds a partial gradient sum `{key}` for no variable of this run's models"
                    ),
                ));
            };
            by_model[i].push((name.to_string(), t));
        }
        models
            .iter()
            .zip(by_model)
            .map(|(m, saved)| m.check_sums(file, saved))
            .collect()
    }

    /// Applies a plan that every rank checked: all of it, or (when an object refuses its
    /// state) none of it.
    fn apply_plan(&mut self, plan: Plan) -> Result<()> {
        let Plan {
            dir,
            models: models_saved,
            optimizers,
            loaders,
            rng,
            auto_micro_step,
            macro_loop,
            scaler,
            sums,
            custom,
            moved_from: _,
        } = plan;
        self.load_undoably(&dir, &custom, &optimizers)?;
        self.data.restore(loaders, rng, macro_loop);
        self.training.window().set_auto_index(auto_micro_step);
        self.mixed.restore_scaler(scaler);
        let models = self.training.models_mut().iter_mut();
        for ((m, sums), saved) in models.zip(sums).zip(models_saved) {
            m.apply_load(sums, saved)?;
        }
        Ok(())
    }

    /// Applies a plan every rank checked, agrees on the outcome, and (sharded models) gathers
    /// every process's loaded slice into the model weights.
    pub(crate) fn apply_checked(&mut self, plan: Plan) -> Result<()> {
        let moved_from = plan.moved_from;
        let applied = self.apply_plan(plan);
        self.agree("loading the checkpoint", applied)?;
        self.gather_loaded_slices()?;
        if let Some(saved_world) = moved_from {
            self.warn_moved(saved_world);
        }
        Ok(())
    }

    /// Loads registered objects, then optimizers; if one refuses, the ones already loaded get
    /// their previous state back. Only objects followed by another are copied for that, so a
    /// single optimizer (the usual case) costs no extra memory.
    fn load_undoably(
        &mut self,
        dir: &Path,
        custom: &[StateDict],
        optimizers: &[StateDict],
    ) -> Result<()> {
        let customs = self.checkpoints.registered_mut().iter_mut().enumerate();
        let customs = customs.map(|(i, o)| Target {
            object: &mut **o as &mut dyn Stateful,
            what: format!("registered object {i} ({})", Kind::Custom.name(i)),
            // ivme's optimizers hand out copies already; other objects may hand out views.
            deep_copy: true,
        });
        let opts = self.training.optimizers_mut().iter_mut().enumerate();
        let opts = opts.map(|(i, o)| Target {
            object: &mut **o as &mut dyn Stateful,
            what: format!("optimizer {i}"),
            deep_copy: false,
        });
        let mut targets: Vec<Target> = customs.chain(opts).collect();
        let states: Vec<&StateDict> = custom.iter().chain(optimizers).collect();
        load_all_or_none(dir, &mut targets, &states)
    }
}
