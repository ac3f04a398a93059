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

/// Largest file fencegate reads whole: a configuration, a TLS certificate bundle. A path
/// that names something larger (a device, a log by mistake) is refused instead of filling
/// memory.
pub const MAX_FILE: u64 = 16 << 20;
/// Largest key or secret file (a token, an Ed25519 key file): a few hundred bytes each.
pub const MAX_SECRET_FILE: u64 = 64 << 10;

/// The contents of `path`, if not longer than `max` bytes (read no further than that).
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "longer than {max} bytes (no such file is)"
        )));
    }
    Ok(out)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_bounded_text(path: &Path, max: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, max)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// The trimmed contents of a secret file, not empty and kept from other users
/// ([`read_private`]), read no further than [`MAX_SECRET_FILE`]; its errors go at `at`,
/// under `path` (its key).
pub fn read_secret(file: &Path, path: &str, at: Place, errors: &mut Errors) -> Option<String> {
    let message = match read_private(file, MAX_SECRET_FILE)
        .map_err(|e| e.to_string())
        .and_then(|b| {
            String::from_utf8(b)
                .map_err(|_| format!("cannot read {}: not UTF-8 text", file.display()))
        }) {
        Ok(t) if !t.trim().is_empty() => return Some(t.trim().to_string()),
        Ok(_) => format!("{} is empty", file.display()),
        Err(message) => message,
    };
    errors.push_at(at, path, message);
    None
}

/// Refuses a secret or private key that users other than its owner may read or change, as
/// ssh refuses such a key, and says the mode. One allowance, PostgreSQL's for its server
/// key: a file owned by root may also be read by its group, which is how Kubernetes mounts
/// a Secret for a pod's `fsGroup` (root-owned, mode 0440). The mode is that of the file a
/// symbolic link names (a Secret's files are links).
///
/// The contents of such a file, no longer than `max`, checked on the file opened and read: a file swapped for another
/// between a check by name and the read (a link re-pointed, a file renamed over it) is
/// never read unchecked.
pub fn read_private(file: &Path, max: u64) -> Result<Vec<u8>, ReadPrivateError> {
    use std::io::Read;
    let cannot = |source: std::io::Error| ReadPrivateError::Io {
        file: file.display().to_string(),
        source,
    };
    let f = std::fs::File::open(file).map_err(cannot)?;
    #[cfg(unix)]
    private_meta(file, &f.metadata().map_err(cannot)?)?;
    let mut out = Vec::new();
    f.take(max + 1).read_to_end(&mut out).map_err(cannot)?;
    if out.len() as u64 > max {
        return Err(ReadPrivateError::TooLong {
            file: file.display().to_string(),
            max,
        });
    }
    Ok(out)
}

/// Why [`read_private`] read no secret: the file could not be read, is open to others or
/// owned by another, or is longer than any such file.
#[derive(Debug, thiserror::Error)]
pub enum ReadPrivateError {
    #[error("cannot read {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[cfg(unix)]
    #[error(transparent)]
    NotPrivate(#[from] NotPrivate),
    #[error("cannot read {file}: longer than {max} bytes (no such file is)")]
    TooLong { file: String, max: u64 },
}

/// [`read_private`]'s check of a file's metadata. A file owned by another user than this
/// process's (and not root) is refused too: its owner could change the secret.
#[cfg(unix)]
fn private_meta(file: &Path, meta: &std::fs::Metadata) -> Result<(), NotPrivate> {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != 0 && meta.uid() != me {
        return Err(NotPrivate::Owner {
            file: file.display().to_string(),
            owner: meta.uid(),
            me,
        });
    }
    let mode = meta.mode() & 0o777;
    let open = if meta.uid() == 0 { 0o027 } else { 0o077 };
    if mode & open == 0 {
        return Ok(());
    }
    let who = if mode & 0o007 != 0 {
        "other users"
    } else {
        "its group"
    };
    Err(NotPrivate::Open {
        file: file.display().to_string(),
        who,
        mode,
        root_group: if meta.uid() == 0 {
            ", or also by its group when root owns it (0640)"
        } else {
            ""
        },
    })
}

/// Why [`private_meta`] refused a file: another user owns it, or others may read it.
#[cfg(unix)]
#[derive(Debug, thiserror::Error)]
pub enum NotPrivate {
    #[error(
        "{file} is owned by user {owner}, not by this process's ({me}) nor root: its owner could change a secret or private key"
    )]
    Owner { file: String, owner: u32, me: u32 },
    #[error(
        "{file} is open to {who} (mode {mode:04o}): a secret or private key must be readable by its owner only (chmod 600){root_group}"
    )]
    Open {
        file: String,
        who: &'static str,
        mode: u32,
        root_group: &'static str,
    },
}

/// Writes a file only its owner may read or write: the tests' secrets and keys.
#[cfg(test)]
pub fn write_private(file: impl AsRef<Path>, text: impl AsRef<[u8]>) {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(file.as_ref()).expect("create a private file");
    f.write_all(text.as_ref()).expect("write a private file");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .expect("chmod 600");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path handed in that names something endless (a device) or too large is refused
    /// after reading one byte past the bound, never read whole.
    /// A secret is checked on the file read: its mode, and its owner (this process's user
    /// or root).
    #[cfg(unix)]
    #[test]
    fn a_secret_is_checked_on_the_file_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let f = dir.path().join("k");
        write_private(&f, "secret");
        assert_eq!(read_private(&f, 64).expect("private"), b"secret");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = read_private(&f, 64)
            .expect_err("open to others")
            .to_string();
        assert!(e.contains("other users"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        // Only root may give a file away.
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(&f, Some(54321), None).expect("chown");
            let e = read_private(&f, 64)
                .expect_err("another user's")
                .to_string();
            assert!(e.contains("owned by user 54321"), "{e}");
        }
    }

    #[test]
    fn files_are_read_no_further_than_their_bound() {
        let e = read_bounded(Path::new("/dev/zero"), 1024).expect_err("endless");
        assert!(e.to_string().contains("longer than 1024 bytes"), "{e}");
        let dir = tempfile::tempdir().expect("dir");
        let f = dir.path().join("k");
        std::fs::write(&f, b"0123456789").expect("write");
        assert_eq!(read_bounded(&f, 10).expect("at the bound"), b"0123456789");
        assert!(read_bounded(&f, 9).is_err());
        std::fs::write(&f, [0xff, 0xfe]).expect("write");
        assert!(read_bounded_text(&f, 10).is_err(), "not UTF-8");
    }
}
