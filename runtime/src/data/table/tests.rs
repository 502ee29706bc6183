//! Tables written here by the arrow and parquet writers, read back row by row and through a
//! sharded, shuffled loader; damaged and mismatched files refused naming the file.

use super::*;
use crate::data::{DataLoader, Dataset};
use arrow_array::builder::{Int32Builder, ListBuilder};
use arrow_array::{ArrayRef, BinaryArray, Float32Array, Int64Array, StringArray};
use candle_core::Device;
use std::path::{Path, PathBuf};

/// A scratch folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ivme-table-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What row `i` holds, computed independently of any reader.
fn expected(i: usize) -> (i64, String, Vec<i64>, f64, Option<i64>) {
    let ids = (0..i % 5).map(|j| (i * 10 + j) as i64).collect();
    let maybe = (i % 4 != 0).then_some(i as i64 * 3);
    (i as i64, format!("row {i}"), ids, i as f64 * 0.5, maybe)
}

/// Record batches of rows `from..to`, `per` rows each: id, text, ids (list of i32), score
/// (f32), maybe (nullable i64), blob (binary, which ivme does not read).
fn batches(from: usize, to: usize, per: usize) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    let mut at = from;
    while at < to {
        let end = (at + per).min(to);
        let rows: Vec<_> = (at..end).map(expected).collect();
        let mut ids = ListBuilder::new(Int32Builder::new());
        for r in &rows {
            ids.values()
                .append_slice(&r.2.iter().map(|&v| v as i32).collect::<Vec<_>>());
            ids.append(true);
        }
        let cols: Vec<(&str, ArrayRef)> = vec![
            (
                "id",
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.0))),
            ),
            (
                "text",
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| &r.1))),
            ),
            ("ids", Arc::new(ids.finish())),
            (
                "score",
                Arc::new(Float32Array::from_iter_values(
                    rows.iter().map(|r| r.3 as f32),
                )),
            ),
            (
                "maybe",
                Arc::new(Int64Array::from(
                    rows.iter().map(|r| r.4).collect::<Vec<_>>(),
                )),
            ),
            (
                "blob",
                Arc::new(BinaryArray::from_iter_values(
                    rows.iter().map(|r| r.1.as_bytes()),
                )),
            ),
        ];
        out.push(RecordBatch::try_from_iter(cols).unwrap());
        at = end;
    }
    out
}

/// Checks that `row` is row `i` of the data set.
fn check_row(row: &Row, i: usize) {
    let (id, text, ids, score, maybe) = expected(i);
    assert_eq!(row.int("id").unwrap(), id);
    assert_eq!(row.text("text").unwrap(), text);
    assert_eq!(row.ints("ids").unwrap(), &ids[..]);
    assert_eq!(row.float("score").unwrap(), score);
    match maybe {
        Some(v) => assert_eq!(row.int("maybe").unwrap(), v),
        None => assert_eq!(row.get("maybe").unwrap(), &Value::Null),
    }
}

const ALL: [&str; 5] = ["id", "text", "ids", "score", "maybe"];

/// Every row of an epoch, over 3 shuffled shards, each exactly once and each with its values.
fn check_shards<D: Dataset<Item = Row, Batch = Vec<Row>>>(build: impl Fn() -> D, n: usize) {
    let mut seen = Vec::new();
    for r in 0..3 {
        let mut loader = DataLoader::new(build(), 4)
            .shuffle(true)
            .seed(9)
            .shard(r, 3)
            .unwrap();
        let mut rows: Vec<Row> = loader.iter().flat_map(|b| b.unwrap()).collect();
        rows.truncate(rows.len() - loader.last_batch_padding());
        for row in rows {
            let i = row.int("id").unwrap() as usize;
            check_row(&row, i);
            seen.push(i);
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..n).collect::<Vec<_>>(), "each row once per epoch");
}

#[cfg(feature = "arrow")]
mod arrow {
    use super::*;
    use arrow_ipc::writer::{FileWriter, StreamWriter};

    pub(super) fn write_file(path: &Path, batches: &[RecordBatch]) {
        let mut w = FileWriter::try_new(std::fs::File::create(path).unwrap(), &batches[0].schema())
            .unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }

