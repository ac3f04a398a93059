//! One `[[upstream]]` table read into an [`UpstreamDraft`] (its TLS files named, read
//! once the whole file has parsed), and the array's names checked unique.

use std::path::Path;
use std::time::Duration;

use http::Uri;
use serde::Deserialize;

use super::Upstream;
use crate::config::error::Errors;
use crate::config::value::{array, duration, section};
use crate::tls::{RawUpstreamTls, UpstreamTlsFiles};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    name: String,
    url: String,
    timeout: Option<String>,
    tls: Option<RawUpstreamTls>,
    distinct_hosts: Option<bool>,
}

/// One `[[upstream]]` as parsed: its TLS files are named, not read yet.
#[derive(Debug)]
pub(crate) struct UpstreamDraft {
    pub(super) name: String,
    pub(super) url: Uri,
    timeout: Duration,
    tls: Option<UpstreamTlsFiles>,
    pub(super) distinct_hosts: bool,
}

impl UpstreamDraft {
    /// Reads the TLS files and builds the client's TLS config.
    pub(crate) fn load(self, errors: &mut Errors) -> Upstream {
        Upstream {
            name: self.name,
            url: self.url,
            timeout: self.timeout,
            tls: self.tls.and_then(|t| t.load(errors)),
            distinct_hosts: self.distinct_hosts,
        }
    }
}

/// Validates the `[[upstream]]` array; names are unique.
pub(crate) fn parse_upstreams(
    value: Option<toml::Value>,
    base: &Path,
    errors: &mut Errors,
) -> Vec<UpstreamDraft> {
    let upstreams = array(value, "upstream", errors)
        .into_iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let path = format!("upstream[{i}]");
            let raw: RawUpstream = section(Some(v), &path, errors)?;
            Some(parse_upstream(raw, &path, base, errors))
        })
        .collect::<Vec<_>>();
    let mut seen = std::collections::HashSet::new();
    for (i, u) in upstreams.iter().enumerate() {
        if !seen.insert(u.name.clone()) {
            errors.push(
                format!("upstream[{i}].name"),
                format!("`{}` is defined twice", u.name),
            );
        }
    }
    upstreams
}

fn parse_upstream(raw: RawUpstream, path: &str, base: &Path, errors: &mut Errors) -> UpstreamDraft {
    let timeout = duration(
        raw.timeout.as_deref(),
        Duration::from_secs(30),
        &format!("{path}.timeout"),
        errors,
    );
    // Credentials in the URL are never sent upstream, and would be shown wherever the URL
    // is: refused, and never echoed.
    if raw
        .url
        .split_once("://")
        .map_or(raw.url.as_str(), |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .is_some_and(|authority| authority.contains('@'))
    {
        errors.push(
            format!("{path}.url"),
            "holds credentials (user:password@): fencegate does not send them upstream; remove them",
        );
        return UpstreamDraft {
            name: raw.name,
            url: Uri::from_static("http://invalid"),
            timeout,
            tls: None,
            distinct_hosts: raw.distinct_hosts.unwrap_or(false),
        };
    }
    let url = match raw.url.parse::<Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some() => {
            if u.path() != "/" && !u.path().is_empty() || u.query().is_some() {
                errors.push(
                    format!("{path}.url"),
                    "give scheme and authority only; the request path is forwarded as received",
                );
            }
            u
        }
        _ => {
            errors.push(
                format!("{path}.url"),
                format!("`{}` is not an http:// or https://host:port URL", raw.url),
            );
            Uri::from_static("http://invalid")
        }
    };
    let https = url.scheme_str() == Some("https");
    let tls = crate::tls::upstream_tls_files(raw.tls, https, base, path, errors);
    UpstreamDraft {
        name: raw.name,
        url,
        timeout,
        tls,
        distinct_hosts: raw.distinct_hosts.unwrap_or(false),
    }
}
