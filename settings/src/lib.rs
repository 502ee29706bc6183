//! The table of ivme's settings: each setting declared once, as one row of [`SETTINGS`].
//!
//! A setting such as "micro-batches per optimizer step" has many names: the builder's method
//! (`.grad_accum(n)`), the `#[accelerate(grad_accum = n)]` key, `ivme launch`'s flag and config
//! key (`gradient_accumulation_steps`) and the variable every rank reads (`IVME_GRAD_ACCUM`); it
//! also has a type, a default, a bound ("at least 1") and a line of docs. Three crates need them:
//! the library (`ivme`: the builder resolves and checks each setting), the attribute
//! (`ivme-macros-core`: it checks keys and bounds at compile time) and the command (`ivme-cli`:
//! its flags, config file, ranks' variables and docs/launch.md's table). A proc-macro crate
//! cannot depend on the library, so the table lives here, in a crate with no dependencies that
//! all three depend on.
//!
//! The table is plain data (`const` rows of [`Setting`]), not a macro: code that handles one
//! setting names its row (`ivme_settings::GRAD_ACCUM.name`, or matches on its [`Id`]), and
//! code that handles every setting walks [`SETTINGS`]. The row's [`Bound`] is checked by
//! [`Bound::admits`] and worded by [`Bound::wording`], everywhere the same. `scripts/test.sh`
//! greps the library, the attribute and the command for a setting's name written as a string
//! anywhere but here (`scripts/check-setting-names.sh`).
//!
//! [`vars`] holds every `IVME_*` variable of the launcher contract (settings' and others'), and
//! [`spelling`] the one suggester of "did you mean" that the attribute and the command share.

pub mod spelling;
mod table;
pub mod vars;

pub use table::*;
pub use vars::Var;

/// What values a setting admits, beyond its type; checked and worded the same way by the
/// builder, the attribute and the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Any value of the type.
    Any,
    /// A whole number of at least 1.
    AtLeastOne,
    /// A whole number of at least 0.
    AtLeastZero,
    /// A number above 0 that is finite.
    PositiveFinite,
}

impl Bound {
    /// Whether `value` lies within the bound.
    pub fn admits(self, value: f64) -> bool {
        match self {
            Bound::Any => true,
            Bound::AtLeastOne => value >= 1.0,
            Bound::AtLeastZero => value >= 0.0,
            Bound::PositiveFinite => value > 0.0 && value.is_finite(),
        }
    }

    /// The bound alone, as in "must be at least 1": the limit without the kind of number;
    /// empty for [`Bound::Any`].
    pub const fn limit(self) -> &'static str {
        match self {
            Bound::Any => "",
            Bound::AtLeastOne => "at least 1",
            Bound::AtLeastZero => "at least 0",
            Bound::PositiveFinite => "a positive, finite number",
        }
    }

    /// The values the bound admits, in the words every error uses ("a whole number of at
    /// least 1"); empty for [`Bound::Any`].
    pub const fn wording(self) -> &'static str {
        match self {
            Bound::Any => "",
            Bound::AtLeastOne => "a whole number of at least 1",
            Bound::AtLeastZero => "a whole number of at least 0",
            Bound::PositiveFinite => "a positive, finite number",
        }
    }
}

/// One setting, declared once: its names in each place, its type, default, bound and docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    /// Which setting it is, for code that matches on settings.
    pub id: Id,
    /// The setting's own name: the one errors and warnings give (the builder's method where
    /// there is one, else the command's flag).
    pub name: &'static str,
    /// The Rust type of its value.
    pub ty: &'static str,
    /// The default, as text the setting's parser reads; empty when there is none.
    pub default: &'static str,
    /// The values it admits beyond its type.
    pub bound: Bound,
    /// The method of `AcceleratorBuilder` that sets it, when code can.
    pub builder: Option<&'static str>,
    /// The `#[accelerate(...)]` key that sets it, when the attribute can.
    pub attribute: Option<&'static str>,
    /// Names users bring from other libraries that the attribute points to its key.
    pub aliases: &'static [&'static str],
    /// An example value for the attribute's key, as written there.
    pub example: &'static str,
    /// `ivme launch`'s name for it: its flag and config file key, when the command has it.
    pub launch: Option<&'static str>,
    /// The variable the ranks read it from, when there is one.
    pub var: Option<Var>,
    /// What it is, in one line.
    pub doc: &'static str,
}

