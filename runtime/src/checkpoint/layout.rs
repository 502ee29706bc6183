//! How a checkpoint's model weights and optimizer state are spread over its rank folders, and
//! putting them back together for a run laid out differently.
//!
//! Without sharding, `rank0` holds every variable whole (`name`, `name::exp_avg`, …). Under
//! sharding each rank holds its contiguous slice of the flat parameter space (variables in name
//! order, as the gradient buckets order them), as runs named `name[from..to]` (elements of the
//! flattened variable) and `name[from..to]::exp_avg`. The manifest's `extra.layout` records the
//! stage, the world size and, per model, how many elements each rank's slice has, so a load can
//! tell which rank folders hold the elements it needs without opening the others.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::format::{bad, unfit};
use super::store::Manifest;
use crate::error::Result;
use crate::setup::config::Sharding;

/// The layout of a checkpoint's model and optimizer state, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The sharding stage of the run that saved it (`"no"`, `"optimizer"`, `"gradients"`).
    pub sharding: String,
    /// How many processes saved it.
    pub world_size: usize,
    /// Per model, the elements of each rank's slice (empty without sharding).
    #[serde(default)]
    pub counts: Vec<Vec<usize>>,
}

impl Layout {
    /// The layout `manifest` records; checkpoints written before layouts were recorded are
    /// unsharded.
    pub fn of(dir: &Path, manifest: &Manifest) -> Result<Layout> {
        match manifest.extra.get("layout") {
            None | Some(Value::Null) => Ok(Layout {
                sharding: Sharding::No.to_string(),
                world_size: manifest.world_size,
                counts: Vec::new(),
            }),
            Some(v) => {
                let layout: Layout = serde_json::from_value(v.clone()).map_err(|e| {
                    bad(
                        dir,
                        format!("manifest has a `layout` that cannot be read ({e})"),
                    )
                })?;
                let stage: Sharding = layout.sharding.parse().map_err(|e| {
                    bad(
                        dir,
                        format!("manifest names an unknown sharding stage: {e}"),
                    )
                })?;
                let counts_fit = layout.counts.iter().all(|c| c.len() == layout.world_size);
                if layout.world_size != manifest.world_size
                    || (stage != Sharding::No && !counts_fit)
                {
                    return Err(bad(
                        dir,
                        "manifest's `layout` does not match its world size (a damaged manifest?)",
                    ));
                }
                Ok(layout)
            }
        }
    }

    /// Whether each rank folder holds a slice (rather than rank 0 holding everything).
    pub fn is_sharded(&self) -> bool {
        self.sharding != Sharding::No.as_str()
    }

    /// The saved ranks whose slices of model `model` overlap elements `from..to`.
    pub fn ranks_holding(&self, model: usize, from: usize, to: usize) -> Vec<usize> {
        if !self.is_sharded() {
            return vec![0];
        }
        let Some(counts) = self.counts.get(model) else {
            return Vec::new();
        };
        let mut at = 0;
        let mut out = Vec::new();
        for (r, &c) in counts.iter().enumerate() {
            if c > 0 && at < to && from < at + c {
                out.push(r);
            }
            at += c;
        }
        out
    }
}

/// The name of a run of a variable's elements: `name[from..to]`.
pub(crate) fn run_name(name: &str, from: usize, len: usize) -> String {
    format!("{name}[{from}..{}]", from + len)
}

/// Splits `name[from..to]` into the name and the element range; a name that does not end in
/// such a range (`w`, or `h[0]`) is a whole variable.
fn parse_run(saved: &str) -> (&str, Option<(usize, usize)>) {
    let range = || -> Option<(&str, (usize, usize))> {
        let body = saved.strip_suffix(']')?;
        let open = body.rfind('[')?;
        let (a, b) = body[open + 1..].split_once("..")?;
        let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
        (a < b).then_some((&body[..open], (a, b)))
    };
    match range() {
        Some((name, r)) => (name, Some(r)),
        None => (saved, None),
    }
}

/// One saved run: its first element, its values (flat) and, for a whole variable, the shape
/// it was saved with.
type Run = (usize, Tensor, Option<Vec<usize>>);

