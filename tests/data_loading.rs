//! Data loading through the public API: sharding, shuffling, batching and resuming, checked
//! against plain candle and hand-computed splits.

use candle_core::{Device, Tensor};
use ivme::data::{DataLoader, Dataset, LoaderPosition, TensorDataset};
use ivme::Result;

/// A dataset whose single column is the sample id, so a batch shows which samples it holds.
fn ids(n: u32) -> Result<TensorDataset<Tensor>> {
    TensorDataset::new(Tensor::arange(0u32, n, &Device::Cpu)?)
}

/// Every batch of the loader's current epoch (or of the next, if it is complete), padding kept.
fn epoch_batches(loader: &mut DataLoader<TensorDataset<Tensor>>) -> Result<Vec<Vec<u32>>> {
    loader.iter().map(|b| Ok(b?.to_vec1::<u32>()?)).collect()
}

/// Like [`epoch_batches`], with the padding dropped from the last batch.
fn epoch_ids(loader: &mut DataLoader<TensorDataset<Tensor>>) -> Result<Vec<Vec<u32>>> {
    let mut out = epoch_batches(loader)?;
    // Only the last batch of an epoch can carry padding.
    let pad = loader.last_batch_padding();
    if let Some(last) = out.last_mut() {
        last.truncate(last.len() - pad);
    }
    Ok(out)
}

fn rank_loaders(
    n: u32,
    batch: usize,
    world: usize,
    shuffle: bool,
) -> Result<Vec<DataLoader<TensorDataset<Tensor>>>> {
    (0..world)
        .map(|r| {
            DataLoader::new(ids(n)?, batch)
                .shuffle(shuffle)
                .seed(17)
                .shard(r, world)
        })
        .collect()
}

#[test]
fn shards_cover_the_dataset_exactly_once_per_epoch() -> Result<()> {
    for shuffle in [false, true] {
        for (n, batch, world) in [(23, 3, 4), (24, 3, 4), (3, 2, 4), (10, 4, 1), (7, 2, 3)] {
            let mut loaders = rank_loaders(n, batch, world, shuffle)?;
            let len = loaders[0].len();
            for epoch in 0..3 {
                let mut seen = Vec::new();
                for loader in &mut loaders {
                    assert_eq!(loader.len(), len, "even_batches gives every rank as many");
                    let batches = epoch_ids(loader)?;
                    assert_eq!(loader.epoch(), epoch);
                    seen.extend(batches.into_iter().flatten());
                }
                seen.sort_unstable();
                let all: Vec<u32> = (0..n).collect();
                assert_eq!(seen, all, "n={n} b={batch} w={world} shuffle={shuffle}");
            }
        }
    }
    Ok(())
}

#[test]
fn ranks_together_see_what_one_process_sees_with_the_big_batch() -> Result<()> {
    let (n, batch, world) = (29, 3, 4);
    let mut single = DataLoader::new(ids(n)?, batch * world)
        .shuffle(true)
        .seed(17);
    let mut loaders = rank_loaders(n, batch, world, true)?;
    for _epoch in 0..3 {
        let expected = epoch_ids(&mut single)?;
        let per_rank: Vec<Vec<Vec<u32>>> =
            loaders.iter_mut().map(epoch_ids).collect::<Result<_>>()?;
        assert_eq!(per_rank[0].len(), expected.len());
        for (k, big) in expected.iter().enumerate() {
            let joined: Vec<u32> = per_rank.iter().flat_map(|r| r[k].clone()).collect();
            assert_eq!(&joined, big, "global step {k}");
        }
    }
    Ok(())
}

#[test]
fn padding_repeats_the_start_of_the_epoch_on_the_last_ranks() -> Result<()> {
    // n = 7, B = 2, W = 3, unshuffled: steps [0..6), tail [6] -> ranks get [6], [0], [1].
    let mut loaders = rank_loaders(7, 2, 3, false)?;
    let mut last = Vec::new();
    for loader in &mut loaders {
        let batches = epoch_batches(loader)?;
        last.push((batches[1].clone(), loader.last_batch_padding()));
    }
    assert_eq!(last, vec![(vec![6], 0), (vec![0], 1), (vec![1], 1)]);
    Ok(())
}

