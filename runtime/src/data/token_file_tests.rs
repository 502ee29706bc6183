//! Tests of the token file reader: windows, llm.c headers, refusals that teach, runs.

use super::*;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ivme-tokens-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn raw_u16(path: &Path, ids: impl Iterator<Item = u16>) {
    let bytes: Vec<u8> = ids.flat_map(u16::to_le_bytes).collect();
    std::fs::write(path, bytes).unwrap();
}

fn llmc_u32(path: &Path, ids: &[u32]) {
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = 2;
    header[2] = ids.len() as i32;
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    bytes.extend(ids.iter().flat_map(|i| i.to_le_bytes()));
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn windows_and_their_next_token_targets_come_from_every_file_in_order() {
    let d = scratch("windows");
    raw_u16(&d.join("a.bin"), 0..10); // windows of 4: [0..5), [4..9)
    raw_u16(&d.join("b.bin"), 100..103); // too short for a window of 4 (needs 5)
    raw_u16(&d.join("c.bin"), 200..206); // [200..205)
    let paths = [d.join("a.bin"), d.join("b.bin"), d.join("c.bin")];
    let corpus = TokenFile::open(&paths, Some(TokenWidth::U16), 4).unwrap();
    assert_eq!(corpus.len(), 3);
    assert_eq!(corpus.tokens(), 19);
    assert_eq!(corpus.get(0).unwrap(), [0, 1, 2, 3, 4]);
    assert_eq!(corpus.get(1).unwrap(), [4, 5, 6, 7, 8]);
    assert_eq!(corpus.get(2).unwrap(), [200, 201, 202, 203, 204]);
    assert!(corpus.get(3).is_err());
    let (x, y) = corpus.get_batch(&[2, 0], &Device::Cpu).unwrap();
    assert_eq!(
        x.to_vec2::<u32>().unwrap(),
        [[200, 201, 202, 203], [0, 1, 2, 3]]
    );
    assert_eq!(
        y.to_vec2::<u32>().unwrap(),
        [[201, 202, 203, 204], [1, 2, 3, 4]]
    );
    let overlapping = TokenFile::open(&paths[..1], Some(TokenWidth::U16), 4)
        .unwrap()
        .with_stride(2)
        .unwrap();
    assert_eq!(overlapping.len(), 3); // starts 0, 2, 4
    assert_eq!(overlapping.get(2).unwrap(), [4, 5, 6, 7, 8]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_llmc_file_says_its_own_width_and_count() {
    let d = scratch("llmc");
    let ids: Vec<u32> = (0..9).map(|i| 70_000 + i).collect();
    llmc_u32(&d.join("train.bin"), &ids);
    let corpus = TokenFile::open(&[d.join("train.bin")], None, 3).unwrap();
    assert_eq!((corpus.len(), corpus.tokens()), (2, 9));
    assert_eq!(corpus.get(1).unwrap(), [70_003, 70_004, 70_005, 70_006]);
    let (x, y) = corpus.get_batch(&[1, 0, 1], &Device::Cpu).unwrap();
    let w = |i| corpus.get(i).unwrap();
    let (ex, ey) = next_token_batch(&[w(1), w(0), w(1)], 3, &Device::Cpu).unwrap();
    assert_eq!(x.to_vec2::<u32>().unwrap(), ex.to_vec2::<u32>().unwrap());
    assert_eq!(y.to_vec2::<u32>().unwrap(), ey.to_vec2::<u32>().unwrap());
    assert_eq!(y.to_vec2::<u32>().unwrap()[1], [70_001, 70_002, 70_003]);
    assert!(corpus.get_batch(&[2], &Device::Cpu).is_err());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_token_files_are_refused_naming_the_file() {
    let d = scratch("bad");
    std::fs::write(d.join("odd.bin"), [1u8, 2, 3]).unwrap();
    let e = TokenFile::open(&[d.join("odd.bin")], Some(TokenWidth::U16), 1).unwrap_err();
    assert!(
        e.to_string().contains("odd.bin") && e.to_string().contains("3 bytes"),
        "{e}"
    );
    let e = TokenFile::open(&[d.join("odd.bin")], None, 1).unwrap_err();
    assert!(e.to_string().contains("how wide"), "{e}");
    // nanoGPT's raw layout opened as llm.c's: what was read, what was expected, which
    // reader fits.
    raw_u16(&d.join("raw.bin"), 0..1000u16);
    let e = TokenFile::open(&[d.join("raw.bin")], None, 1)
        .unwrap_err()
        .to_string();
    let read = i32::from_le_bytes([0, 0, 1, 0]);
    for part in [
        "raw.bin",
        &format!("read {read}"),
        "20240520",
        "2000 bytes are a whole number of u16 ids",
        "nanoGPT",
        "Some(TokenWidth::U16)",
    ] {
        assert!(e.contains(part), "no `{part}` in: {e}");
    }
    // llm.c's magic number in a file shorter than its header: cut short.
    std::fs::write(d.join("cut.bin"), LLMC_MAGIC.to_le_bytes()).unwrap();
    let e = TokenFile::open(&[d.join("cut.bin")], None, 1).unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
    let mut header = [0i32; 256];
    header[0] = LLMC_MAGIC;
    header[1] = 7;
    let bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    std::fs::write(d.join("v7.bin"), bytes).unwrap();
    let e = TokenFile::open(&[d.join("v7.bin")], None, 1).unwrap_err();
    assert!(e.to_string().contains("version 7"), "{e}");
    let e = TokenFile::open(&[d.join("missing.bin")], None, 1).unwrap_err();
    assert!(e.to_string().contains("missing.bin"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_batch_read_as_runs_equals_its_windows_read_one_by_one() -> Result<()> {
    let d = scratch("runs");
    raw_u16(&d.join("a.bin"), 0..1000u16);
    raw_u16(&d.join("b.bin"), 5000..5333u16);
    let paths = [d.join("a.bin"), d.join("b.bin")];
    for stride in [8, 5, 9, 20] {
        let corpus = TokenFile::open(&paths, Some(TokenWidth::U16), 8)?.with_stride(stride)?;
        let n = corpus.len();
        // In order across the two files' boundary, a run cut by a gap, and shuffled.
        let orders: [Vec<usize>; 3] = [
            (0..n).collect(),
            vec![3, 4, 5, 9, 10, n - 2, n - 1, 0],
            (0..n).map(|i| (i * 7919) % n).collect(),
        ];
        for order in orders {
            let (x, y) = corpus.get_batch(&order, &Device::Cpu)?;
            let (x, y) = (x.to_vec2::<u32>()?, y.to_vec2::<u32>()?);
            for (row, &i) in order.iter().enumerate() {
                let w = corpus.window(i)?;
                assert_eq!(
                    (&x[row][..], &y[row][..]),
                    (&w[..8], &w[1..]),
                    "stride {stride}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}
