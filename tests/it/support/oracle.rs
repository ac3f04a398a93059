//! What the object-identity oracles (tests/it/oracle.rs for WebDAV, oracle_s3.rs for S3)
//! share: the seed and step count from the environment, and the access log's line that
//! says what fencegate decided for the request just sent; the server's tree read as a
//! snapshot, and what changed between two.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::time::{Duration, Instant};

/// `ORACLE_SEED`, else the default seed.
pub fn seed() -> u64 {
    std::env::var("ORACLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed)
}

/// `ORACLE_STEPS`, else `default`.
pub fn steps(default: usize) -> usize {
    std::env::var("ORACLE_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Waits for the access log's next line (the request's): what fencegate decided.
pub async fn next_line(log: &Path, seen: &mut usize) -> Option<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() > *seen {
            *seen = lines.len();
            return serde_json::from_str(lines[lines.len() - 1]).ok();
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An entry of a server's tree: a file (by a hash of its bytes) or a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    File(u64),
    Dir,
}

/// Every file (by a hash of its bytes) and directory under `root`.
pub fn snapshot(root: &Path) -> BTreeMap<Vec<String>, Object> {
    fn walk(dir: &Path, rel: &mut Vec<String>, out: &mut BTreeMap<Vec<String>, Object>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            rel.push(name);
            let path = e.path();
            if path.is_dir() {
                out.insert(rel.clone(), Object::Dir);
                walk(&path, rel, out);
            } else if let Ok(bytes) = std::fs::read(&path) {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                bytes.hash(&mut h);
                out.insert(rel.clone(), Object::File(h.finish()));
            }
            rel.pop();
        }
    }
    let mut out = BTreeMap::new();
    walk(root, &mut Vec::new(), &mut out);
    out
}

/// The objects changed between two snapshots: files written, replaced or removed, and
/// directories removed (not directories made: a server makes them on its own, and they
/// hold nothing until a fenced write fills them).
pub fn changed(
    before: &BTreeMap<Vec<String>, Object>,
    after: &BTreeMap<Vec<String>, Object>,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (k, v) in after {
        match (before.get(k), v) {
            (Some(old), new) if old == new => {}
            (None, Object::Dir) => {}
            _ => out.push(k.clone()),
        }
    }
    for k in before.keys() {
        if !after.contains_key(k) {
            out.push(k.clone());
        }
    }
    out
}
