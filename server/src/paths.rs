//! Names that come from requests and become path components.

/// One plain path component: not empty, no separator, not `.` or `..`, not hidden, no control
/// characters. Anything else is refused before it reaches the file system.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.chars().any(|c| c == '/' || c == '\\' || c.is_control())
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