impl Setting {
    /// The row whose attribute key is `key`.
    pub fn by_attribute(key: &str) -> Option<&'static Setting> {
        SETTINGS.iter().find(|s| s.attribute == Some(key))
    }

    /// The row whose `ivme launch` name is `key`.
    pub fn by_launch(key: &str) -> Option<&'static Setting> {
        SETTINGS.iter().find(|s| s.launch == Some(key))
    }

    /// The variable's name; empty when the setting has no variable.
    pub const fn var_name(&self) -> &'static str {
        match &self.var {
            Some(v) => v.name,
            None => "",
        }
    }
}

/// Counts the rows with an attribute key (for [`ATTRIBUTE_KEYS`]'s length).
const fn attribute_count() -> usize {
    let (mut i, mut n) = (0, 0);
    while i < SETTINGS.len() {
        if SETTINGS[i].attribute.is_some() {
            n += 1;
        }
        i += 1;
    }
    n
}

/// Every `#[accelerate(...)]` key, in the table's order.
pub const ATTRIBUTE_KEYS: [&str; attribute_count()] = {
    let mut keys = [""; attribute_count()];
    let (mut i, mut n) = (0, 0);
    while i < SETTINGS.len() {
        if let Some(k) = SETTINGS[i].attribute {
            keys[n] = k;
            n += 1;
        }
        i += 1;
    }
    keys
};

/// Counts the aliases of every row (for [`ATTRIBUTE_ALIASES`]' length).
const fn alias_count() -> usize {
    let (mut i, mut n) = (0, 0);
    while i < SETTINGS.len() {
        if SETTINGS[i].attribute.is_some() {
            n += SETTINGS[i].aliases.len();
        }
        i += 1;
    }
    n
}

/// Every alias the attribute knows, with the key it points to: `(alias, key)`.
pub const ATTRIBUTE_ALIASES: [(&str, &str); alias_count()] = {
    let mut pairs = [("", ""); alias_count()];
    let (mut i, mut n) = (0, 0);
    while i < SETTINGS.len() {
        if let Some(key) = SETTINGS[i].attribute {
            let mut j = 0;
            while j < SETTINGS[i].aliases.len() {
                pairs[n] = (SETTINGS[i].aliases[j], key);
                n += 1;
                j += 1;
            }
        }
        i += 1;
    }
    pairs
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_sits_at_its_ids_place_and_names_are_unique() {
        for (i, s) in SETTINGS.iter().enumerate() {
            assert_eq!(s.id as usize, i, "{}", s.name);
            assert_eq!(s.id.setting().name, s.name);
        }
        let mut names: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len());
        for s in SETTINGS {
            for a in s.aliases {
                assert!(
                    Setting::by_attribute(a).is_none(),
                    "{a} is a key and an alias"
                );
            }
        }
    }

    #[test]
    fn every_rows_variable_is_in_the_contract_and_each_default_is_within_its_bound() {
        for s in SETTINGS {
            if let Some(v) = s.var {
                assert!(vars::VARS.contains(&v), "{}", v.name);
            }
            if let Ok(d) = s.default.parse::<f64>() {
                assert!(s.bound.admits(d), "{}'s default {d}", s.name);
            }
        }
    }

    #[test]
    fn bounds_admit_what_their_words_say() {
        assert!(!Bound::AtLeastOne.admits(0.0) && Bound::AtLeastOne.admits(1.0));
        assert!(Bound::AtLeastZero.admits(0.0) && !Bound::AtLeastZero.admits(-1.0));
        for bad in [0.0, -1.0, f64::INFINITY, f64::NAN] {
            assert!(!Bound::PositiveFinite.admits(bad), "{bad}");
        }
        assert!(Bound::AtLeastOne.wording().contains("at least 1"));
        assert_eq!(ATTRIBUTE_KEYS[0], GRAD_ACCUM.name);
    }
}