#[test]
fn uneven_shards_without_even_batches_and_drop_last() -> Result<()> {
    let uneven: Vec<usize> = (0..3)
        .map(|r| {
            let loader = DataLoader::new(ids(7)?, 2)
                .even_batches(false)
                .shard(r, 3)?;
            Ok(loader.len())
        })
        .collect::<Result<_>>()?;
    assert_eq!(uneven, vec![2, 1, 1]);
    let mut dropped = DataLoader::new(ids(7)?, 2).drop_last(true).shard(2, 3)?;
    assert_eq!(dropped.len(), 1);
    assert_eq!(epoch_ids(&mut dropped)?, vec![vec![4, 5]]);
    Ok(())
}

#[test]
fn shuffled_order_changes_between_epochs_and_repeats_for_a_seed() -> Result<()> {
    let mut a = DataLoader::new(ids(64)?, 8).shuffle(true).seed(3);
    let mut b = DataLoader::new(ids(64)?, 8).shuffle(true).seed(3);
    let a0 = epoch_ids(&mut a)?;
    let a1 = epoch_ids(&mut a)?;
    assert_eq!(
        a.epoch(),
        1,
        "iterating a finished epoch moves to the next one"
    );
    assert_ne!(a0, a1);
    assert_ne!(a0.concat(), (0..64).collect::<Vec<u32>>());
    assert_eq!(epoch_ids(&mut b)?, a0);
    assert_eq!(epoch_ids(&mut b)?, a1);
    let mut other_seed = DataLoader::new(ids(64)?, 8).shuffle(true).seed(4);
    assert_ne!(epoch_ids(&mut other_seed)?, a0);
    Ok(())
}

#[test]
fn tensor_dataset_batches_equal_plain_index_select() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (21, 3, 2), &dev)?;
    let y = Tensor::arange(0u32, 21, &dev)?;
    for shuffle in [false, true] {
        let data = TensorDataset::new((x.clone(), y.clone()))?;
        let mut loader = DataLoader::new(data, 4).shuffle(shuffle).seed(1);
        let mut rows = 0;
        for batch in loader.iter() {
            let (xb, yb) = batch?;
            let picked = yb.to_vec1::<u32>()?;
            let index = Tensor::new(picked.as_slice(), &dev)?;
            let expected = x.index_select(&index, 0)?;
            assert_eq!(xb.dims(), expected.dims());
            assert_eq!(
                xb.flatten_all()?.to_vec1::<f32>()?,
                expected.flatten_all()?.to_vec1::<f32>()?
            );
            rows += picked.len();
        }
        assert_eq!(rows, 21);
    }
    Ok(())
}

/// Implements only `get` and `collate`, so `get_batch` takes the trait's default path.
struct SampleBySample(TensorDataset<(Tensor, Tensor, Tensor)>);

impl Dataset for SampleBySample {
    type Item = (Tensor, Tensor, Tensor);
    type Batch = (Tensor, Tensor, Tensor);

    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        self.0.get(index)
    }

    fn collate(&self, items: Vec<Self::Item>, device: &Device) -> Result<Self::Batch> {
        self.0.collate(items, device)
    }
}

#[test]
fn default_get_batch_matches_the_gathering_one() -> Result<()> {
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1., (9, 2), &dev)?;
    let b = Tensor::arange(0i64, 9, &dev)?;
    let c = Tensor::randn(0f32, 1., (9, 2, 2), &dev)?;
    let fast = TensorDataset::new((a.clone(), b.clone(), c.clone()))?;
    let slow = SampleBySample(TensorDataset::new((a, b, c))?);
    for indices in [vec![8, 0, 3], vec![2, 3, 4], vec![5]] {
        let (fa, fb, fc) = fast.get_batch(&indices, &dev)?;
        let (sa, sb, sc) = slow.get_batch(&indices, &dev)?;
        assert_eq!(fa.to_vec2::<f32>()?, sa.to_vec2::<f32>()?);
        assert_eq!(fb.to_vec1::<i64>()?, sb.to_vec1::<i64>()?);
        assert_eq!(fc.to_vec3::<f32>()?, sc.to_vec3::<f32>()?);
        let want: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        assert_eq!(fb.to_vec1::<i64>()?, want);
    }
    Ok(())
}

