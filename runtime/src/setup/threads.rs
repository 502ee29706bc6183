//! candle's CPU thread pool, told not to spin a core away from the products.
//!
//! candle 0.11 runs its elementwise CPU ops (the adds of every backward, casts, scalings) on a
//! pool of its own beside rayon's, whose idle worker spins 25 000 times after each op before it
//! sleeps. In a training step those ops alternate with matrix products that run on rayon's
//! threads over every core, so after each of the step's hundreds of small ops the spinning
//! worker takes a core from the next product. With 1 000 spins the worker still catches an op
//! that follows at once and sleeps soon otherwise. candle reads the limit once, when its pool
//! starts (its first parallel op): the build sets it before anything of ivme's runs, and
//! `ivme launch` gives it to its ranks, where it holds even for candle work done before the
//! build. A value the environment already has wins.

use crate::setup::env::{CANDLE_SPIN_LIMIT, CANDLE_SPIN_VAR};

/// Sets candle's spin limit unless the environment has one; returns whether it did. Called
/// first thing in the Accelerator's build, before the communicator or any thread of ivme's
/// starts: a C library reading the environment while it changes would race.
pub(crate) fn tune() -> bool {
    if std::env::var_os(CANDLE_SPIN_VAR).is_some() {
        return false;
    }
    std::env::set_var(CANDLE_SPIN_VAR, CANDLE_SPIN_LIMIT);
    true
}
