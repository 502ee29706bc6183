//! Building an Accelerator limits how long candle's idle CPU worker spins after each op, so a
//! program started without `ivme launch` (whose ranks get the same variable) does not lose a
//! core to it during the next matrix product (docs/performance.md).
//!
//! A binary of its own: the environment is process-wide.

#[test]
fn building_an_accelerator_limits_how_long_candles_idle_worker_spins() {
    let var = ivme::env::CANDLE_SPIN_VAR;
    assert!(
        std::env::var_os(var).is_none(),
        "run without {var}: this test checks what the library sets itself"
    );
    let _acc = ivme::Accelerator::builder().cpu(true).build().unwrap();
    // candle reads it when its pool starts: at the first parallel op, after the build.
    assert_eq!(std::env::var(var).as_deref(), Ok("1000"));
}
