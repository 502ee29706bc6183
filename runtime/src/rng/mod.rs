//! Seeded, saveable randomness: candle's CPU generator cannot be seeded or saved, so anything
//! random that affects training draws from here instead.

pub(crate) mod replay;

use crate::error::{Error, Result};
use candle_core::{Device, Shape, Tensor};
use candle_nn::init::NormalOrUniform;
use candle_nn::Init;
use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// A ChaCha8 generator whose exact position can be saved and restored.
#[derive(Debug, Clone)]
pub struct Rng {
    inner: ChaCha8Rng,
}

/// The saved form of an [`Rng`]: its seed and how far it has advanced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RngState {
    /// The 32-byte ChaCha key.
    pub seed: [u8; 32],
    /// The stream position in 32-bit words.
    pub word_pos: u128,
}

/// Mixes a seed with a stream number (a rank, an epoch) into an independent 64-bit seed.
pub fn mix(seed: u64, stream: u64) -> u64 {
    // splitmix64 finaliser: nearby inputs give unrelated outputs.
    let mut z = seed
        ^ stream
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator seeded from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Its current state, for a checkpoint.
    pub fn state(&self) -> RngState {
        RngState {
            seed: self.inner.get_seed(),
            word_pos: self.inner.get_word_pos(),
        }
    }

    /// A generator at exactly the saved state.
    pub fn from_state(state: RngState) -> Self {
        let mut inner = ChaCha8Rng::from_seed(state.seed);
        inner.set_word_pos(state.word_pos);
        Rng { inner }
    }

    /// A uniform f32 in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        self.inner.random::<f32>()
    }

    /// A uniform u64.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.random::<u64>()
    }

    /// An f32 tensor of standard normal samples (Box–Muller) scaled by `std` around `mean`.
    pub fn randn<S: Into<Shape>>(
        &mut self,
        mean: f32,
        std: f32,
        shape: S,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let mut out = vec![0f32; shape.elem_count()];
        self.replayable(|rng| rng.fill_normal(&mut out, mean, std))?;
        Ok(Tensor::from_vec(out, shape, device)?)
    }

    /// An f32 tensor of uniform samples in `[lo, hi)`.
    pub fn rand<S: Into<Shape>>(
        &mut self,
        lo: f32,
        hi: f32,
        shape: S,
        device: &Device,
    ) -> Result<Tensor> {
        if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
            return Err(Error::Usage(format!(
                "rand: the range [{lo}, {hi}) is empty; use lo < hi"
            )));
        }
        let shape = shape.into();
        let mut out = vec![0f32; shape.elem_count()];
        self.replayable(|rng| rng.fill_uniform(&mut out, lo, hi))?;
        Ok(Tensor::from_vec(out, shape, device)?)
    }

    /// Runs `draw` on this generator, or, while a checkpointed segment is recomputed, on a
    /// copy at the state this generator had when the segment's forward drew
    /// ([`crate::activations`]): the recompute draws what the forward drew, and this
    /// generator does not advance a second time.
    fn replayable<T>(&mut self, draw: impl FnOnce(&mut Rng) -> T) -> Result<T> {
        match replay::draw_from(self.state()) {
            Ok(None) => Ok(draw(self)),
            Ok(Some(state)) => Ok(draw(&mut Rng::from_state(state))),
            Err(()) => Err(Error::Usage(
                "activation checkpointing: a segment's recompute drew from an ivme Rng more \
                 often than its forward did; make the segment draw the same each time it runs"
                    .into(),
            )),
        }
    }

    /// Fills `out` with normal samples (Box–Muller, a pair per two values) of `mean` and `std`.
    fn fill_normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        for pair in out.chunks_mut(2) {
            // 1 - u keeps the logarithm finite.
            let u1 = 1.0 - self.next_f32();
            let u2 = self.next_f32();
            let r = (-2.0 * u1.ln()).sqrt();
            let t = 2.0 * std::f32::consts::PI * u2;
            pair[0] = mean + std * r * t.cos();
            if let Some(second) = pair.get_mut(1) {
                *second = mean + std * r * t.sin();
            }
        }
    }

    /// Fills `out` with uniform samples in `[lo, hi)`.
    fn fill_uniform(&mut self, out: &mut [f32], lo: f32, hi: f32) {
        for x in out {
            *x = lo + (hi - lo) * self.next_f32();
        }
    }

    /// Inverted dropout: zeroes each element with probability `p` and scales the rest by
    /// `1 / (1 - p)`, with a mask drawn from this generator (so a resumed run draws the same).
    pub fn dropout(&mut self, xs: &Tensor, p: f32) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Usage(format!("dropout: p = {p} must be in [0, 1)")));
        }
        if p == 0.0 {
            return Ok(xs.clone());
        }
        let n = xs.elem_count();
        let keep: Vec<f32> = self.replayable(|rng| {
            (0..n)
                .map(|_| {
                    if rng.next_f32() >= p {
                        1.0 / (1.0 - p)
                    } else {
                        0.0
                    }
                })
                .collect()
        })?;
        let mask = Tensor::from_vec(keep, xs.shape(), &Device::Cpu)?
            .to_dtype(xs.dtype())?
            .to_device(xs.device())?;
        Ok(xs.mul(&mask)?)
    }
}

