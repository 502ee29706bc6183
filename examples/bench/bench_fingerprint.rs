//! What fingerprinting a data file costs (docs/data.md): `bench_fingerprint [MiB] [rounds]`
//! writes a file of that size, then times, each round, a plain read of it (the page cache
//! warm), its fingerprint computed afresh (the cache beside it removed first: every byte
//! hashed), and its fingerprint from that cache (the usual start of a resumed job).

use ivme::data::DataFile;
use std::io::Read;
use std::time::Instant;

fn main() -> ivme::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let rounds: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let dir = std::env::temp_dir().join(format!("ivme-bench-fingerprint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| ivme::Error::io("making the folder", e))?;
    let path = dir.join("corpus.bin");
    let chunk: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&path).map_err(|e| ivme::Error::io("creating", e))?;
        for _ in 0..mib {
            f.write_all(&chunk)
                .map_err(|e| ivme::Error::io("writing", e))?;
        }
    }
    let cache = {
        let mut p = path.as_os_str().to_owned();
        p.push(".ivme-hash");
        std::path::PathBuf::from(p)
    };
    let gb = mib as f64 * (1 << 20) as f64 / 1e9;
    println!("fingerprint of a {mib} MiB file, {rounds} rounds (GB/s; ms)");
    for r in 0..rounds {
        let start = Instant::now();
        let mut f = std::fs::File::open(&path).map_err(|e| ivme::Error::io("opening", e))?;
        let mut buf = vec![0u8; 4 << 20];
        while f
            .read(&mut buf)
            .map_err(|e| ivme::Error::io("reading", e))?
            > 0
        {}
        let read = start.elapsed().as_secs_f64();
        let _ = std::fs::remove_file(&cache);
        let file = std::fs::File::open(&path).map_err(|e| ivme::Error::io("opening", e))?;
        let start = Instant::now();
        let fresh = DataFile::of(&path, &file)?;
        let hashed = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let cached = DataFile::of(&path, &file)?;
        let again = start.elapsed().as_secs_f64();
        assert_eq!(fresh, cached);
        println!(
            "round {r}: read {:.2} GB/s, hashed afresh {:.2} GB/s ({:.0} ms), from the cache {:.2} ms",
            gb / read,
            gb / hashed,
            hashed * 1e3,
            again * 1e3
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
