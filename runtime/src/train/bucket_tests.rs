//! Tests of the gradient sync's buckets: the cuts, and the persistent buffers' sync on one
//! process.

use super::*;

/// Syncs on one process (the identity communicator), at position 0.
fn sync_alone(
    bufs: &mut SyncBuffers,
    work: Work,
    synced: &[usize],
    bucket_bytes: usize,
    store: &mut GradStore,
) -> Result<bool> {
    bufs.sync(&crate::comm::SingleComm, work, synced, bucket_bytes, store)
}

/// The work of averaging `sums` of `vars` at position 0.
fn work<'a>(
    sums: &'a mut [Option<Tensor>],
    vars: &'a [Var],
    finish: Finish,
    check_overflow: bool,
) -> Work<'a> {
    Work {
        sums,
        master: vars,
        position: 0,
        finish,
        check_overflow,
    }
}

#[test]
fn buckets_hold_at_most_their_bytes_and_big_variables_travel_alone() {
    assert_eq!(cut([10, 10, 10], 80), vec![0..2, 2..3]);
    assert_eq!(cut([100, 1, 1], 80), vec![0..1, 1..3]);
    assert_eq!(cut([1, 100, 1], 80), vec![0..1, 1..2, 2..3]);
    assert_eq!(cut(Vec::<usize>::new(), 80), Vec::<Range<usize>>::new());
}

#[test]
fn chunks_fill_every_bucket_and_cut_variables_across_them() {
    let span = |at, from, len| Span { at, from, len };
    // 10 elements per bucket.
    assert_eq!(
        chunks([4, 25, 3], 40),
        vec![
            vec![span(0, 0, 4), span(1, 0, 6)],
            vec![span(1, 6, 10)],
            vec![span(1, 16, 9), span(2, 0, 1)],
            vec![span(2, 1, 2)],
        ]
    );
    assert_eq!(chunks([10], 40), vec![vec![span(0, 0, 10)]]);
    assert!(chunks(Vec::<usize>::new(), 40).is_empty());
}

/// A variable larger than a bucket is cut across buckets: the buffers stay one bucket each,
/// every part comes back finished, and an overflow in a later part is seen.
#[test]
fn a_variable_larger_than_a_bucket_syncs_through_one_bucket_buffers() -> Result<()> {
    let d = candle_core::Device::Cpu;
    let vars = [
        Var::zeros(1000, DType::F32, &d)?,
        Var::zeros(7, DType::F32, &d)?,
    ];
    let g0 = Tensor::arange(0f32, 1000.0, &d)?;
    let g1 = Tensor::arange(0f32, 7.0, &d)?;
    let mut sums = vec![Some(g0.copy()?), Some(g1.copy()?)];
    let mut bufs = SyncBuffers::default();
    assert!(bufs.fits(&sums));
    let mut store = GradStore::default();
    let finish = Finish {
        inv_world: 0.5,
        inv_scale: Some(0.25),
    };
    // Buckets of 100 values.
    let of = sync_alone(
        &mut bufs,
        work(&mut sums, &vars, finish, true),
        &[0, 1],
        400,
        &mut store,
    )?;
    assert!(!of);
    assert_eq!(bufs.bytes(), 2 * 100 * 4);
    for (v, g) in vars.iter().zip([g0, g1]) {
        let want = ((g * 0.5)? * 0.25)?.to_vec1::<f32>()?;
        assert_eq!(store.get(v.as_tensor()).unwrap().to_vec1::<f32>()?, want);
    }
    assert!(sums.iter().all(Option::is_none));
    let mut late = vec![0f32; 1000];
    late[950] = f32::NAN;
    let mut sums = vec![Some(Tensor::new(late.as_slice(), &d)?), None];
    assert!(sync_alone(
        &mut bufs,
        work(&mut sums, &vars, finish, true),
        &[0, 1],
        400,
        &mut store
    )?);
    Ok(())
}

#[test]
fn gradients_sharing_memory_take_the_general_path() -> Result<()> {
    let d = candle_core::Device::Cpu;
    let a = Tensor::arange(0f32, 8.0, &d)?;
    let b = Tensor::arange(0f32, 4.0, &d)?;
    let mut bufs = SyncBuffers::default();
    assert!(bufs.fits(&[Some(a.clone()), None, Some(b)]));
    let view = a.narrow(0, 2, 3)?;
    assert!(!bufs.fits(&[Some(a.clone()), Some(view)]));
    assert!(!bufs.fits(&[Some(a.to_dtype(DType::F16)?)]));
    assert!(!bufs.fits(&[Some(a.reshape((2, 4))?.t()?)]));
    Ok(())
}

#[test]
fn one_process_sync_writes_the_finished_values_into_the_sums() -> Result<()> {
    let d = candle_core::Device::Cpu;
    let vars = [
        Var::zeros(3, DType::F32, &d)?,
        Var::zeros(2, DType::F32, &d)?,
    ];
    let g0 = Tensor::new(&[1f32, -2.0, 4.0], &d)?;
    let mut sums = vec![Some(g0.clone()), None];
    let mut bufs = SyncBuffers::default();
    assert!(bufs.fits(&sums));
    let mut store = GradStore::default();
    let finish = Finish {
        inv_world: 0.5,
        inv_scale: Some(0.25),
    };
    let of = sync_alone(
        &mut bufs,
        work(&mut sums, &vars, finish, true),
        &[0, 1],
        1 << 20,
        &mut store,
    )?;
    assert!(!of);
    let reference = ((Tensor::new(&[1f32, -2.0, 4.0], &d)? * 0.5)? * 0.25)?;
    let got = store.get(vars[0].as_tensor()).unwrap();
    assert_eq!(got.to_vec1::<f32>()?, reference.to_vec1::<f32>()?);
    assert!(store.get(vars[1].as_tensor()).is_none());
    assert!(sums.iter().all(Option::is_none));
    let mut sums = vec![Some(Tensor::new(&[f32::INFINITY, 0.0, 0.0], &d)?), None];
    assert!(sync_alone(
        &mut bufs,
        work(&mut sums, &vars, finish, true),
        &[0, 1],
        1 << 20,
        &mut store
    )?);
    Ok(())
}

/// Only the variables `synced` lists are laid out in the buckets: a frozen one moves no
/// bytes, keeps whatever sum it has, and gets no gradient.
#[test]
fn the_buckets_lay_out_the_synced_variables_only() -> Result<()> {
    let d = candle_core::Device::Cpu;
    let vars = [
        Var::zeros(1000, DType::F32, &d)?,
        Var::zeros(3, DType::F32, &d)?,
    ];
    let frozen = Tensor::ones(1000, DType::F32, &d)?;
    let mut sums = vec![
        Some(frozen.clone()),
        Some(Tensor::new(&[2f32, 4.0, 6.0], &d)?),
    ];
    let mut bufs = SyncBuffers::default();
    assert!(bufs.fits(&sums));
    let mut store = GradStore::default();
    let finish = Finish {
        inv_world: 0.5,
        inv_scale: None,
    };
    sync_alone(
        &mut bufs,
        work(&mut sums, &vars, finish, false),
        &[1],
        1 << 20,
        &mut store,
    )?;
    // Send and receive buffers sized for the 3 synced values, not the 1003.
    assert_eq!(bufs.bytes(), 2 * 3 * 4);
    let got = store.get(vars[1].as_tensor()).unwrap();
    assert_eq!(got.to_vec1::<f32>()?, vec![1.0, 2.0, 3.0]);
    assert!(store.get(vars[0].as_tensor()).is_none());
    assert!(sums[0].is_some() && sums[1].is_none());
    Ok(())
}
