//! Names that come from requests and become path components, and what a folder holds.

use std::path::Path;

/// One plain path component: not empty, no separator, not `.` or `..`, not hidden, no control
/// characters. Anything else is refused before it reaches the file system.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.chars().any(|c| c == '/' || c == '\\' || c.is_control())
}

/// Bytes of the files under `dir` (0 when it does not exist): what a run takes on disk.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&entry.path()),
            Ok(t) if t.is_file() => entry.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::is_plain_name;

    #[test]
    fn only_single_visible_components_pass() {
        for good in ["model.safetensors", "checkpoint-3", "final", "a b"] {
            assert!(is_plain_name(good), "{good}");
        }
        for bad in ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "a\nb"] {
            assert!(!is_plain_name(bad), "{bad:?}");
        }
    }
}
