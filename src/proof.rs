//! Token proofs (SPEC §9): the authority signs (key id, scope, token) with an Ed25519 key;
//! the proxy holds only the public keys, so it can check a proof but never make one.
//!
//! Files, written by `fencegate keygen --out keys/fence` (three text lines each, hex):
//!
//! ```text
//! keys/fence.key (mode 0600)          keys/fence.pub
//! fencegate-signing-key v1            fencegate-verification-key v1
//! key-id 3f2c9a1b0d4e5f60             key-id 3f2c9a1b0d4e5f60
//! ed25519-pkcs8 3051020101300506...   ed25519 8a4d...(64 hex digits)
//! ```
//!
//! The key id is the first 8 bytes of SHA-256("fencegate-key-id-v1\0" ‖ public key), so it
//! names one public key and is checked when a file is read. A proof, as the authority
//! answers it and a client sends it in `Fencing-Proof`, is `v1.<key id>.<signature>`
//! (147 bytes). What is signed is the domain tag `fencegate-proof-v1\0`, then the key id,
//! the scope and the token, each preceded by its length (u32, big-endian); the token as
//! its two u64 parts, big-endian.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ring::signature::{self, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use sha2::{Digest, Sha256};

use crate::token::Token;

const KEY_HEADER: &str = "fencegate-signing-key v1";
const PUB_HEADER: &str = "fencegate-verification-key v1";
const KEY_ID_TAG: &[u8] = b"fencegate-key-id-v1\0";
const PROOF_TAG: &[u8] = b"fencegate-proof-v1\0";
const PROOF_VERSION: &str = "v1";
/// Hex digits of a key id (8 bytes).
const KEY_ID_LEN: usize = 16;
/// Hex digits of an Ed25519 signature (64 bytes).
const SIG_LEN: usize = 128;
/// `v1.` + key id + `.` + signature.
pub const PROOF_LEN: usize = PROOF_VERSION.len() + 1 + KEY_ID_LEN + 1 + SIG_LEN;

/// Why a key file or a proof was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    #[error("{0}")]
    KeyFile(String),
    #[error("malformed proof: {0}")]
    Malformed(&'static str),
    #[error("proof signed by unknown key {0}")]
    UnknownKey(String),
    #[error("the proof was not made for this scope and token")]
    Mismatch,
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}

/// Lower-case hex only: a value that could be spelled two ways could be cached two ways.
fn unhex(text: &[u8], out: &mut [u8]) -> Option<()> {
    if text.len() != out.len() * 2 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *o = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(())
}

fn key_id(public: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(KEY_ID_TAG);
    h.update(public);
    hex(&h.finalize()[..KEY_ID_LEN / 2])
}

fn push_field(out: &mut Vec<u8>, field: &[u8]) {
    let len = u32::try_from(field.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(field);
}

/// The bytes a proof signs.
fn signed(key_id: &str, scope: &str, token: Token) -> Vec<u8> {
    let mut m = Vec::with_capacity(PROOF_TAG.len() + 12 + key_id.len() + scope.len() + 16);
    m.extend_from_slice(PROOF_TAG);
    push_field(&mut m, key_id.as_bytes());
    push_field(&mut m, scope.as_bytes());
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&token.epoch.to_be_bytes());
    t[8..].copy_from_slice(&token.counter.to_be_bytes());
    push_field(&mut m, &t);
    m
}

/// The `key-id` line and the value line of a key file, after its header.
fn read_key_file(path: &Path, header: &str, kind: &str) -> Result<(String, Vec<u8>), ProofError> {
    let bad = |why: String| ProofError::KeyFile(format!("{}: {why}", path.display()));
    let text = if header == KEY_HEADER {
        let bytes = crate::config::value::read_private(path, crate::config::value::MAX_SECRET_FILE)
            .map_err(|e| ProofError::KeyFile(e.to_string()))?;
        String::from_utf8(bytes).map_err(|_| bad("cannot read: not UTF-8 text".into()))?
    } else {
        crate::config::value::read_bounded_text(path, crate::config::value::MAX_SECRET_FILE)
            .map_err(|e| bad(format!("cannot read: {e}")))?
    };
    let mut lines = text.lines();
    if lines.next() != Some(header) {
        return Err(bad(format!("not a {header:?} file")));
    }
    let id = lines
        .next()
        .and_then(|l| l.strip_prefix("key-id "))
        .ok_or_else(|| bad("the second line must be `key-id <id>`".into()))?;
    let value = lines
        .next()
        .and_then(|l| l.strip_prefix(kind))
        .and_then(|l| l.strip_prefix(' '))
        .ok_or_else(|| bad(format!("the third line must be `{kind} <hex>`")))?;
    if lines.any(|l| !l.trim().is_empty()) {
        return Err(bad("unexpected text after the key".into()));
    }
    let mut bytes = vec![0u8; value.len() / 2];
    unhex(value.as_bytes(), &mut bytes)
        .ok_or_else(|| bad("the key is not lower-case hex".into()))?;
    Ok((id.to_string(), bytes))
}

