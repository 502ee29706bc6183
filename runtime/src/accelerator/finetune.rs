//! The Accelerator's side of fine-tuning (the work is `finetune/`'s): opening a pretrained
//! base, building a model over it, LoRA builders, saving adapters, and preparing an optimizer
//! over any subset of a model's variables.

use crate::accelerator::Accelerator;
use crate::checkpoint::model::LoadReport;
use crate::error::{Error, Result};
use crate::finetune::{Base, Lora, LoraConfig};
use crate::optim::{AcceleratedOptimizer, StatefulOptimizer};
use crate::precision::exact_init::SeededInit;
use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::path::{Path, PathBuf};

impl Accelerator {
    /// Opens the pretrained model in `folder` (its `*.safetensors`: one file or Hugging Face
    /// shards) for fine-tuning: each file checksummed, and every process checked to have
    /// opened the same files (a mismatch names the file and the processes). Build the model
    /// over it with [`base_var_builder`](Self::base_var_builder), which reads each tensor
    /// when the model asks for it, straight into the tensor's own memory (candle's
    /// memory-mapped loading would keep the mapped file resident beside the copies).
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let base = accelerator.load_base("pretrained")?.unfreeze("head")?;
    /// let vb = accelerator.base_var_builder(&base, &varmap, candle_core::DType::F32);
    /// let body = candle_nn::linear(8, 8, vb.pp("body"))?; // constants from the folder
    /// let head = candle_nn::linear(8, 1, vb.pp("head"))?; // trained, from the folder's values
    /// # let _ = (body, head); Ok(()) }
    /// ```
    pub fn load_base(&self, folder: impl AsRef<Path>) -> Result<Base> {
        Base::open(folder.as_ref(), &*self.comm, self.finetune.clone())
    }

