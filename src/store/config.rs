//! `[store]`: where the marks are kept. Its types live here until the store code has a
//! folder of its own to take them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::error::Errors;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Relative paths are resolved against the config file's directory.
    pub path: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawStore {
    path: String,
}

/// Validates `[store]` (required).
pub(crate) fn parse(store: Option<RawStore>, base: &Path, errors: &mut Errors) -> StoreConfig {
    match store {
        Some(s) if !s.path.is_empty() => StoreConfig {
            path: base.join(s.path),
        },
        Some(_) => {
            errors.push("store.path", "must not be empty");
            StoreConfig {
                path: PathBuf::new(),
            }
        }
        None => {
            errors.push("store", "missing: [store] path = \"...\" is required");
            StoreConfig {
                path: PathBuf::new(),
            }
        }
    }
}