/// Saved values gathered from any number of rank folders: for each key (a variable name, or
/// `name::state` for an optimizer's tensors), runs of its flattened elements.
#[derive(Default)]
pub(crate) struct Runs {
    runs: BTreeMap<String, Vec<Run>>,
}

/// What a taken range must belong to: the variable's whole shape and the dtype it is kept in.
pub(crate) struct Whole<'a> {
    pub dims: &'a [usize],
    pub dtype: DType,
}

impl Runs {
    /// Adds the tensors of one saved component: whole variables (kept whole, flattened) or
    /// `name[from..to]` runs, each optionally followed by `::state`.
    pub fn add(&mut self, file: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
        for (saved, t) in tensors {
            let (var, state) = match saved.split_once("::") {
                Some((v, s)) => (v, Some(s)),
                None => (saved.as_str(), None),
            };
            let (name, range) = parse_run(var);
            let shape = t.dims().to_vec();
            let flat = t.flatten_all()?;
            let (from, whole) = match range {
                Some((a, b)) if b - a == flat.elem_count() => (a, None),
                Some(_) => {
                    return Err(unfit(
                        file,
                        format!(
                            "has `{saved}` with {} elements, not the range's",
                            flat.elem_count()
                        ),
                    ))
                }
                None => (0, Some(shape)),
            };
            let key = match state {
                Some(s) => format!("{name}::{s}"),
                None => name.to_string(),
            };
            self.runs.entry(key).or_default().push((from, flat, whole));
        }
        Ok(())
    }

    /// The keys present, in order.
    pub fn keys(&self) -> Vec<String> {
        self.runs.keys().cloned().collect()
    }

    /// The shape `key` was saved with, when it was saved whole.
    pub fn whole_shape(&self, key: &str) -> Option<Vec<usize>> {
        self.runs.get(key)?.iter().find_map(|(_, _, s)| s.clone())
    }

    /// The dtype of `key`'s first run.
    pub fn dtype(&self, key: &str) -> Option<DType> {
        Some(self.runs.get(key)?.first()?.1.dtype())
    }