#[test]
fn vec_columns_and_out_of_range_indices() -> Result<()> {
    let dev = Device::Cpu;
    let cols = vec![
        Tensor::arange(0u32, 5, &dev)?,
        Tensor::arange(10u32, 15, &dev)?,
    ];
    let data = TensorDataset::new(cols)?;
    let batch = data.get_batch(&[4, 2], &dev)?;
    assert_eq!(batch.len(), 2);
    assert_eq!(batch[1].to_vec1::<u32>()?, vec![14, 12]);
    let err = data.get_batch(&[1, 5], &dev).unwrap_err().to_string();
    assert!(
        err.contains("index 5") && err.contains("5 samples"),
        "{err}"
    );
    assert!(data.get(7).is_err());
    Ok(())
}

#[test]
fn mismatched_first_dimensions_are_rejected_naming_both_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((6, 3), candle_core::DType::F32, &dev)?;
    let y = Tensor::zeros(5, candle_core::DType::F32, &dev)?;
    let err = TensorDataset::new((x, y)).unwrap_err().to_string();
    assert!(err.contains("[6, 3]") && err.contains("[5]"), "{err}");
    let scalar = Tensor::new(1f32, &dev)?;
    assert!(TensorDataset::new(scalar).is_err());
    Ok(())
}

#[test]
fn resuming_from_a_saved_position_yields_the_rest_of_the_epoch() -> Result<()> {
    let build = || -> Result<_> {
        DataLoader::new(ids(50)?, 4)
            .shuffle(true)
            .seed(9)
            .shard(1, 2)
    };
    let mut reference = build()?;
    reference.set_epoch(2);
    let full = epoch_ids(&mut reference)?;

    let mut first = build()?;
    first.set_epoch(2);
    let taken: Vec<Vec<u32>> = first
        .iter()
        .take(3)
        .map(|b| Ok(b?.to_vec1::<u32>()?))
        .collect::<Result<_>>()?;
    assert_eq!(taken, full[..3]);
    let saved = serde_json::to_string(&first.position()).expect("position serializes");

    let position: LoaderPosition = serde_json::from_str(&saved).expect("position parses");
    assert_eq!(
        position,
        LoaderPosition {
            epoch: 2,
            seed: 9,
            consumed: 3,
            skip: 0,
            // 3 steps of 2 ranks × 4 samples.
            samples: 24,
        }
    );
    let mut resumed = DataLoader::new(ids(50)?, 4).shuffle(true).shard(1, 2)?;
    resumed.set_position(position)?;
    // A training loop calls set_epoch with the epoch it is in; that must keep the position.
    resumed.set_epoch(2);
    let rest = epoch_ids(&mut resumed)?;
    assert_eq!(rest, full[3..]);
    // Then the next epoch is the uninterrupted run's next epoch.
    assert_eq!(epoch_ids(&mut resumed)?, epoch_ids(&mut reference)?);
    Ok(())
}

#[test]
fn set_epoch_moves_to_the_start_of_another_epoch() -> Result<()> {
    let mut loader = DataLoader::new(ids(10)?, 3).shuffle(true);
    let mut it = loader.iter();
    it.next();
    it.next();
    drop(it);
    assert_eq!(loader.position().consumed, 2);
    loader.set_epoch(0);
    assert_eq!(
        loader.position().consumed,
        2,
        "same epoch keeps the position"
    );
    loader.set_epoch(5);
    assert_eq!(loader.position().consumed, 0);
    assert_eq!(loader.iter().len(), 4);
    Ok(())
}

