//! The value types that every section reads (tables, durations, sizes, counts,
//! addresses), each checked with its key path. Imports only the error accumulator.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use super::error::{Errors, Place};

/// A table (or array element) as its raw type, or its error at `path`.
pub fn section<T: for<'de> Deserialize<'de>>(
    value: Option<toml::Value>,
    path: &str,
    errors: &mut Errors,
) -> Option<T> {
    let value = value?;
    match T::deserialize(value) {
        Ok(v) => Some(v),
        Err(e) => {
            errors.push(path, e.message().trim().to_string());
            None
        }
    }
}

/// An array of tables (`[[path]]`); none if absent.
pub fn array(value: Option<toml::Value>, path: &str, errors: &mut Errors) -> Vec<toml::Value> {
    match value {
        None => Vec::new(),
        Some(toml::Value::Array(a)) => a,
        Some(_) => {
            errors.push(path, format!("must be an array of tables: [[{path}]]"));
            Vec::new()
        }
    }
}

/// The longest duration a setting takes: deadlines are instants plus a setting, and an
/// instant a few hundred billion years out does not exist.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// The largest count a setting takes (connections, in-flight requests, waiters, ...).
pub const MAX_COUNT: usize = 1 << 32;

pub fn duration(raw: Option<&str>, default: Duration, path: &str, errors: &mut Errors) -> Duration {
    match raw {
        None => default,
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if d > MAX_DURATION => {
                errors.push(path, format!("`{s}` is longer than the maximum, 366d"));
                default
            }
            Ok(d) => d,
            Err(e) => {
                errors.push(
                    path,
                    format!("`{s}` is not a duration (e.g. 500ms, 30s): {e}"),
                );
                default
            }
        },
    }
}

/// A size: bytes (`1048576`) or with a unit (`64KiB`, `10MiB`, `1GiB`, `1MB`).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

pub fn size(raw: Option<&str>, default: u64, path: &str, errors: &mut Errors) -> u64 {
    match raw {
        None => default,
        Some(s) => parse_size(s).unwrap_or_else(|| {
            errors.push(
                path,
                format!("`{s}` is not a size (e.g. 65536, 64KiB, 10MiB)"),
            );
            default
        }),
    }
}

pub fn socket_addr(
    raw: Option<&str>,
    default: &str,
    path: &str,
    errors: &mut Errors,
) -> SocketAddr {
    let s = raw.unwrap_or(default);
    s.parse().unwrap_or_else(|_| {
        errors.push(path, format!("`{s}` is not an IP:port address"));
        SocketAddr::from(([127, 0, 0, 1], 0))
    })
}

/// A count of at least 1 and at most [`MAX_COUNT`].
pub fn positive(v: Option<usize>, default: usize, path: &str, errors: &mut Errors) -> usize {
    match v {
        Some(0) => {
            errors.push(path, "must be at least 1");
            default
        }
        Some(n) if n > MAX_COUNT => {
            errors.push(path, format!("must be at most {MAX_COUNT}"));
            default
        }
        Some(n) => n,
        None => default,
    }
}

/// The trimmed contents of a secret file, not empty; its errors go at `at`, under `path`
/// (its key).
pub fn read_secret(file: &Path, path: &str, at: Place, errors: &mut Errors) -> Option<String> {
    let message = match std::fs::read_to_string(file) {
        Ok(t) if !t.trim().is_empty() => return Some(t.trim().to_string()),
        Ok(_) => format!("{} is empty", file.display()),
        Err(e) => format!("cannot read {}: {e}", file.display()),
    };
    errors.push_at(at, path, message);
    None
}
