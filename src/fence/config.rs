//! `[fencing]`: the token header, the gates' timings and bounds, the proof keys.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use crate::config::error::{Errors, Place};
use crate::config::value::{duration, positive};
use crate::proof::ProofKeys;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencingConfig {
    pub header: HeaderName,
    pub drain_timeout: Duration,
    pub settle: Duration,
    /// Per scope: requests of one generation at the backend at once, and requests
    /// waiting at its gate. Beyond either: 503 draining, so memory stays bounded.
    pub max_inflight_per_scope: usize,
    pub max_waiters_per_scope: usize,
    /// Longest scope a fenced request may derive: each one admitted is kept in memory
    /// while hot and on disk for good. Beyond: 400 invalid_path.
    pub max_scope_bytes: usize,
    /// Keys whose proofs `proof = "required"` routes accept (SPEC §9), read at start-up.
    pub proof_keys: ProofKeys,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFencing {
    header: Option<String>,
    drain_timeout: Option<String>,
    settle: Option<String>,
    max_inflight_per_scope: Option<usize>,
    max_waiters_per_scope: Option<usize>,
    max_scope_bytes: Option<usize>,
    proof_keys: Option<Vec<String>>,
}

/// `[fencing]` as parsed: the proof key files are named, not read yet.
#[derive(Debug)]
pub(crate) struct FencingDraft {
    config: FencingConfig,
    proof_key_files: Vec<PathBuf>,
    keys_at: Place,
}

impl FencingDraft {
    /// Does the file name any proof key? (Whether each one loads is the load step's.)
    pub(crate) fn names_proof_keys(&self) -> bool {
        !self.proof_key_files.is_empty()
    }

    /// Reads the proof keys.
    pub(crate) fn load(self, errors: &mut Errors) -> FencingConfig {
        let mut config = self.config;
        for (i, f) in self.proof_key_files.iter().enumerate() {
            if let Err(e) = config.proof_keys.add_file(f) {
                errors.push_at(
                    self.keys_at,
                    format!("fencing.proof_keys[{i}]"),
                    e.to_string(),
                );
            }
        }
        config
    }
}

/// Validates `[fencing]`; relative paths are resolved against `base`.
pub(crate) fn parse(fencing: RawFencing, base: &Path, errors: &mut Errors) -> FencingDraft {
    let header_raw = fencing.header.as_deref().unwrap_or("Fencing-Token");
    let header = HeaderName::from_bytes(header_raw.as_bytes()).unwrap_or_else(|_| {
        errors.push(
            "fencing.header",
            format!("`{header_raw}` is not a header name"),
        );
        HeaderName::from_static("fencing-token")
    });
    let config = FencingConfig {
        header,
        drain_timeout: duration(
            fencing.drain_timeout.as_deref(),
            Duration::from_secs(30),
            "fencing.drain_timeout",
            errors,
        ),
        settle: duration(
            fencing.settle.as_deref(),
            Duration::from_secs(5),
            "fencing.settle",
            errors,
        ),
        max_inflight_per_scope: positive(
            fencing.max_inflight_per_scope,
            4096,
            "fencing.max_inflight_per_scope",
            errors,
        ),
        max_waiters_per_scope: positive(
            fencing.max_waiters_per_scope,
            1024,
            "fencing.max_waiters_per_scope",
            errors,
        ),
        max_scope_bytes: positive(
            fencing.max_scope_bytes,
            1024,
            "fencing.max_scope_bytes",
            errors,
        ),
        proof_keys: ProofKeys::default(),
    };
    FencingDraft {
        config,
        proof_key_files: fencing
            .proof_keys
            .iter()
            .flatten()
            .map(|f| base.join(f))
            .collect(),
        keys_at: errors.place(),
    }
}
