//! `macros/macro.md`'s table of configuration keys lists exactly the attribute keys of the
//! settings table, in its order, each with the builder method the row names: the docs read the
//! table as the attribute does.

use std::path::Path;

/// The rows of macro.md's key table: (key, builder call column).
fn documented() -> Vec<(String, String)> {
    let md = Path::new(env!("CARGO_MANIFEST_DIR")).join("../macro.md");
    let text = std::fs::read_to_string(&md).unwrap();
    let start = text
        .find("| key | value | builder call |")
        .expect("macro.md has the key table");
    text[start..]
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            let key = cells[0]
                .trim_start_matches("| ")
                .trim_matches('`')
                .to_string();
            let call = cells.last().unwrap().trim_end_matches(" |").to_string();
            (key, call)
        })
        .collect()
}

#[test]
fn macro_md_lists_every_attribute_key_with_its_builder_method() {
    let rows = documented();
    let keys: Vec<&str> = rows.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ivme_settings::ATTRIBUTE_KEYS.to_vec(),
        "macro.md's key table against the settings table's attribute keys"
    );
    for (key, call) in &rows {
        let row = ivme_settings::SETTINGS
            .iter()
            .find(|s| s.attribute == Some(key.as_str()))
            .unwrap();
        let method = row
            .builder
            .unwrap_or_else(|| panic!("`{key}` has no builder method"));
        assert!(
            call.contains(&format!(".{method}(")),
            "macro.md says `{key}` is `{call}`, the table says `.{method}(..)`"
        );
    }
}
