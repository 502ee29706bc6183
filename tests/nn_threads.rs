//! The fused ops' gradients are the same bits whatever the number of threads computes them: a
//! rank of `ivme launch` (one thread) and a process on the whole machine train alike, and a
//! data-parallel run can be compared with one process exactly.

use candle_core::{DType, Device, Tensor, Var};
use ivme::nn::{attention, layer_norm, rms_norm, Attention};

/// `f`'s gradients (flattened, as bits) computed on a pool of `threads` threads.
fn bits_on(threads: usize, f: &(dyn Fn() -> Vec<Tensor> + Sync)) -> Vec<Vec<u32>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        f().iter()
            .map(|g| {
                let v: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            })
            .collect()
    })
}

fn same_on_1_2_and_4_threads(what: &str, f: &(dyn Fn() -> Vec<Tensor> + Sync)) {
    let one = bits_on(1, f);
    for n in [2, 4] {
        assert!(
            bits_on(n, f) == one,
            "{what}: gradients differ on {n} threads and on 1"
        );
    }
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    // A fixed pattern, so that every pool sees the same inputs.
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f64 * 0.7548 + seed as f64 * 0.123).sin() * 1.3) as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

#[test]
fn attention_gradients_do_not_depend_on_the_thread_count() {
    // One batch row and one kv head for four query heads: the backward splits that group
    // into units of work, the case where a split by threads would change the sums.
    let f = || {
        let q = Var::from_tensor(&randn(&[1, 4, 70, 8], 1)).unwrap();
        let k = Var::from_tensor(&randn(&[1, 1, 70, 8], 2)).unwrap();
        let v = Var::from_tensor(&randn(&[1, 1, 70, 8], 3)).unwrap();
        let y = attention(&q, &k, &v, &Attention::causal()).unwrap();
        let g = (y * randn(&[1, 4, 70, 8], 4)).unwrap().sum_all().unwrap();
        let grads = g.backward().unwrap();
        [&q, &k, &v]
            .iter()
            .map(|t| grads.get(t).unwrap().clone())
            .collect()
    };
    same_on_1_2_and_4_threads("attention", &f);
}

#[test]
fn norm_gradients_do_not_depend_on_the_thread_count() {
    let f = || {
        let x = Var::from_tensor(&randn(&[300, 48], 5)).unwrap();
        let a = Var::from_tensor(&randn(&[48], 6)).unwrap();
        let b = Var::from_tensor(&randn(&[48], 7)).unwrap();
        let w = randn(&[300, 48], 8);
        let y = (rms_norm(&x, &a, 1e-5).unwrap() + layer_norm(&x, &a, Some(&b), 1e-5).unwrap())
            .unwrap();
        let grads = (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        [&x, &a, &b]
            .iter()
            .map(|t| grads.get(t).unwrap().to_dtype(DType::F32).unwrap())
            .collect()
    };
    same_on_1_2_and_4_threads("rms_norm and layer_norm", &f);
}
