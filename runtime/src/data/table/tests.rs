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
#[path = "parquet_tests.rs"]
mod parquet_tests;

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
