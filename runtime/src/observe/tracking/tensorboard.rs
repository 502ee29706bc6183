//! A tracker writing TensorBoard event files with our own encoder of the documented format.
//!
//! An event file is a sequence of TFRecords: the payload length as a little-endian u64, a
//! masked CRC-32C of those 8 bytes, the payload, and a masked CRC-32C of the payload. Each
//! payload is a `tensorflow.Event` protocol buffer; the first carries the file version, the
//! others a `Summary` of `simple_value` scalars. Only the few protobuf fields needed are
//! encoded, by hand, which avoids a protobuf toolchain for a handful of bytes.

use super::{project_dir, wall_time, Tracker};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

/// Writes `<dir>/<project>/events.out.tfevents.<time>.<host>.<pid>`, one event per `log` call
/// holding every value as a scalar tagged with its name; point `tensorboard --logdir <dir>` at
/// it. Values are stored as f32, as TensorBoard's scalars are. The run's config is not written
/// (TensorBoard's hyperparameter format is far larger than this writer); use
/// [`JsonlTracker`](super::JsonlTracker) alongside to keep it.
#[derive(Debug)]
pub struct TensorBoardTracker {
    dir: PathBuf,
    path: Option<PathBuf>,
    out: Option<BufWriter<File>>,
}

impl TensorBoardTracker {
    /// A tracker writing under `dir` (one folder per project, which TensorBoard shows as a run).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        TensorBoardTracker {
            dir: dir.into(),
            path: None,
            out: None,
        }
    }

    /// The event file, once `init` has run.
    pub fn path(&self) -> Option<&PathBuf> {
        self.path.as_ref()
    }

    fn write_event(&mut self, event: &[u8]) -> Result<()> {
        let path = self.path.clone().unwrap_or_default();
        let Some(out) = self.out.as_mut() else {
            return Err(Error::Usage(
                "tensorboard: log before init or after finish".into(),
            ));
        };
        out.write_all(&record(event))
            .and_then(|_| out.flush())
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }
}

impl Tracker for TensorBoardTracker {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn init(&mut self, project: &str, _config: &serde_json::Value) -> Result<()> {
        let dir = project_dir(&self.dir, project)?;
        let host = std::env::var("HOSTNAME")
            .ok()
            .filter(|h| !h.is_empty() && !h.contains(['/', '\\']))
            .unwrap_or_else(|| "localhost".into());
        let now = wall_time();
        // TensorBoard finds event files by the `tfevents` in their names; the pid keeps two
        // runs started in the same second apart.
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        self.out = Some(BufWriter::new(file));
        self.path = Some(path);
        self.write_event(&version_event(now))
    }

    fn log(&mut self, values: &BTreeMap<String, f64>, step: u64) -> Result<()> {
        self.write_event(&scalars_event(wall_time(), step, values))
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(mut out) = self.out.take() {
            let path = self.path.clone().unwrap_or_default();
            out.flush()
                .and_then(|_| out.get_ref().sync_all())
                .map_err(|e| Error::io(format!("closing {}", path.display()), e))?;
        }
        Ok(())
    }
}

// Protobuf wire types.
const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LEN: u64 = 2;
const FIXED32: u64 = 5;

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(field: u64, wire: u64, out: &mut Vec<u8>) {
    varint((field << 3) | wire, out);
}

fn bytes_field(field: u64, data: &[u8], out: &mut Vec<u8>) {
    key(field, LEN, out);
    varint(data.len() as u64, out);
    out.extend_from_slice(data);
}

/// `Event { wall_time = 1, step = 2 }`, the part every event shares.
fn event_head(wall_time: f64, step: u64) -> Vec<u8> {
    let mut out = Vec::new();
    key(1, FIXED64, &mut out);
    out.extend_from_slice(&wall_time.to_le_bytes());
    key(2, VARINT, &mut out);
    varint(step, &mut out);
    out
}

/// The first event of a file: `Event { wall_time, step: 0, file_version: "brain.Event:2" }`.
fn version_event(wall_time: f64) -> Vec<u8> {
    let mut out = event_head(wall_time, 0);
    bytes_field(3, b"brain.Event:2", &mut out);
    out
}

/// `Event { wall_time, step, summary = 5: Summary { value = 1: [Value { tag = 1,
/// simple_value = 2 }] } }`.
fn scalars_event(wall_time: f64, step: u64, values: &BTreeMap<String, f64>) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, v) in values {
        let mut value = Vec::new();
        bytes_field(1, tag.as_bytes(), &mut value);
        key(2, FIXED32, &mut value);
        value.extend_from_slice(&(*v as f32).to_le_bytes());
        bytes_field(1, &value, &mut summary);
    }
    let mut out = event_head(wall_time, step);
    bytes_field(5, &summary, &mut out);
    out
}

/// Frames `data` as one TFRecord.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// CRC-32C (Castagnoli), bit-reflected polynomial 0x82F63B78, one table lookup per byte.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 == 1 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |crc, &b| {
        TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8)
    })
}

/// The record format stores CRCs rotated and offset, so a CRC of data that itself holds CRCs
/// stays well distributed.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_published_check_value() {
        // The standard check value of CRC-32C over the ASCII digits 1 to 9.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn varints_use_seven_bits_per_byte() {
        let enc = |v| {
            let mut out = Vec::new();
            varint(v, &mut out);
            out
        };
        assert_eq!(enc(1), [1]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
    }

    #[test]
    fn a_record_frames_length_data_and_checksums() {
        let data = b"abc";
        let rec = record(data);
        assert_eq!(rec.len(), 8 + 4 + 3 + 4);
        assert_eq!(&rec[..8], &3u64.to_le_bytes());
        let mask = |c: u32| c.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(&rec[8..12], &mask(crc32c(&rec[..8])).to_le_bytes());
        assert_eq!(&rec[12..15], data);
        assert_eq!(&rec[15..], &mask(crc32c(data)).to_le_bytes());
    }

    #[test]
    fn a_scalar_event_encodes_the_documented_fields() {
        let values = BTreeMap::from([("a".to_string(), 0.5)]);
        let ev = scalars_event(2.0, 7, &values);
        let mut expected = vec![0x09];
        expected.extend_from_slice(&2.0f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 7]);
        // summary (5, len) { value (1, len) { tag (1, len) "a", simple_value (2, fixed32) } }
        expected.extend_from_slice(&[0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        expected.extend_from_slice(&0.5f32.to_le_bytes());
        assert_eq!(ev, expected);
    }
}