    /// Takes elements `from..from + len` of `key` (a variable of shape and dtype `whole`) as
    /// one flat tensor, out of the runs that hold them, or says what does not fit: a whole
    /// variable saved with another shape or dtype, a run past the variable's end, elements no
    /// run holds. A run that is exactly the range is moved out (no copy); others are cut (a
    /// view when one run holds the whole range) and joined.
    pub fn take(
        &mut self,
        file: &Path,
        key: &str,
        from: usize,
        len: usize,
        whole: &Whole,
    ) -> Result<Tensor> {
        let Some(runs) = self.runs.get_mut(key) else {
            return Err(unfit(
                file,
                format!("has no `{key}`: was it saved by this model?"),
            ));
        };
        let numel: usize = whole.dims.iter().product();
        for (a, t, shape) in runs.iter() {
            let wrong_shape = shape.as_ref().is_some_and(|s| s.as_slice() != whole.dims);
            if wrong_shape || t.dtype() != whole.dtype || a + t.elem_count() > numel {
                let saved = match shape {
                    Some(s) => format!("{s:?}"),
                    None => format!("elements {a}..{}", a + t.elem_count()),
                };
                return Err(unfit(
                    file,
                    format!(
                        "has `{key}` as {:?} {saved} but the model's is {:?} {:?}; was it \
                         saved by this model?",
                        t.dtype(),
                        whole.dtype,
                        whole.dims
                    ),
                ));
            }
        }
        if let Some(i) = runs
            .iter()
            .position(|(a, t, _)| *a == from && t.elem_count() == len)
        {
            return Ok(runs.swap_remove(i).1);
        }
        runs.sort_by_key(|(a, _, _)| *a);
        let (end, mut at) = (from + len, from);
        let mut parts = Vec::new();
        for (a, t, _) in runs.iter() {
            let b = a + t.elem_count();
            if b <= at || *a >= end {
                continue;
            }
            if *a > at {
                break;
            }
            let upto = b.min(end);
            parts.push(t.narrow(0, at - a, upto - at)?);
            at = upto;
        }
        if at < end {
            return Err(unfit(
                file,
                format!(
                    "holds no value for elements {at}..{end} of `{key}` (a checkpoint of another \
                     model, or a rank folder missing?)"
                ),
            ));
        }
        // One part stays a view into its run; a load copies it into the variable.
        Ok(Tensor::cat(&parts, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn runs_from_any_split_join_into_any_other_exactly() {
        let cpu = &Device::Cpu;
        let whole: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let t = Tensor::new(whole.as_slice(), cpu).unwrap();
        let mut runs = Runs::default();
        let dir = Path::new("ckpt");
        // Saved by 3 ranks: 0..3, 3..7, 7..10, with a moment beside each.
        for (a, b) in [(0, 3), (3, 7), (7, 10)] {
            let part = t.narrow(0, a, b - a).unwrap();
            runs.add(
                dir,
                vec![
                    (run_name("w", a, b - a), part.clone()),
                    (
                        format!("{}::m", run_name("w", a, b - a)),
                        (part * 2.0).unwrap(),
                    ),
                ],
            )
            .unwrap();
        }
        let w = Whole {
            dims: &[10],
            dtype: DType::F32,
        };
        let got = runs
            .take(dir, "w", 2, 6, &w)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(got, whole[2..8]);
        let m = runs
            .take(dir, "w::m", 0, 10, &w)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(m, whole.iter().map(|x| x * 2.0).collect::<Vec<_>>());
        let longer = Whole {
            dims: &[13],
            dtype: DType::F32,
        };
        let e = runs.take(dir, "w", 8, 5, &longer).unwrap_err().to_string();
        assert!(e.contains("elements 10..13 of `w`"), "{e}");
        let shorter = Whole {
            dims: &[9],
            dtype: DType::F32,
        };
        let e = runs.take(dir, "w", 0, 3, &shorter).unwrap_err().to_string();
        assert!(e.contains("elements 7..10") && e.contains("[9]"), "{e}");
        let e = runs.take(dir, "v", 0, 1, &w).unwrap_err().to_string();
        assert!(e.contains("no `v`"), "{e}");
        // A whole variable (an unsharded checkpoint) is one run from element 0.
        let mut whole_runs = Runs::default();
        let m2 = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], cpu).unwrap();
        whole_runs.add(dir, vec![("layer.w".into(), m2)]).unwrap();
        let w22 = Whole {
            dims: &[2, 2],
            dtype: DType::F32,
        };
        let got = whole_runs.take(dir, "layer.w", 1, 2, &w22).unwrap();
        assert_eq!(got.to_vec1::<f32>().unwrap(), [2.0, 3.0]);
        let as_row = Whole {
            dims: &[4],
            dtype: DType::F32,
        };
        let e = whole_runs.take(dir, "layer.w", 0, 4, &as_row).unwrap_err();
        assert!(e.to_string().contains("[2, 2]"), "{e}");
        assert_eq!(parse_run("a.b[3..9]"), ("a.b", Some((3, 9))));
        // Names that merely end in brackets are whole variables.
        assert_eq!(parse_run("a.b[9..3]"), ("a.b[9..3]", None));
        assert_eq!(parse_run("h[0]"), ("h[0]", None));
    }

    #[test]
    fn a_layout_names_the_ranks_holding_a_range() {
        let l = Layout {
            sharding: "optimizer".into(),
            world_size: 3,
            counts: vec![vec![3, 4, 4]],
        };
        assert_eq!(l.ranks_holding(0, 0, 11), vec![0, 1, 2]);
        assert_eq!(l.ranks_holding(0, 3, 7), vec![1]);
        assert_eq!(l.ranks_holding(0, 2, 4), vec![0, 1]);
        let ddp = Layout {
            sharding: "no".into(),
            world_size: 2,
            counts: vec![],
        };
        assert_eq!(ddp.ranks_holding(0, 5, 9), vec![0]);
    }
}
