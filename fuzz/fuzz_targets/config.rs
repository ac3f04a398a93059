//! The configuration parser: any text never panics, and every error it reports names
//! the key path it is about (only text that is not TOML at all is an error of the whole
//! file).
#![no_main]

use std::path::Path;

use fencegate::settings::Draft;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let errors = match Draft::parse(text, Path::new("/nonexistent-fuzz-base")) {
        Ok(draft) => match draft.load() {
            Ok(_) => return,
            Err(e) => e,
        },
        Err(e) => {
            for err in &e.0 {
                assert!(
                    !err.path.is_empty() || err.message.starts_with("not valid TOML"),
                    "an error without a key path: {err}"
                );
            }
            return;
        }
    };
    for err in &errors.0 {
        assert!(!err.path.is_empty(), "an error without a key path: {err}");
    }
});
