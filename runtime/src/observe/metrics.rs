//! Metrics across processes: gathering, reducing and broadcasting tensors and small serde
//! values, and splitting work between ranks.
//!
//! Every collective here first exchanges a small header (shape, dtype, rows to drop) so that
//! a rank whose tensor does not fit the others is reported as an error on *every* rank, instead
//! of leaving the others waiting in a collective that can never complete.

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// What a rank tells the others before a tensor collective.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct Header {
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: String,
    /// Rows at the end of this rank's part that are padding (for `gather_for_metrics`).
    pub(crate) drop: usize,
}

impl Header {
    pub(crate) fn of(t: &Tensor, drop: usize) -> Self {
        Header {
            dims: t.dims().to_vec(),
            dtype: t.dtype().as_str().to_string(),
            drop,
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!("{:?} ({})", self.dims, self.dtype)
    }
}

/// Returns the contiguous share of `len` items that rank `rank` of `world` gets: the first
/// `len % world` ranks get one item more than the others.
pub fn split_range(len: usize, rank: usize, world: usize) -> Range<usize> {
    if world == 0 || rank >= world {
        return 0..0;
    }
    let base = len / world;
    let extra = len % world;
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    start..start + size
}

/// Returns rank `rank`'s contiguous share of `items`, padded to the largest share by repeating
/// its own last item (or the list's last item when its share is empty).
pub fn split_padded<T: Clone>(items: &[T], rank: usize, world: usize) -> Vec<T> {
    let range = split_range(items.len(), rank, world);
    let mut part = items[range].to_vec();
    if world == 0 || items.is_empty() {
        return part;
    }
    let target = items.len().div_ceil(world);
    let filler = part.last().or(items.last()).cloned();
    if let Some(filler) = filler {
        part.resize(target, filler);
    }
    part
}

/// A scalar travels as a one-element vector, so every rank contributes one row.
pub(crate) fn at_least_1d(t: &Tensor) -> Result<Tensor> {
    if t.rank() == 0 {
        Ok(t.reshape(1)?)
    } else {
        Ok(t.clone())
    }
}

/// A tensor of `dims` filled with `value`, of `dtype` on `device`.
pub(crate) fn filled(dims: &[usize], value: f64, dtype: DType, device: &Device) -> Result<Tensor> {
    let t = Tensor::zeros(dims, DType::F64, device)?;
    Ok(t.affine(1.0, value)?.to_dtype(dtype)?)
}

// A leading byte says whether JSON or an error message follows, so a rank that cannot encode
// its value makes every rank fail instead of leaving them waiting.
const OBJECT_OK: u8 = 1;
const OBJECT_ERR: u8 = 0;

pub(crate) fn encode_object<T: Serialize>(value: Option<&T>) -> Vec<u8> {
    let encoded = match value {
        Some(v) => serde_json::to_vec(v).map_err(|e| e.to_string()),
        None => Err("it passed None as the value to send; pass Some(value) on that rank".into()),
    };
    match encoded {
        Ok(json) => [vec![OBJECT_OK], json].concat(),
        Err(msg) => [vec![OBJECT_ERR], msg.into_bytes()].concat(),
    }
}

pub(crate) fn decode_object<T: DeserializeOwned>(
    what: &str,
    rank: usize,
    bytes: &[u8],
) -> Result<T> {
    match bytes.split_first() {
        Some((&OBJECT_OK, json)) => serde_json::from_slice(json).map_err(|e| {
            Error::Comm(format!(
                "{what}: rank {rank}'s value does not read back as the requested type ({e}); \
                 every rank must use the same type"
            ))
        }),
        Some((_, msg)) => Err(Error::Comm(format!(
            "{what}: rank {rank} could not send its value: {}",
            String::from_utf8_lossy(msg)
        ))),
        None => Err(Error::Comm(format!("{what}: rank {rank} sent nothing"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ReduceOp;
    use crate::Accelerator;

    #[test]
    fn split_range_covers_every_item_once_with_first_ranks_larger() {
        for len in 0..12 {
            for world in 1..5 {
                let ranges: Vec<_> = (0..world).map(|r| split_range(len, r, world)).collect();
                let flat: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(
                    flat,
                    (0..len).collect::<Vec<_>>(),
                    "len {len} world {world}"
                );
                let sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
                assert!(sizes.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1));
            }
        }
        assert_eq!(split_range(7, 0, 2), 0..4);
        assert_eq!(split_range(7, 1, 2), 4..7);
        assert_eq!(split_range(3, 5, 2), 0..0);
    }

    #[test]
    fn split_padded_repeats_the_last_item() {
        let items = ['a', 'b', 'c', 'd', 'e'];
        assert_eq!(split_padded(&items, 0, 2), ['a', 'b', 'c']);
        assert_eq!(split_padded(&items, 1, 2), ['d', 'e', 'e']);
        // Fewer items than ranks: an empty share borrows the list's last item.
        assert_eq!(split_padded(&items[..1], 1, 3), ['a']);
        assert!(split_padded::<char>(&[], 0, 2).is_empty());
    }

    #[test]
    fn object_payloads_round_trip_and_report_failures() {
        let bytes = encode_object(Some(&vec![1u32, 2, 3]));
        let back: Vec<u32> = decode_object("t", 0, &bytes).unwrap();
        assert_eq!(back, [1, 2, 3]);
        let err = decode_object::<u32>("t", 2, &encode_object::<u32>(None)).unwrap_err();
        assert!(err.to_string().contains("rank 2"), "{err}");
        let err = decode_object::<String>("t", 1, &bytes).unwrap_err();
        assert!(err.to_string().contains("same type"), "{err}");
    }

    #[test]
    fn single_process_collectives_are_identities() -> Result<()> {
        let acc = Accelerator::builder().cpu(true).build()?;
        let t = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
        assert_eq!(acc.gather(&t)?.to_vec2::<f32>()?, t.to_vec2::<f32>()?);
        assert_eq!(
            acc.reduce(&t, ReduceOp::Sum)?.to_vec2::<f32>()?,
            t.to_vec2::<f32>()?
        );
        let s = acc.gather(&Tensor::new(5f32, &Device::Cpu)?)?;
        assert_eq!(s.to_vec1::<f32>()?, [5.]);
        let p = acc.pad_across_processes(&t, 1, -1.0, false)?;
        assert_eq!(p.dims(), [2, 2]);
        assert!(acc.pad_across_processes(&t, 2, 0.0, false).is_err());
        assert!(acc.broadcast(&t, 1).is_err());
        assert_eq!(acc.gather_object(&"x".to_string())?, ["x"]);
        assert_eq!(acc.broadcast_object(Some(&7u8), 0)?, 7);
        assert_eq!(acc.split_between_processes(&[1, 2, 3]), [1, 2, 3]);
        Ok(())
    }

    #[test]
    fn filled_builds_padding_in_the_tensor_dtype() -> Result<()> {
        let t = filled(&[2, 1], -1.0, DType::I64, &Device::Cpu)?;
        assert_eq!(t.to_vec2::<i64>()?, [[-1], [-1]]);
        Ok(())
    }
}