/// How many values of a variable's initial value one generator draws: the chunks are drawn in
/// parallel, each from its own stream, so the values do not depend on the number of threads.
const INIT_CHUNK: usize = 1 << 16;

/// The initial value of the variable `name`, in f32 on the CPU, drawn as candle's `init` hint
/// describes it (constant, normal, uniform, or Kaiming with candle's fan and gain): the same
/// on every rank and in every run with this `seed`, whatever order the variables are made in.
pub fn draw_init(seed: u64, name: &str, init: Init, shape: &Shape) -> Result<Tensor> {
    let (normal, a, b) = match init {
        Init::Const(v) => return Ok(Tensor::full(v as f32, shape, &Device::Cpu)?),
        Init::Uniform { lo, up } if lo == up => {
            return Ok(Tensor::full(lo as f32, shape, &Device::Cpu)?)
        }
        Init::Randn { mean, stdev } => (true, mean, stdev),
        Init::Uniform { lo, up } => (false, lo, up),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => (true, 0.0, std),
                NormalOrUniform::Uniform => (false, -(3f64.sqrt() * std), 3f64.sqrt() * std),
            }
        }
    };
    if !normal && b.partial_cmp(&a) != Some(std::cmp::Ordering::Greater) {
        return Err(Error::Usage(format!(
            "the initialisation of `{name}` is uniform over the empty range [{a}, {b})"
        )));
    }
    // FNV-1a over the name, and a tag that keeps these streams apart from the ranks'.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, byte| {
        (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let base = mix(mix(seed, 0x1417_1417), hash);
    let mut out = vec![0f32; shape.elem_count()];
    out.par_chunks_mut(INIT_CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = Rng::new(mix(base, i as u64));
            match normal {
                true => rng.fill_normal(chunk, a as f32, b as f32),
                false => rng.fill_uniform(chunk, a as f32, b as f32),
            }
        });
    Ok(Tensor::from_vec(out, shape, &Device::Cpu)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_generator_continues_the_same_stream() -> Result<()> {
        let mut a = Rng::new(7);
        a.randn(0.0, 1.0, 5, &Device::Cpu)?;
        let saved = a.state();
        let x = a.randn(0.0, 1.0, 9, &Device::Cpu)?.to_vec1::<f32>()?;
        let mut b = Rng::from_state(saved);
        let y = b.randn(0.0, 1.0, 9, &Device::Cpu)?.to_vec1::<f32>()?;
        assert_eq!(x, y);
        Ok(())
    }

    #[test]
    fn normal_samples_have_the_right_moments() -> Result<()> {
        let v = Rng::new(1)
            .randn(2.0, 3.0, 20_000, &Device::Cpu)?
            .to_vec1::<f32>()?;
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
        assert!((var.sqrt() - 3.0).abs() < 0.1, "{var}");
        Ok(())
    }

    #[test]
    fn dropout_keeps_the_expected_fraction_and_scale() -> Result<()> {
        let x = Tensor::ones(10_000, candle_core::DType::F32, &Device::Cpu)?;
        let y = Rng::new(3).dropout(&x, 0.25)?.to_vec1::<f32>()?;
        let kept = y.iter().filter(|v| **v > 0.0).count() as f32 / y.len() as f32;
        assert!((kept - 0.75).abs() < 0.02, "{kept}");
        assert!(y.iter().all(|v| *v == 0.0 || (*v - 4.0 / 3.0).abs() < 1e-6));
        Ok(())
    }

    #[test]
    fn initial_values_follow_the_hint_whatever_the_threads() -> Result<()> {
        let shape = Shape::from((3, INIT_CHUNK + 1));
        let hint = Init::Randn {
            mean: 1.0,
            stdev: 2.0,
        };
        let on = |threads: usize, name: &str| -> Vec<f32> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let t = pool.install(|| draw_init(9, name, hint, &shape)).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        let v = on(1, "w");
        assert_eq!(v, on(4, "w"), "the thread count must not change the draw");
        assert_ne!(v, on(1, "v"), "another name, another draw");
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        assert!(
            (mean - 1.0).abs() < 0.02 && (var.sqrt() - 2.0).abs() < 0.02,
            "{mean} {var}"
        );
        let u = draw_init(9, "u", Init::Uniform { lo: -1.0, up: 3.0 }, &shape)?;
        let u: Vec<f32> = u.flatten_all()?.to_vec1()?;
        assert!(u.iter().all(|x| (-1.0..3.0).contains(x)));
        let empty = Init::Uniform { lo: 1.0, up: 0.0 };
        assert!(draw_init(9, "e", empty, &shape).is_err());
        Ok(())
    }

    #[test]
    fn mixed_streams_differ() {
        assert_ne!(mix(1, 0), mix(1, 1));
        assert_ne!(mix(1, 0), mix(2, 0));
    }
}