    pub(super) fn write_stream(path: &Path, batches: &[RecordBatch]) {
        let mut w =
            StreamWriter::try_new(std::fs::File::create(path).unwrap(), &batches[0].schema())
                .unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn arrow_files_and_streams_read_every_row_where_it_lies() {
        let dir = scratch("arrow");
        // 23 rows in the file format (batches of 5), 17 in the stream format (batches of 6).
        write_file(&dir.join("a.arrow"), &batches(0, 23, 5));
        write_stream(&dir.join("b.arrow"), &batches(23, 40, 6));
        let open = || ArrowFiles::open(&[dir.join("a.arrow"), dir.join("b.arrow")], &ALL).unwrap();
        let rows = open();
        assert_eq!(rows.len(), 40);
        for i in 0..40 {
            check_row(&rows.get(i).unwrap(), i);
        }
        let row = rows.get(30).unwrap();
        assert_eq!(
            row.source(),
            (dir.join("b.arrow").display().to_string().as_str(), 7)
        );
        assert_eq!(rows.files().unwrap().len(), 2);
        check_shards(open, 40);
        let batch = rows.get_batch(&[39, 0, 39], &Device::Cpu).unwrap();
        assert_eq!(
            batch
                .iter()
                .map(|r| r.int("id").unwrap())
                .collect::<Vec<_>>(),
            [39, 0, 39]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_hugging_face_cache_folder_opens_by_its_path_and_split() {
        let dir = scratch("hf");
        // `load_dataset`'s cache: two train shards (written out of order), a test split and
        // a `.map()` result that is no split.
        write_stream(
            &dir.join("demo-train-00001-of-00002.arrow"),
            &batches(10, 25, 4),
        );
        write_stream(
            &dir.join("demo-train-00000-of-00002.arrow"),
            &batches(0, 10, 4),
        );
        write_stream(&dir.join("demo-test.arrow"), &batches(0, 3, 4));
        write_stream(&dir.join("cache-5f2a9c.arrow"), &batches(0, 2, 4));
        std::fs::write(dir.join("dataset_info.json"), "{}").unwrap();
        let train = ArrowFiles::open_hf(&dir, "train", &["id", "text"]).unwrap();
        assert_eq!(train.len(), 25);
        for i in 0..25 {
            assert_eq!(
                train.get(i).unwrap().int("id").unwrap(),
                i as i64,
                "shard order"
            );
        }
        assert_eq!(ArrowFiles::open_hf(&dir, "test", &["id"]).unwrap().len(), 3);
        let err = ArrowFiles::open_hf(&dir, "validation", &["id"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no split `validation`") && err.contains("test"),
            "{err}"
        );
        assert!(!err.contains("5f2a9c"), "{err}");

        // `save_to_disk` of a dictionary of splits.
        let saved = dir.join("saved");
        std::fs::create_dir_all(saved.join("train")).unwrap();
        std::fs::write(saved.join("dataset_dict.json"), r#"{"splits": ["train"]}"#).unwrap();
        write_stream(
            &saved.join("train/data-00000-of-00002.arrow"),
            &batches(0, 7, 3),
        );
        write_stream(
            &saved.join("train/data-00001-of-00002.arrow"),
            &batches(7, 12, 3),
        );
        std::fs::write(
            saved.join("train/state.json"),
            r#"{"_data_files": [{"filename": "data-00000-of-00002.arrow"},
                {"filename": "data-00001-of-00002.arrow"}], "_split": "train"}"#,
        )
        .unwrap();
        let rows = ArrowFiles::open_hf(&saved, "train", &ALL).unwrap();
        assert_eq!(rows.len(), 12);
        check_row(&rows.get(11).unwrap(), 11);
        let err = ArrowFiles::open_hf(&saved, "test", &ALL)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no split `test`") && err.contains("train"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn damaged_or_mismatched_arrow_files_are_refused_naming_the_file() {
        let dir = scratch("arrow-bad");
        let good = dir.join("good.arrow");
        write_file(&good, &batches(0, 30, 10));
        let stream = dir.join("stream.arrow");
        write_stream(&stream, &batches(0, 30, 10));
        let bytes = std::fs::read(&good).unwrap();
        let sbytes = std::fs::read(&stream).unwrap();
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("cut.arrow", bytes[..bytes.len() - 40].to_vec(), "no footer"),
            (
                "cut-stream.arrow",
                sbytes[..sbytes.len() / 2].to_vec(),
                "cannot be read",
            ),
            ("text.arrow", b"id,text\n1,one\n".to_vec(), "cannot be read"),
            ("empty.arrow", Vec::new(), "empty"),
        ];
        for (name, content, says) in cases {
            let path = dir.join(name);
            std::fs::write(&path, content).unwrap();
            let err = ArrowFiles::open(&[&path], &["id"]).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains(says), "{name}: {err}");
        }
        let err = ArrowFiles::open(&[&good], &["id", "label"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("good.arrow") && err.contains("no column `label`"),
            "{err}"
        );
        assert!(err.contains("id, text, ids, score, maybe, blob"), "{err}");
        let err = ArrowFiles::open(&[&good], &["blob"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`blob`") && err.contains("Binary"), "{err}");
        // Another file whose `id` is text.
        let other = dir.join("other.arrow");
        let b = RecordBatch::try_from_iter([(
            "id",
            Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
        )])
        .unwrap();
        write_file(&other, &[b]);
        let err = ArrowFiles::open(&[&good, &other], &["id"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("other.arrow") && err.contains("Utf8"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(feature = "parquet")]
mod parquet_tests {
    use super::*;
    use parquet::arrow::ArrowWriter;
    use parquet::basic::{Compression, ZstdLevel};
    use parquet::file::properties::WriterProperties;

    pub(super) fn write(
        path: &Path,
        batches: &[RecordBatch],
        compression: Compression,
        group: usize,
    ) {
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
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/data/checksummed.parquet");
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
}

/// A file opened with the wrong reader says what its first and last bytes are and which
/// reader fits it.
#[cfg(all(feature = "parquet", feature = "arrow"))]
#[test]
fn a_file_opened_with_the_wrong_reader_says_what_it_is_and_which_reader_fits() {
    use parquet::basic::Compression;
    let dir = scratch("wrong-reader");
    let (pq, ipc, csv) = (
        dir.join("a.parquet"),
        dir.join("a.arrow"),
        dir.join("a.csv"),
    );
    parquet_tests::write(&pq, &batches(0, 10, 5), Compression::SNAPPY, 5);
    arrow::write_file(&ipc, &batches(0, 10, 5));
    std::fs::write(&csv, "id,text\n1,one\n").unwrap();
    let err = ArrowFiles::open(&[&pq], &["id"]).unwrap_err().to_string();
    assert!(
        err.contains("start with 50 41 52 31") && err.contains("open it with ParquetFiles"),
        "{err}"
    );
    let err = ParquetFiles::open(&[&ipc], &["id"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("start with 41 52 52 4f 57 31") && err.contains("open it with ArrowFiles"),
        "{err}"
    );
    let err = ParquetFiles::open(&[&csv], &["id"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("its 14 bytes start with 69 64 2c 74") && err.contains("TextLines"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn row_accessors_name_the_row_and_the_column() {
    let names: Arc<[String]> = vec!["ids".to_string(), "label".to_string()].into();
    let row = Row::new(
        names,
        vec![Value::Ints(vec![5, -100]), Value::Null],
        "data/x.parquet".into(),
        7,
    );
    let err = row.ids("ids").unwrap_err().to_string();
    assert!(
        err.contains("row 7 of data/x.parquet") && err.contains("-100"),
        "{err}"
    );
    let err = row.int("label").unwrap_err().to_string();
    assert!(err.contains("`label` holds null"), "{err}");
    let err = row.text("nope").unwrap_err().to_string();
    assert!(
        err.contains("`nope` is not one of") && err.contains("ids, label"),
        "{err}"
    );
    assert_eq!(row.ints("ids").unwrap(), [5, -100]);
}
