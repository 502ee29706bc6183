//! The pretrained base of a fine-tune: a Hugging Face model folder's safetensors, checksummed
//! and agreed across processes, each tensor read when the model asks for it and handed out as a
//! constant.

use super::pattern::matches;
use super::FineTuning;
use crate::checkpoint::format::TensorInfo;
use crate::checkpoint::fsio::size_and_crc_of;
use crate::checkpoint::read::{read_header_at, read_one};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::precision::exact_init::{add_variable, ExactMasters, SeededInit};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarMap};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One safetensors file of a base folder, as every process must see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseFile {
    /// The file's name inside the folder.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its CRC-32.
    pub crc32: u32,
}

/// Where one tensor of the base lies.
struct Stored {
    /// Its file, an index into `Opened::handles`.
    file: usize,
    /// Where the file's data starts.
    start: u64,
    info: TensorInfo,
}

struct Opened {
    folder: PathBuf,
    files: Vec<BaseFile>,
    /// The open files, read with positioned reads (no mapping stays resident).
    handles: Vec<(PathBuf, File)>,
    tensors: HashMap<String, Stored>,
}

impl Opened {
    /// The tensor `name` (which the base holds) on `dev` in `dtype`.
    fn load(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let s = &self.tensors[name];
        let (path, file) = &self.handles[s.file];
        let t = read_one(file, path, s.start, &s.info).map_err(candle_core::Error::wrap)?;
        t.to_device(dev)?.to_dtype(dtype)
    }

    /// The shape of `name` and the name of the file holding it, if the base holds it.
    fn shape(&self, name: &str) -> Option<(&[usize], &str)> {
        self.tensors
            .get(name)
            .map(|s| (s.info.shape.as_slice(), self.files[s.file].name.as_str()))
    }
}

/// A pretrained model folder opened for fine-tuning (see
/// [`Accelerator::load_base`](crate::Accelerator::load_base)); build the model over it with
/// [`Accelerator::base_var_builder`](crate::Accelerator::base_var_builder).
#[derive(Clone)]
pub struct Base {
    opened: Arc<Opened>,
    /// Indices of this base's unfreeze patterns in the fine-tune's targets.
    unfreeze: Vec<(usize, String)>,
    record: FineTuning,
}

impl std::fmt::Debug for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Base")
            .field("folder", &self.opened.folder)
            .field("tensors", &self.opened.tensors.len())
            .field("unfreeze", &self.unfreeze)
            .finish()
    }
}

impl Base {
    /// Opens `folder`'s safetensors (see `Accelerator::load_base`): checksummed, checked the
    /// same on every process through `comm`, each tensor read when the model asks for it.
    pub(crate) fn open(folder: &Path, comm: &dyn Communicator, record: FineTuning) -> Result<Base> {
        let files = base_files(folder)?;
        let mut listed = Vec::with_capacity(files.len());
        for path in &files {
            // A Hugging Face cache's snapshot folder links its files to blobs.
            let (bytes, crc32) = size_and_crc_of(path, true)?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            listed.push(BaseFile { name, bytes, crc32 });
        }
        agree(folder, &listed, comm)?;
        let mut handles = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (k, path) in files.iter().enumerate() {
            let (header, start) = read_header_at(path)?;
            for info in header.tensors {
                if let Some(other) = tensors.get(&info.name).map(|s: &Stored| s.file) {
                    return Err(Error::Prepare(format!(
                        "the base {} holds `{}` twice, in {} and {}",
                        folder.display(),
                        info.name,
                        listed[other].name,
                        listed[k].name
                    )));
                }
                tensors.insert(
                    info.name.clone(),
                    Stored {
                        file: k,
                        start,
                        info,
                    },
                );
            }
            let file = std::fs::File::open(path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            handles.push((path.clone(), file));
        }
        *record.base.lock() = Some(super::BaseRecord {
            folder: folder.to_path_buf(),
            files: listed.clone(),
        });
        Ok(Base {
            opened: Arc::new(Opened {
                folder: folder.to_path_buf(),
                files: listed,
                handles,
                tensors,
            }),
            unfreeze: Vec::new(),
            record,
        })
    }
}

/// Fails on every process unless all of them list the same base files.
fn agree(folder: &Path, files: &[BaseFile], comm: &dyn Communicator) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mine = serde_json::to_vec(files)?;
    let all = comm.all_gather_bytes(&mine)?;
    let lists: Vec<Vec<BaseFile>> = all
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()?;
    for (rank, theirs) in lists.iter().enumerate() {
        if theirs == &lists[0] {
            continue;
        }
        let differs = lists[0]
            .iter()
            .zip(theirs)
            .find(|(a, b)| a != b)
            .map(|(a, b)| {
                format!(
                    "`{}` is {} bytes with CRC-32 {:08x} on rank 0 but `{}` is {} bytes with \
                     CRC-32 {:08x} on rank {rank}",
                    a.name, a.bytes, a.crc32, b.name, b.bytes, b.crc32
                )
            })
            .unwrap_or_else(|| {
                format!(
                    "rank 0 has {} safetensors files there and rank {rank} has {}",
                    lists[0].len(),
                    theirs.len()
                )
            });
        return Err(Error::Prepare(format!(
            "the processes opened different bases at {}: {differs}; every process must \
             fine-tune the same pretrained weights (copy the same folder to every machine)",
            folder.display()
        )));
    }
    Ok(())
}