    /// A `VarBuilder` for building a model over `base`: a name the base holds is handed out
    /// as a constant tensor (no gradient is ever computed for it) in the dtype
    /// [`param_dtype`](Self::param_dtype) gives for `requested`, on this process's device; a
    /// name an [`unfreeze`](Base::unfreeze) pattern matches becomes a variable of `varmap`
    /// starting from the base's value (its f32 value is the master under bf16/fp16); a name
    /// the base lacks (an adapter, a new head) becomes a variable drawn from the seeded
    /// generator as [`var_builder`](Self::var_builder) draws it. A shape that disagrees with
    /// the base's fails, naming both.
    pub fn base_var_builder(
        &self,
        base: &Base,
        varmap: &VarMap,
        requested: DType,
    ) -> VarBuilder<'static> {
        self.finetune.remember(varmap);
        let low = self.mixed.policy().compute_dtype();
        let low = (low != DType::F32).then_some(low);
        let masters = self.mixed.exact_masters().clone();
        let seeded = SeededInit::new(varmap.clone(), self.data.init_seed(), masters.clone(), low);
        VarBuilder::from_backend(
            Box::new(base.backend(varmap, masters, low, seeded)),
            self.param_dtype(requested),
            self.device().clone(),
        )
    }

    /// A LoRA builder with `config`'s rank, scale and targets; its
    /// [`linear`](Lora::linear) makes the layers. A target that matches no module the model
    /// builds is refused when the model is prepared; a rank of 0, an alpha that is not a
    /// positive number or a dropout outside [0, 1) is refused here.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// use ivme::finetune::LoraConfig;
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// let lora = accelerator.lora(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]))?;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = accelerator.var_builder(&varmap, candle_core::DType::F32);
    /// let q = lora.linear(64, 64, vb.pp("attn.q_proj"))?; // adapted
    /// let o = lora.linear(64, 64, vb.pp("attn.o_proj"))?; // plain
    /// # let _ = (q, o); Ok(()) }
    /// ```
    pub fn lora(&self, config: LoraConfig) -> Result<Lora> {
        Lora::new(config, self.finetune.clone(), self.rng())
    }

    /// Prepares an optimizer built over any of the variables of models made through
    /// [`var_builder`](Self::var_builder) or [`base_var_builder`](Self::base_var_builder) (a
    /// filtered list, the adapters, the head): each such `VarMap` holding one of them is
    /// prepared first if it was not, and the variables no prepared optimizer holds stay
    /// frozen. `#[accelerate]` writes this call for an ivme optimizer built over anything
    /// other than `varmap.all_vars()`.
    ///
    /// ```no_run
    /// # fn main() -> ivme::Result<()> {
    /// use candle_nn::Optimizer;
    /// use ivme::optim::{AdamW, ParamsAdamW};
    /// let mut accelerator = ivme::Accelerator::new()?;
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = accelerator.var_builder(&varmap, candle_core::DType::F32);
    /// let body = candle_nn::linear(8, 8, vb.pp("body"))?;
    /// let head = candle_nn::linear(8, 1, vb.pp("head"))?;
    /// // The head's variables: the body stays frozen.
    /// let trained: Vec<candle_core::Var> = {
    ///     let vars = varmap.data().lock().unwrap();
    ///     vars.iter().filter(|(n, _)| n.starts_with("head.")).map(|(_, v)| v.clone()).collect()
    /// };
    /// let opt = accelerator.prepare_optimizer_of(AdamW::new(trained, ParamsAdamW::default()))?;
    /// # let _ = (body, opt); Ok(()) }
    /// ```
    pub fn prepare_optimizer_of<O, E>(
        &mut self,
        optimizer: std::result::Result<O, E>,
    ) -> Result<AcceleratedOptimizer<O>>
    where
        O: StatefulOptimizer,
        E: Into<Error>,
    {
        let optimizer = optimizer.map_err(Into::into)?;
        let ids: Vec<_> = optimizer
            .vars()
            .iter()
            .map(|v| v.as_tensor().id())
            .collect();
        let rank = self.process_index();
        let note = |e| crate::setup::status::note_final(rank, e);
        for varmap in self.finetune.built() {
            let holds = varmap
                .all_vars()
                .iter()
                .any(|v| ids.contains(&v.as_tensor().id()));
            if holds && self.find_model(&varmap).is_none() {
                self.register_model_holding(&varmap, Some(&ids))
                    .map_err(note)?;
            }
        }
        self.wrap_optimizer(optimizer).map_err(note)
    }

    /// Writes what trained as a LoRA adapter in `dir`, the layout Python's PEFT loads:
    /// `adapter_model.safetensors` (the trained variables' f32 values under
    /// `base_model.model.` + their names: LoRA factors, and whole modules such as a new head
    /// listed as `modules_to_save`) and `adapter_config.json` (rank, alpha, dropout, the
    /// adapted modules, the base folder). Every process waits; the main one writes, each
    /// file whole before any replaces an older one. Returns the files written.
    pub fn save_adapter(&self, dir: &Path, lora: &Lora) -> Result<Vec<PathBuf>> {
        self.wait_for_everyone()?;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for m in self.training.models() {
            for (i, value) in m.whole_masters(&*self.comm)?.into_iter().enumerate() {
                if m.trains(i) {
                    tensors.push((m.names()[i].clone(), value));
                }
            }
        }
        if tensors.is_empty() {
            return Err(Error::Usage(
                "save_adapter found nothing trained: prepare the model and an optimizer over \
                 its adapters first"
                    .into(),
            ));
        }
        let base = self.finetune.base.lock().as_ref().map(|b| b.folder.clone());
        let written = if self.is_main_process() {
            crate::finetune::write_adapter(
                dir,
                &tensors,
                lora.config(),
                &lora.adapted(),
                base.as_deref(),
            )
        } else {
            Ok(Vec::new())
        };
        self.agree("saving the adapter", written)
    }

    /// Loads an adapter folder [`save_adapter`](Self::save_adapter) (or Python's PEFT) wrote
    /// into the prepared models' trained variables, on every rank: each trained variable `n`
    /// takes `base_model.model.n` from `adapter_model.safetensors` (their f32 values become
    /// the masters; the model's low-precision copies are refreshed). Build the model with the
    /// same LoRA targets and rank first; a trained variable the adapter lacks, or one whose
    /// shape differs, is an error that names it, and nothing is changed.
    pub fn load_adapter(&self, dir: &Path) -> Result<LoadReport> {
        let file = dir.join(crate::finetune::ADAPTER_WEIGHTS);
        self.load_named(&file, |m, i| {
            m.trains(i)
                .then(|| format!("{}{}", crate::finetune::PEFT_PREFIX, m.names()[i]))
        })
    }
}