/// The authority's signing key.
pub struct SigningKey {
    pair: Ed25519KeyPair,
    id: String,
}

impl std::fmt::Debug for SigningKey {
    // Never the secret: configs are logged and compared through Debug.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey").field("id", &self.id).finish()
    }
}

/// The same key: an Ed25519 public key is derived from the secret one, so comparing it
/// (and the id) compares the secrets without keeping their bytes twice.
impl PartialEq for SigningKey {
    fn eq(&self, other: &SigningKey) -> bool {
        self.id == other.id && self.pair.public_key().as_ref() == other.pair.public_key().as_ref()
    }
}

impl Eq for SigningKey {}

impl SigningKey {
    pub fn load(path: &Path) -> Result<SigningKey, ProofError> {
        let (id, pkcs8) = read_key_file(path, KEY_HEADER, "ed25519-pkcs8")?;
        let pair = Ed25519KeyPair::from_pkcs8(&pkcs8).map_err(|e| {
            ProofError::KeyFile(format!("{}: not an Ed25519 key: {e}", path.display()))
        })?;
        let derived = key_id(pair.public_key().as_ref());
        if id != derived {
            return Err(ProofError::KeyFile(format!(
                "{}: key-id {id} does not belong to this key ({derived})",
                path.display()
            )));
        }
        Ok(SigningKey { pair, id })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The proof for `token` on `scope`.
    pub fn prove(&self, scope: &str, token: Token) -> String {
        let sig = self.pair.sign(&signed(&self.id, scope, token));
        format!("{PROOF_VERSION}.{}.{}", self.id, hex(sig.as_ref()))
    }
}

/// Writes a new key pair: `<out>.key` (mode 0600, created, never overwritten) and
/// `<out>.pub`. Answers the key id.
pub fn keygen(out: &Path) -> Result<String, ProofError> {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
        .map_err(|_| ProofError::KeyFile("cannot generate a key".into()))?;
    let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
        .map_err(|_| ProofError::KeyFile("cannot read the generated key".into()))?;
    let id = key_id(pair.public_key().as_ref());
    let with = |ext: &str| {
        let mut p = out.as_os_str().to_owned();
        p.push(ext);
        std::path::PathBuf::from(p)
    };
    let (key_path, pub_path) = (with(".key"), with(".pub"));
    for p in [&key_path, &pub_path] {
        if p.exists() {
            return Err(ProofError::KeyFile(format!(
                "{}: exists already; not overwritten",
                p.display()
            )));
        }
    }
    let write = |path: &Path, mode: u32, text: String| -> Result<(), ProofError> {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(mode);
        }
        #[cfg(not(unix))]
        let _ = mode;
        let mut f = options
            .open(path)
            .map_err(|e| ProofError::KeyFile(format!("{}: cannot create: {e}", path.display())))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| ProofError::KeyFile(format!("{}: cannot write: {e}", path.display())))
    };
    write(
        &key_path,
        0o600,
        format!(
            "{KEY_HEADER}\nkey-id {id}\ned25519-pkcs8 {}\n",
            hex(pkcs8.as_ref())
        ),
    )?;
    write(
        &pub_path,
        0o644,
        format!(
            "{PUB_HEADER}\nkey-id {id}\ned25519 {}\n",
            hex(pair.public_key().as_ref())
        ),
    )?;
    Ok(id)
}

/// One verification key.
#[derive(Clone, PartialEq, Eq)]
struct PublicKey {
    id: String,
    key: [u8; 32],
}

/// The keys a proxy accepts proofs from (`[fencing] proof_keys`).
#[derive(Clone, Default)]
pub struct ProofKeys {
    keys: Vec<PublicKey>,
    /// Signatures checked so far (by this set and its clones): the gates remember what
    /// they verified, and this shows how often they did not have to.
    verifications: Arc<AtomicU64>,
}

impl std::fmt::Debug for ProofKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|k| &k.id))
            .finish()
    }
}

/// The same keys, in the same order (the count of verifications is no part of the set).
impl PartialEq for ProofKeys {
    fn eq(&self, other: &ProofKeys) -> bool {
        self.keys == other.keys
    }
}

impl Eq for ProofKeys {}

impl ProofKeys {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many proofs [`ProofKeys::verify`] has checked.
    pub fn verifications(&self) -> u64 {
        self.verifications.load(Ordering::Relaxed)
    }

    /// Reads one `.pub` file and adds its key.
    pub fn add_file(&mut self, path: &Path) -> Result<(), ProofError> {
        let (id, bytes) = read_key_file(path, PUB_HEADER, "ed25519")?;
        let key: [u8; 32] = bytes.try_into().map_err(|_| {
            ProofError::KeyFile(format!("{}: an Ed25519 key is 32 bytes", path.display()))
        })?;
        let derived = key_id(&key);
        if id != derived {
            return Err(ProofError::KeyFile(format!(
                "{}: key-id {id} does not belong to this key ({derived})",
                path.display()
            )));
        }
        if !self.keys.iter().any(|k| k.id == id) {
            self.keys.push(PublicKey { id, key });
        }
        Ok(())
    }