#[test]
fn invalid_positions_and_splits_are_errors() -> Result<()> {
    let mut loader = DataLoader::new(ids(10)?, 3);
    let too_far = LoaderPosition {
        epoch: 0,
        seed: 0,
        consumed: 5,
        ..Default::default()
    };
    assert!(loader.set_position(too_far).is_err());
    assert!(DataLoader::new(ids(10)?, 3).shard(2, 2).is_err());
    assert!(DataLoader::new(ids(10)?, 3).shard(0, 0).is_err());
    let mut zero = DataLoader::new(ids(10)?, 0);
    let results: Vec<_> = zero.iter().collect();
    assert_eq!(results.len(), 1);
    assert!(results[0].is_err());
    Ok(())
}

/// A nanoGPT-style token file of `n` u16 ids `0..n`, its windows of 8 tokens, and the window
/// index each batch row comes from (ids are their own positions, so a row's first input is
/// 8 × its window).
fn token_corpus(tag: &str, n: u16) -> (std::path::PathBuf, ivme::data::TokenFile) {
    let dir = std::env::temp_dir().join(format!("ivme-corpus-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("train.bin");
    let bytes: Vec<u8> = (0..n).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&file, bytes).unwrap();
    let corpus =
        ivme::data::TokenFile::open(&[&file], Some(ivme::data::TokenWidth::U16), 8).unwrap();
    (dir, corpus)
}

/// The windows each batch of the loader's epoch holds, checking every row's targets are its
/// inputs shifted by one.
fn token_windows(loader: &mut DataLoader<ivme::data::TokenFile>) -> Result<Vec<Vec<u32>>> {
    loader
        .iter()
        .map(|b| {
            let (x, y) = b?;
            let (x, y) = (x.to_vec2::<u32>()?, y.to_vec2::<u32>()?);
            for (xs, ys) in x.iter().zip(&y) {
                assert_eq!(xs[1..], ys[..7], "targets are the next tokens");
                assert_eq!(ys[7], xs[7] + 1);
            }
            Ok(x.iter().map(|row| row[0] / 8).collect())
        })
        .collect()
}

#[test]
fn a_token_file_on_disk_shards_shuffles_and_resumes_like_data_in_memory() -> Result<()> {
    // 400 ids: windows start every 8 tokens and need 9, so 49 windows.
    let (dir, corpus) = token_corpus("shard", 400);
    assert_eq!(corpus.len(), 49);
    drop(corpus);
    let build = |r: usize| -> Result<DataLoader<ivme::data::TokenFile>> {
        let (_, corpus) = token_corpus("shard", 400);
        DataLoader::new(corpus, 4).shuffle(true).seed(5).shard(r, 3)
    };
    let mut seen: Vec<u32> = Vec::new();
    for r in 0..3 {
        let mut loader = build(r)?;
        let batches = token_windows(&mut loader)?;
        let pad = loader.last_batch_padding();
        let mut rows: Vec<u32> = batches.into_iter().flatten().collect();
        rows.truncate(rows.len() - pad);
        seen.extend(rows);
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..49).collect::<Vec<u32>>(),
        "each window once per epoch"
    );
    // Resume rank 1 after two batches: the rest of its epoch, as if never stopped.
    let mut whole = build(1)?;
    let full = token_windows(&mut whole)?;
    let mut first = build(1)?;
    let taken: Vec<Vec<u32>> = token_windows_take(&mut first, 2)?;
    assert_eq!(taken, full[..2]);
    let mut resumed = build(1)?;
    resumed.set_position(first.position())?;
    assert_eq!(token_windows(&mut resumed)?, full[2..]);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn token_windows_take(
    loader: &mut DataLoader<ivme::data::TokenFile>,
    n: usize,
) -> Result<Vec<Vec<u32>>> {
    loader
        .iter()
        .take(n)
        .map(|b| Ok(b?.0.to_vec2::<u32>()?.iter().map(|r| r[0] / 8).collect()))
        .collect()
}

/// Prepares a loader over the token file at `file` (windows of 8 ids) in an Accelerator with
/// the project `project`.
fn token_run(
    project: &std::path::Path,
    file: &std::path::Path,
) -> Result<(ivme::Accelerator, DataLoader<ivme::data::TokenFile>)> {
    let mut acc = ivme::Accelerator::builder()
        .cpu(true)
        .project_dir(project)
        .build()?;
    let corpus = ivme::data::TokenFile::open(&[file], Some(ivme::data::TokenWidth::U16), 8)?;
    let loader = acc.prepare(DataLoader::new(corpus, 4).shuffle(true).seed(2))?;
    Ok((acc, loader))
}

#[test]
fn a_data_file_changed_since_the_checkpoint_is_named_and_nothing_is_loaded() -> Result<()> {
    let (dir, corpus) = token_corpus("changed", 400);
    drop(corpus);
    let file = dir.join("train.bin");
    let project = dir.join("project");
    let original = std::fs::read(&file).unwrap();
    let (mut acc, mut loader) = token_run(&project, &file)?;
    let taken = token_windows_take(&mut loader, 3)?;
    let saved = acc.save_state(None)?;
    let rest = token_windows(&mut loader)?;
    drop((acc, loader));

    // One id rewritten near the end: the same size, other bytes.
    let mut edited = original.clone();
    let at = edited.len() - 2;
    edited[at] ^= 1;
    std::fs::write(&file, &edited).unwrap();
    let (mut acc, loader) = token_run(&project, &file)?;
    let e = acc.load_state(Some(&saved)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("the data file {} changed", file.display()))
            && msg.contains("same size"),
        "{msg}"
    );
    assert_eq!(e.checkpoint_kind(), Some(ivme::CheckpointErrorKind::Unfit));
    // Nothing was loaded: the loader starts its first epoch from the start.
    assert_eq!(loader.position().consumed, 0);

    // Ids appended: another size.
    let mut longer = original.clone();
    longer.extend([0, 0]);
    std::fs::write(&file, &longer).unwrap();
    let (mut acc, _) = token_run(&project, &file)?;
    let msg = acc.load_state(Some(&saved)).unwrap_err().to_string();
    assert!(msg.contains("holds 802 bytes, 800 when"), "{msg}");

    // The same bytes under another path resume where the saved run stopped.
    let moved = dir.join("moved.bin");
    std::fs::write(&moved, &original).unwrap();
    let (mut acc, mut loader) = token_run(&project, &moved)?;
    acc.load_state(Some(&saved))?;
    assert_eq!(token_windows(&mut loader)?, rest);
    assert_eq!(taken.len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn a_same_size_edit_in_the_middle_with_its_mtime_put_back_is_seen_on_resume() -> Result<()> {
    // 400 KB of ids: more than the 64 KiB at each end the size-and-ends checksum reads.
    let (dir, corpus) = token_corpus("middle", 0);
    drop(corpus);
    let file = dir.join("train.bin");
    let original: Vec<u8> = (0..200_000u32)
        .flat_map(|i| ((i % 50_000) as u16).to_le_bytes())
        .collect();
    std::fs::write(&file, &original).unwrap();
    let project = dir.join("project");
    let (mut acc, mut loader) = token_run(&project, &file)?;
    token_windows_take(&mut loader, 3)?;
    let saved = acc.save_state(None)?;
    drop((acc, loader));

    // One id in the middle rewritten in place, and the modification time put back.
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let mut edited = original.clone();
    edited[original.len() / 2] ^= 1;
    std::fs::write(&file, &edited).unwrap();
    let f = std::fs::File::options().write(true).open(&file).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), mtime);
    let (mut acc, loader) = token_run(&project, &file)?;
    let e = acc.load_state(Some(&saved)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("the data file {} changed", file.display()))
            && msg.contains("content hash"),
        "{msg}"
    );
    assert_eq!(e.checkpoint_kind(), Some(ivme::CheckpointErrorKind::Unfit));
    assert_eq!(loader.position().consumed, 0, "nothing was loaded");

    // The original bytes back (a new write, so the cached hash is computed again): it resumes.
    std::fs::write(&file, &original).unwrap();
    let (mut acc, _loader) = token_run(&project, &file)?;
    acc.load_state(Some(&saved))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
