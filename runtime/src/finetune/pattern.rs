//! Name patterns for the modules and weights a fine-tune picks: `*` matches any characters; a
//! pattern matches a dotted name when it matches the whole name, a module prefix of it
//! (`layers.1` matches `layers.1.mlp.weight`), or its last parts (`q_proj` matches
//! `layers.0.attn.q_proj`, as PEFT's `target_modules` do).

/// Whether `pattern` matches `name` or one of its module prefixes, as the module docs say.
pub(crate) fn matches(pattern: &str, name: &str) -> bool {
    let suffix = format!("*.{pattern}");
    prefixes(name).any(|p| glob(pattern, p) || glob(&suffix, p))
}

/// `name` and each of its prefixes that ends at a dot, longest first.
fn prefixes(name: &str) -> impl Iterator<Item = &str> {
    std::iter::once(name).chain(
        name.char_indices()
            .rev()
            .filter(|&(_, c)| c == '.')
            .map(move |(i, _)| &name[..i]),
    )
}

/// Whether `pattern` matches all of `text`, `*` standing for any run of characters.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut i, mut j) = (0, 0);
    // Where the last `*` was and the text position it was tried against.
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if i < p.len() && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn a_pattern_matches_whole_names_module_prefixes_and_last_parts() {
        assert!(matches("head", "head.weight"));
        assert!(matches("head.weight", "head.weight"));
        assert!(matches("layers.1", "layers.1.mlp.weight"));
        assert!(!matches("layers.1", "layers.10.mlp.weight"));
        assert!(matches("q_proj", "model.layers.0.attn.q_proj"));
        assert!(matches("q_proj", "model.layers.0.attn.q_proj.weight"));
        assert!(!matches("q_proj", "model.layers.0.attn.qq_proj"));
        assert!(matches("layers.*.attn.*_proj", "layers.3.attn.v_proj"));
        assert!(matches("*", "anything.at.all"));
        assert!(!matches("mlp", "head.weight"));
        assert!(!matches("head", "heads.weight"));
    }
}