    /// Checks `proof` (a `Fencing-Proof` value) for `token` on `scope`.
    pub fn verify(&self, scope: &str, token: Token, proof: &[u8]) -> Result<(), ProofError> {
        self.verifications.fetch_add(1, Ordering::Relaxed);
        if proof.len() != PROOF_LEN {
            return Err(ProofError::Malformed("not v1.<key id>.<signature>"));
        }
        let (version, rest) = proof.split_at(PROOF_VERSION.len());
        let (id, rest) = rest[1..].split_at(KEY_ID_LEN);
        let sig_hex = &rest[1..];
        if version != PROOF_VERSION.as_bytes()
            || proof[PROOF_VERSION.len()] != b'.'
            || rest[0] != b'.'
        {
            return Err(ProofError::Malformed("not v1.<key id>.<signature>"));
        }
        let mut id_bytes = [0u8; KEY_ID_LEN / 2];
        let mut sig = [0u8; SIG_LEN / 2];
        unhex(id, &mut id_bytes).ok_or(ProofError::Malformed("the key id is not hex"))?;
        unhex(sig_hex, &mut sig).ok_or(ProofError::Malformed("the signature is not hex"))?;
        // Hex checked above: ASCII.
        let id = std::str::from_utf8(id).map_err(|_| ProofError::Malformed("not ASCII"))?;
        let key = self
            .keys
            .iter()
            .find(|k| k.id == id)
            .ok_or_else(|| ProofError::UnknownKey(id.to_string()))?;
        UnparsedPublicKey::new(&signature::ED25519, &key.key)
            .verify(&signed(id, scope, token), &sig)
            .map_err(|_| ProofError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(dir: &Path, name: &str) -> (SigningKey, ProofKeys) {
        let out = dir.join(name);
        keygen(&out).expect("keygen");
        let key = SigningKey::load(&out.with_extension("key")).expect("key");
        let mut keys = ProofKeys::default();
        keys.add_file(&out.with_extension("pub")).expect("pub");
        (key, keys)
    }

    #[test]
    fn a_proof_binds_key_scope_and_token() {
        let dir = tempfile::tempdir().expect("dir");
        let (key, keys) = pair(dir.path(), "a");
        let t = Token::new(1, 7);
        let proof = key.prove("report/july", t);
        assert_eq!(proof.len(), PROOF_LEN);
        assert!(proof.starts_with(&format!("v1.{}.", key.id())));
        assert_eq!(keys.verify("report/july", t, proof.as_bytes()), Ok(()));
        assert_eq!(
            keys.verify("report/june", t, proof.as_bytes()),
            Err(ProofError::Mismatch)
        );
        assert_eq!(
            keys.verify("report/july", Token::new(1, 8), proof.as_bytes()),
            Err(ProofError::Mismatch)
        );
        // Another key's proof, and a proof whose key id was swapped for a known one.
        let (other, _) = pair(dir.path(), "b");
        let foreign = other.prove("report/july", t);
        assert!(matches!(
            keys.verify("report/july", t, foreign.as_bytes()),
            Err(ProofError::UnknownKey(_))
        ));
        let swapped = foreign.replace(other.id(), key.id());
        assert_eq!(
            keys.verify("report/july", t, swapped.as_bytes()),
            Err(ProofError::Mismatch)
        );
        for bad in [
            String::new(),
            "v1.x.y".into(),
            proof.to_uppercase(),
            proof.replacen("v1", "v2", 1),
            format!("{} ", &proof[..PROOF_LEN - 1]),
        ] {
            assert!(
                matches!(
                    keys.verify("report/july", t, bad.as_bytes()),
                    Err(ProofError::Malformed(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_signed_fields_cannot_slide_into_each_other() {
        let a = signed("k", "ab", Token::new(0, 1));
        let b = signed("ka", "b", Token::new(0, 1));
        assert_ne!(a, b);
    }

    #[test]
    fn key_files_are_checked() {
        let dir = tempfile::tempdir().expect("dir");
        let out = dir.path().join("k");
        keygen(&out).expect("keygen");
        assert!(keygen(&out).is_err(), "never overwrites a key");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(out.with_extension("key"))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let pub_text = std::fs::read_to_string(out.with_extension("pub")).expect("pub");
        let forged = dir.path().join("forged.pub");
        let mut lines: Vec<&str> = pub_text.lines().collect();
        lines[1] = "key-id 0000000000000000";
        std::fs::write(&forged, lines.join("\n")).expect("write");
        let e = ProofKeys::default().add_file(&forged).unwrap_err();
        assert!(e.to_string().contains("does not belong"), "{e}");
        // A public key is not a signing key, nor the other way round.
        assert!(SigningKey::load(&out.with_extension("pub")).is_err());
        assert!(
            ProofKeys::default()
                .add_file(&out.with_extension("key"))
                .is_err()
        );
    }
}
