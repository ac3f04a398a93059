//! `[admin]`: the admin API's listener, bearer token and TLS.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::config::error::{Errors, Place};
use crate::config::value::{read_secret, socket_addr};
use crate::tls::{ListenerFiles, RawListenerTls};

#[derive(Clone, PartialEq, Eq)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for the admin API (all but /healthz and /readyz), read at start-up.
    pub token: Option<String>,
    /// `tls = { cert, key, client_ca }`: serve the admin API over HTTPS, as `server.tls`.
    pub tls: Option<ListenerFiles>,
}

impl std::fmt::Debug for AdminConfig {
    // Never the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("tls", &self.tls)
            .finish()
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAdmin {
    listen: Option<String>,
    token_file: Option<String>,
    tls: Option<RawListenerTls>,
}

/// `[admin]` as parsed: the token file and TLS files are named, not read yet.
#[derive(Debug)]
pub(crate) struct AdminDraft {
    listen: SocketAddr,
    token_file: Option<PathBuf>,
    token_at: Place,
    tls: Option<ListenerFiles>,
    tls_at: Place,
}

impl AdminDraft {
    pub(crate) fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Reads the token file and the TLS files.
    pub(crate) fn load(self, errors: &mut Errors) -> AdminConfig {
        AdminConfig {
            listen: self.listen,
            token: self
                .token_file
                .and_then(|f| read_secret(&f, "admin.token_file", self.token_at, errors)),
            tls: self
                .tls
                .and_then(|files| crate::tls::check_listener_files(files, self.tls_at, errors)),
        }
    }
}

/// Validates `[admin]`; relative paths are resolved against `base`.
pub(crate) fn parse(admin: RawAdmin, base: &Path, errors: &mut Errors) -> AdminDraft {
    let listen = socket_addr(
        admin.listen.as_deref(),
        "127.0.0.1:9090",
        "admin.listen",
        errors,
    );
    let token_at = errors.place();
    if !listen.ip().is_loopback() && admin.token_file.is_none() {
        errors.push(
            "admin.listen",
            format!("{listen} is not loopback: set admin.token_file so the admin API needs a bearer token"),
        );
    }
    AdminDraft {
        listen,
        token_file: admin.token_file.map(|f| base.join(f)),
        token_at,
        tls: admin
            .tls
            .map(|raw| crate::tls::listener_files(raw, base, "admin.tls")),
        tls_at: errors.place(),
    }
}
