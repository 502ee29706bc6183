//! Spelling help: how far apart two words are, and which known word a typo meant. The
//! attribute's keys and values use it, and the `ivme` command for its flags and subcommands.

/// The Levenshtein distance between two words, in chars: how many single-character insertions,
/// deletions or substitutions turn one into the other. The attribute and the `ivme` command use
/// it to suggest the key, value or subcommand a typo meant.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = substitute.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `word` by edit distance, when it is close enough to be a typo.
pub(crate) fn closest(word: &str, candidates: &[&'static str]) -> Option<&'static str> {
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, c)| *d <= (c.len().max(word.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}
