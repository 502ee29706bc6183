//! Tests of ParquetFiles: rows a batch asks for, damaged and mismatched files, the decoded-group
//! cache, page checksums.

use super::*;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

pub(super) fn write(path: &Path, batches: &[RecordBatch], compression: Compression, group: usize) {
    let props = WriterProperties::builder()
        .set_compression(compression)
        .set_max_row_group_row_count(Some(group))
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(file, batches[0].schema(), Some(props)).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
}

#[test]
fn parquet_files_read_the_rows_a_batch_asks_for() {
    let dir = scratch("parquet");
    // 31 rows in row groups of 7 (snappy), 14 in groups of 5 (zstd).
    write(
        &dir.join("a.parquet"),
        &batches(0, 31, 8),
        Compression::SNAPPY,
        7,
    );
    let zstd = Compression::ZSTD(ZstdLevel::try_new(3).unwrap());
    write(&dir.join("b.parquet"), &batches(31, 45, 8), zstd, 5);
    let open =
        || ParquetFiles::open(&[dir.join("a.parquet"), dir.join("b.parquet")], &ALL).unwrap();
    let rows = open();
    assert_eq!(rows.len(), 45);
    for i in 0..45 {
        check_row(&rows.get(i).unwrap(), i);
    }
    // Out of order, repeated, across row groups and files.
    let want = [44, 3, 8, 3, 30, 31, 0, 44, 13];
    let got = rows.get_batch(&want, &Device::Cpu).unwrap();
    let ids: Vec<usize> = got.iter().map(|r| r.int("id").unwrap() as usize).collect();
    assert_eq!(ids, want);
    got.iter().zip(want).for_each(|(r, i)| check_row(r, i));
    check_shards(open, 45);
    // Prefetch workers read one file from several threads at once.
    let rows = Arc::new(open());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let rows = rows.clone();
            std::thread::spawn(move || {
                for k in 0..30 {
                    let i = (k * 7 + t * 11) % 45;
                    check_row(&rows.get(i).unwrap(), i);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damaged_or_mismatched_parquet_files_are_refused_naming_the_file() {
    let dir = scratch("parquet-bad");
    let good = dir.join("good.parquet");
    write(&good, &batches(0, 200, 50), Compression::SNAPPY, 100);
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() - 30]).unwrap();
    let err = ParquetFiles::open(&[&cut], &["id"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cut.parquet") && err.contains("Parquet"),
        "{err}"
    );
    let text = dir.join("text.parquet");
    std::fs::write(&text, "id,text\n1,one\n").unwrap();
    let err = ParquetFiles::open(&[&text], &["id"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("text.parquet"), "{err}");
    let err = ParquetFiles::open(&[&good], &["label"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no column `label`") && err.contains("id, text"),
        "{err}"
    );
    let err = ParquetFiles::open(&[&good], &["blob"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`blob`") && err.contains("good.parquet"),
        "{err}"
    );
    // Bytes of the data pages overwritten: the footer still opens, the batch that reads
    // them fails naming the file and the row group.
    let mut broken = bytes.clone();
    for b in &mut broken[8..bytes.len() / 3] {
        *b = 0x5a;
    }
    let bad = dir.join("broken.parquet");
    std::fs::write(&bad, &broken).unwrap();
    let rows = ParquetFiles::open(&[&bad], &["id", "text"]).unwrap();
    let err = rows
        .get_batch(&[1, 2], &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("broken.parquet") && err.contains("row group 0"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Keeping decoded row groups changes no sample: a shuffled epoch over row groups of 7
/// reads the same rows, in the same order, with the cache on (the default) and off.
#[test]
fn the_decoded_group_cache_changes_no_sample() {
    let dir = scratch("parquet-cache");
    let path = dir.join("a.parquet");
    write(&path, &batches(0, 45, 8), Compression::SNAPPY, 7);
    let epoch = |bytes: u64| -> Vec<i64> {
        let rows = ParquetFiles::open(&[&path], &ALL)
            .unwrap()
            .cache_bytes(bytes);
        let mut loader = crate::data::DataLoader::new(rows, 4).shuffle(true).seed(3);
        let mut ids = Vec::new();
        for batch in loader.iter() {
            for r in batch.unwrap() {
                check_row(&r, r.int("id").unwrap() as usize);
                ids.push(r.int("id").unwrap());
            }
        }
        ids
    };
    let (cached, uncached) = (epoch(1 << 30), epoch(0));
    assert_eq!(cached, uncached);
    let mut sorted = cached.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..45).collect::<Vec<i64>>());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Parquet file pyarrow wrote with page checksums (scripts/make-data-fixtures.sh):
/// 400 rows, two row groups of 200, `id` = 1,000,000 + row, uncompressed and plainly
/// encoded, so that a flipped byte still decodes and only the checksum can tell.
fn checksummed(dir: &Path) -> PathBuf {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data/checksummed.parquet");
    let path = dir.join("checksummed.parquet");
    std::fs::copy(&fixture, &path).unwrap();
    path
}

/// The loader's batches of 50 rows, in order, until the first error (its batch index and
/// message), with or without prefetch workers.
fn read_until_error(path: &Path, prefetch: usize) -> (Vec<i64>, Option<(usize, String)>) {
    let rows = ParquetFiles::open(&[path], &["id", "text"]).unwrap();
    let mut loader = crate::data::DataLoader::new(rows, 50);
    if prefetch > 0 {
        loader = loader.prefetch(prefetch);
    }
    let mut ids = Vec::new();
    for (b, batch) in loader.iter().enumerate() {
        match batch {
            Ok(rows) => ids.extend(rows.iter().map(|r| r.int("id").unwrap())),
            Err(e) => return (ids, Some((b, e.to_string()))),
        }
    }
    (ids, None)
}

#[test]
fn a_page_that_fails_its_checksum_fails_the_batch_that_reads_it_naming_the_column() {
    let dir = scratch("parquet-crc");
    let path = checksummed(&dir);
    // Intact, every checksum matches and every row reads back.
    let (ids, err) = read_until_error(&path, 0);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(ids, (0..400).map(|i| 1_000_000 + i).collect::<Vec<i64>>());
    // One bit of row 300's `id` flipped, inside the data page of row group 1.
    let mut bytes = std::fs::read(&path).unwrap();
    let needle = (1_000_300i64).to_le_bytes();
    let at = bytes
        .windows(8)
        .position(|w| w == needle)
        .expect("row 300's id, plainly encoded");
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    for prefetch in [0, 2] {
        let (ids, err) = read_until_error(&path, prefetch);
        // The four batches of row group 0 arrive whole; the fifth, the first to read row
        // group 1's page, fails: no row of the damaged page is ever a sample.
        assert_eq!(ids, (0..200).map(|i| 1_000_000 + i).collect::<Vec<i64>>());
        let (batch, msg) = err.expect("the damaged page is refused");
        assert_eq!(batch, 4, "prefetch {prefetch}: {msg}");
        for part in [
            "checksummed.parquet",
            "row group 1",
            "column `id`",
            "CRC-32",
        ] {
            assert!(
                msg.contains(part),
                "prefetch {prefetch}: no `{part}` in: {msg}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
