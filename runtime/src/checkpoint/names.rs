//! The names of the components in a checkpoint's rank folders: one place that spells them, so
//! saving, loading, resharding and merging agree.
//!
//! Each rank folder holds `model_{i}` and `optimizer_{i}` (rank 0's, or every rank's slice under
//! sharding), `loader_{i}` and `custom_{i}` (each rank's), and `rng` and `training`.

/// The kinds of numbered component, with their name prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A prepared model's f32 masters.
    Model,
    /// A prepared optimizer's state.
    Optimizer,
    /// A prepared data loader's position.
    Loader,
    /// An object registered for checkpointing.
    Custom,
}

impl Kind {
    const ALL: [Kind; 4] = [Kind::Model, Kind::Optimizer, Kind::Loader, Kind::Custom];

    fn prefix(self) -> &'static str {
        match self {
            Kind::Model => "model_",
            Kind::Optimizer => "optimizer_",
            Kind::Loader => "loader_",
            Kind::Custom => "custom_",
        }
    }

    /// The name of the `i`-th component of this kind.
    pub fn name(self, i: usize) -> String {
        format!("{}{i}", self.prefix())
    }
}

/// The component holding a rank's random generator.
pub(crate) const RNG: &str = "rng";
/// The component holding a rank's accumulation step, loss scaler, loop position and partial
/// gradient sums.
pub(crate) const TRAINING: &str = "training";

/// The kind and number of a numbered component's name (`None` for `rng`, `training` or an
/// unknown name).
pub(crate) fn parse(name: &str) -> Option<(Kind, usize)> {
    Kind::ALL.into_iter().find_map(|k| {
        let i = name.strip_prefix(k.prefix())?.parse().ok()?;
        Some((k, i))
    })
}

/// Whether a component holds model weights or optimizer state (what resharding moves).
pub(crate) fn is_weights(name: &str) -> bool {
    matches!(parse(name), Some((Kind::Model | Kind::Optimizer, _)))
}

/// How many components of `kind` are among `names`.
pub(crate) fn count<'a>(names: impl IntoIterator<Item = &'a String>, kind: Kind) -> usize {
    names
        .into_iter()
        .filter(|n| parse(n).is_some_and(|(k, _)| k == kind))
        .count()
}