/// The `*.safetensors` files of a model folder, in name order.
pub(crate) fn base_files(folder: &Path) -> Result<Vec<PathBuf>> {
    let listing = std::fs::read_dir(folder).map_err(|e| {
        Error::Prepare(format!(
            "cannot open the base model folder {}: {e}",
            folder.display()
        ))
    })?;
    let mut files: Vec<PathBuf> = listing
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Prepare(format!(
            "the base model folder {} holds no .safetensors file (a Hugging Face model folder \
             has model.safetensors or model-0000k-of-0000n.safetensors shards)",
            folder.display()
        )));
    }
    Ok(files)
}

impl Base {
    /// Trains the base tensors whose names `pattern` matches (a module name such as `head` or
    /// `layers.11`, `*` for any characters): they become variables of the `VarMap`, starting
    /// from the base's values. Refused when the pattern matches none of the base's tensors.
    pub fn unfreeze(mut self, pattern: &str) -> Result<Self> {
        if !self.opened.tensors.keys().any(|n| matches(pattern, n)) {
            let mut names: Vec<&String> = self.opened.tensors.keys().collect();
            names.sort();
            let some: Vec<&str> = names.iter().take(8).map(|s| s.as_str()).collect();
            return Err(Error::Prepare(format!(
                "the unfreeze pattern `{pattern}` matches none of the {} tensors of the base {} \
                 (they include {}); a pattern matches a whole name, a module prefix of it or its \
                 last parts, and `*` matches any characters",
                names.len(),
                self.opened.folder.display(),
                some.join(", ")
            )));
        }
        let k = self.record.add_target("unfreeze pattern", pattern);
        // Counted when the model asks for a matching tensor.
        self.unfreeze.push((k, pattern.to_string()));
        Ok(self)
    }

    /// The folder the base was read from.
    pub fn folder(&self) -> &Path {
        &self.opened.folder
    }

    /// The base's safetensors files with their sizes and checksums, in name order.
    pub fn files(&self) -> &[BaseFile] {
        &self.opened.files
    }

    /// The number of tensors in the base.
    pub fn len(&self) -> usize {
        self.opened.tensors.len()
    }

    /// Whether the base holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.opened.tensors.is_empty()
    }

    /// The backend of `Accelerator::base_var_builder`: the base's tensors as constants,
    /// unfrozen and new names as variables of `varmap` (new ones drawn by `seeded`).
    pub(crate) fn backend(
        &self,
        varmap: &VarMap,
        masters: ExactMasters,
        low: Option<DType>,
        seeded: SeededInit,
    ) -> impl SimpleBackend + 'static {
        OverBase {
            base: self.clone(),
            varmap: varmap.clone(),
            masters,
            low,
            seeded,
        }
    }

    /// The unfreeze pattern matching `name`, counted as a match.
    fn unfrozen(&self, name: &str) -> bool {
        match self.unfreeze.iter().find(|(_, p)| matches(p, name)) {
            Some((k, _)) => {
                self.record.hit(*k);
                true
            }
            None => false,
        }
    }
}

/// The backend [`Base::var_builder`] builds over.
struct OverBase {
    base: Base,
    varmap: VarMap,
    masters: ExactMasters,
    low: Option<DType>,
    seeded: SeededInit,
}

impl SimpleBackend for OverBase {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if self.varmap.data().lock().unwrap().contains_key(name) {
            return self.varmap.get(s, name, h, dtype, dev);
        }
        let Some((shape, file)) = self.base.opened.shape(name) else {
            // An adapter, a new head: trained, drawn from the seed.
            return self.seeded.get(s, name, h, dtype, dev);
        };
        if shape != s.dims() {
            candle_core::bail!(
                "the model asks for `{name}` with shape {:?} but the base {} holds it with shape \
                 {shape:?} (in {file}): build the model with the configuration the base was \
                 saved with",
                s.dims(),
                self.base.opened.folder.display()
            );
        }
        if !self.base.unfrozen(name) {
            *self.base.record.constants.lock() += s.elem_count();
            return self.base.opened.load(name, dtype, dev);
        }
        // Under bf16/fp16 the master starts from the file's f32 value, not from its rounding.
        let exact = self.base.opened.load(name, DType::F32, dev)?;
        add_variable(&self.varmap, name, exact, dtype, self.low, &self.masters)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        if self.varmap.data().lock().unwrap().contains_key(name) {
            return self.varmap.get_unchecked(name, dtype, dev);
        }
        if self.base.opened.tensors.contains_key(name) && !self.base.unfrozen(name) {
            return self.base.opened.load(name, dtype, dev);
        }
        self.varmap.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.contains_tensor(name) || self.base.opened.tensors.contains_key(name)
    }
}
