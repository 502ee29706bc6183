//! Dynamic loss scaling for fp16: keeps small gradients representable, and skips the step
//! when the scaled gradients overflow.

/// The loss scale and how it adapts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    /// The factor the loss is multiplied by before backward.
    pub scale: f64,
    /// Multiplier applied after `growth_interval` clean steps in a row.
    pub growth_factor: f64,
    /// Multiplier applied when a step overflows.
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: u64,
    /// Clean steps since the last change.
    pub good_steps: u64,
    /// Steps skipped for overflow so far.
    pub skipped_steps: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        // 2^16, growth every 2000 clean steps: the usual starting point for fp16 training.
        LossScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            skipped_steps: 0,
        }
    }
}

impl LossScaler {
    /// Records the outcome of one window: backs off on overflow, grows after a clean run.
    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale * self.backoff_factor).max(f64::MIN_POSITIVE);
            self.good_steps = 0;
            self.skipped_steps += 1;
        } else {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.good_steps = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_overflow_and_grows_after_clean_steps() {
        let mut s = LossScaler {
            growth_interval: 2,
            ..Default::default()
        };
        s.update(true);
        assert_eq!(s.scale, 32768.0);
        assert_eq!(s.skipped_steps, 1);
        s.update(false);
        assert_eq!(s.scale, 32768.0);
        s.update(false);
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.good_steps, 0);
    }
}
