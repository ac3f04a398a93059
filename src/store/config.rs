//! `[store]`: where the marks are kept. Its types live here until the store code has a
//! folder of its own to take them.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::error::Errors;
use crate::config::value::size;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Relative paths are resolved against the config file's directory.
    pub path: PathBuf,
    /// Free bytes kept on the store's volume: no new idempotency record is made below
    /// them, so the marks' commits always find room (`min_free`).
    pub min_free: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawStore {
    path: String,
    min_free: Option<String>,
}

/// Validates `[store]` (required).
pub(crate) fn parse(store: Option<RawStore>, base: &Path, errors: &mut Errors) -> StoreConfig {
    match store {
        Some(s) if !s.path.is_empty() => StoreConfig {
            path: base.join(s.path),
            min_free: size(s.min_free.as_deref(), 64 << 20, "store.min_free", errors),
        },
        Some(_) => {
            errors.push("store.path", "must not be empty");
            StoreConfig {
                path: PathBuf::new(),
                min_free: 64 << 20,
            }
        }
        None => {
            errors.push("store", "missing: [store] path = \"...\" is required");
            StoreConfig {
                path: PathBuf::new(),
                min_free: 64 << 20,
            }
        }
    }
}
