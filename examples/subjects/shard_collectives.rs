//! The sharded collectives on real ranks, against values computed by hand: every rank checks
//! `reduce_scatter_sum_into` (f32, uneven shards) and `all_gather_into` (f32 and 2-byte
//! elements) and prints `ok rank R of N`, or fails naming the first wrong value.
//!
//! `ivme launch --num_processes 3 target/debug/examples/shard_collectives`

use ivme::Accelerator;

/// `total` values cut into `world` shards: equal ones and a shorter last one.
fn shards(total: usize, world: usize) -> Vec<usize> {
    let each = total.div_ceil(world);
    (0..world)
        .map(|r| each.min(total.saturating_sub(r * each)))
        .collect()
}

fn check(what: &str, got: &[f32], want: impl Fn(usize) -> f32) -> ivme::Result<()> {
    for (i, g) in got.iter().enumerate() {
        if *g != want(i) {
            return Err(ivme::Error::Comm(format!(
                "{what}: value {i} is {g}, not {}",
                want(i)
            )));
        }
    }
    Ok(())
}

fn main() -> ivme::Result<()> {
    let acc = Accelerator::new()?;
    let comm = acc.comm();
    let (rank, world) = (acc.process_index(), acc.num_processes());
    let total = 10 * world + 3;
    let counts = shards(total, world);
    let start: usize = counts[..rank].iter().sum();
    // Rank r contributes (r + 1) * i at position i: the sum is i * world(world+1)/2.
    let send: Vec<f32> = (0..total).map(|i| ((rank + 1) * i) as f32).collect();
    let tri = (world * (world + 1) / 2) as f32;
    let mut mine = vec![0f32; counts[rank]];
    comm.reduce_scatter_sum_into(&send, &mut mine, &counts, 0)?;
    check("reduce_scatter", &mine, |i| (start + i) as f32 * tri)?;

    // Gathering every rank's shard of the sum gives the whole sum back.
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut whole = vec![0u8; total * 4];
    comm.all_gather_into(&bytes, &mut whole, &counts, 4)?;
    let whole: Vec<f32> = whole
        .chunks(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    check("all_gather f32", &whole, |i| i as f32 * tri)?;

    // 2-byte elements (as f16/bf16 shards travel): rank r's shard holds r * 1000 + i.
    let half: Vec<u8> = (0..counts[rank])
        .flat_map(|i| ((rank * 1000 + i) as u16).to_le_bytes())
        .collect();
    let mut gathered = vec![0u8; total * 2];
    comm.all_gather_into(&half, &mut gathered, &counts, 2)?;
    let mut at = 0;
    for (r, &n) in counts.iter().enumerate() {
        for i in 0..n {
            let v = u16::from_le_bytes([gathered[2 * at], gathered[2 * at + 1]]);
            if usize::from(v) != r * 1000 + i {
                return Err(ivme::Error::Comm(format!(
                    "all_gather 2-byte: element {i} of rank {r}'s shard is {v}"
                )));
            }
            at += 1;
        }
    }

    // A layout that does not add up is an error, not a corrupt transfer.
    let bad = comm.reduce_scatter_sum_into(&send[1..], &mut mine, &counts, 0);
    if bad.is_ok() {
        return Err(ivme::Error::Comm("a wrong layout was accepted".into()));
    }
    println!("ok rank {rank} of {world}");
    Ok(())
}
