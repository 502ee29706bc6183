//! Spelling help: how far apart two words are, and which known word a typo meant. The
//! attribute's keys and values and the `ivme` command's flags and subcommands all suggest
//! through [`closest`], so a typo is caught alike everywhere.

/// The Levenshtein distance between two words, in chars: how many single-character insertions,
/// deletions or substitutions turn one into the other.
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

/// The candidate nearest to `word` when it is close enough to be a likely typo: about one edit
/// in three letters (of the longer word) and fewer edits than `word` has letters, or `word` is
/// the start (3 letters or more) of the candidate.
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let letters = word.chars().count();
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, c)| {
            let near = (c.chars().count().max(letters) / 3).max(1);
            (*d <= near && *d < letters) || (letters >= 3 && c.starts_with(word))
        })
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_are_near_and_other_words_are_not() {
        assert_eq!(edit_distance("grad_acum", "grad_accum"), 1);
        assert_eq!(edit_distance("seeed", "seed"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
        assert_eq!(edit_distance("", "cpu"), 3);
        assert_eq!(closest("precison", ["precision", "cpu"]), Some("precision"));
        assert_eq!(closest("f16", ["no", "fp16", "bf16"]), Some("fp16"));
        assert_eq!(closest("num", ["num_processes"]), Some("num_processes"));
        assert_eq!(closest("learning_rate", ["grad_accum", "seed"]), None);
        assert_eq!(closest("x", ["cpu", "y"]), None);
    }
}
