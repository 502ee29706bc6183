//! Spelling help for the attribute's keys and values: the settings table's one suggester
//! (`ivme_settings::spelling`), over a list of words.

/// The candidate closest to `word` when it is close enough to be a typo.
pub(crate) fn closest(word: &str, candidates: &[&'static str]) -> Option<&'static str> {
    ivme_settings::spelling::closest(word, candidates.iter().copied())
}
