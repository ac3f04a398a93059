//! The upstream request's head, made from the client's: hop-by-hop headers removed
//! (with every name `Connection` lists), forwarding headers kept only from a trusted
//! proxy and added for this hop, the URI in the form the connection wants.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Uri, Version};

use crate::proxy::config::Upstream;

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1).
/// Constant names: removing by `&str` would parse the name again on every request.
pub(super) static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The position of `name` in [`HOP_BY_HOP`]: one match on the name's text (a length
/// check, then at most a few byte comparisons) instead of comparing it with every entry.
pub(super) fn hop_by_hop_index(name: &str) -> Option<usize> {
    match name {
        "connection" => Some(0),
        "keep-alive" => Some(1),
        "proxy-connection" => Some(2),
        "proxy-authenticate" => Some(3),
        "proxy-authorization" => Some(4),
        "te" => Some(5),
        "trailer" => Some(6),
        "transfer-encoding" => Some(7),
        "upgrade" => Some(8),
        _ => None,
    }
}

/// Removes hop-by-hop headers, including every name listed in `Connection` — read before
/// `Connection` itself is removed.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names present decides which to remove (most messages carry none,
    // or only `Connection`), instead of a hash lookup per listed name.
    let mut present = [false; HOP_BY_HOP.len()];
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name.as_str()) {
            present[i] = true;
        }
    }
    strip_present(headers, present);
}

/// [`strip_hop_by_hop`] once the hop-by-hop names present are known (`present`, indexed
/// like [`HOP_BY_HOP`]). Answers whether it removed a name listed in `Connection`, which
/// may be any header at all.
fn strip_present(headers: &mut HeaderMap, present: [bool; HOP_BY_HOP.len()]) -> bool {
    if present == [false; HOP_BY_HOP.len()] {
        return false;
    }
    let mut listed_any = false;
    if present[0] {
        // `keep-alive` (already in the fixed list) and `close` are the usual options; neither
        // needs a name parsed, so the common `Connection: keep-alive` costs no allocation.
        // Split as bytes: one element that is not visible ASCII (which `to_str` refuses)
        // must not hide the names listed beside it.
        let listed: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|t| !t.eq_ignore_ascii_case(b"keep-alive") && !t.eq_ignore_ascii_case(b"close"))
            // Lowercased: names match whatever their case.
            .filter_map(|t| HeaderName::from_bytes(t).ok())
            // Host chose the route and so the scope: the upstream must see the same one
            // (an upstream that fell back to its own authority could read the path as
            // another resource, under another scope).
            .filter(|n| *n != header::HOST)
            .collect();
        for name in listed {
            listed_any |= headers.remove(name).is_some();
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        headers.remove(name);
    }
    listed_any
}

/// The names [`upstream_parts`] acts on, found in one pass over a request's headers (each
/// name compared by its text) instead of a hash lookup each.
#[derive(Default)]
struct Names {
    /// Hop-by-hop names present, indexed like [`HOP_BY_HOP`].
    hop_by_hop: [bool; HOP_BY_HOP.len()],
    host: bool,
    /// Any of [`FORWARDING`].
    forwarding: bool,
    forwarded_for: bool,
    forwarded_proto: bool,
    expect: bool,
    /// A `cookie` field (HTTP/2 clients send one per cookie).
    cookie: bool,
}

impl Names {
    fn of(headers: &HeaderMap) -> Names {
        let mut names = Names::default();
        for name in headers.keys() {
            match name.as_str() {
                "host" => names.host = true,
                "x-forwarded-for" => {
                    names.forwarding = true;
                    names.forwarded_for = true;
                }
                "x-forwarded-proto" => {
                    names.forwarding = true;
                    names.forwarded_proto = true;
                }
                "x-forwarded-host" | "x-forwarded-port" | "forwarded" | "x-real-ip" => {
                    names.forwarding = true;
                }
                "expect" => names.expect = true,
                "cookie" => names.cookie = true,
                other => {
                    if let Some(i) = hop_by_hop_index(other) {
                        names.hop_by_hop[i] = true;
                    }
                }
            }
        }
        names
    }
}

/// Appends to a list header (`present`: the map holds it already), folding any repeated
/// lines into one list first.
fn append(headers: &mut HeaderMap, name: &HeaderName, value: HeaderValue, present: bool) {
    if !present {
        headers.insert(name, value);
        return;
    }
    let mut joined: Vec<&str> = headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let Ok(own) = value.to_str() else {
        return;
    };
    joined.push(own);
    if let Ok(v) = HeaderValue::from_str(&joined.join(", ")) {
        headers.insert(name, v);
    }
}

thread_local! {
    /// The last client address seen on this thread as a header value: a connection's
    /// requests (and most of a worker's, behind a load balancer) share it.
    static PEER_VALUE: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// `peer` as an `X-Forwarded-For` element.
fn peer_value(peer: IpAddr) -> HeaderValue {
    PEER_VALUE.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some((ip, v)) = cache.as_ref()
            && *ip == peer
        {
            return v.clone();
        }
        let v = HeaderValue::from_str(&peer.to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        *cache = Some((peer, v.clone()));
        v
    })
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Headers in which a client could claim another address, host or scheme.
static FORWARDING: [HeaderName; 6] = [
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("x-forwarded-port"),
    header::FORWARDED,
    HeaderName::from_static("x-real-ip"),
];

/// The head of the upstream request, made from the client's. The path and query go out
/// byte for byte as received; Host is preserved (signatures such as SigV4 cover it), or
/// taken from the h2 authority. Forwarding headers are kept only from a trusted proxy.
/// The URI is in origin form for the pools, absolute (`absolute`) for an https
/// upstream's client.
pub fn upstream_parts(
    parts: &mut http::request::Parts,
    upstream: &Upstream,
    peer: IpAddr,
    tls: bool,
    trusted: bool,
    absolute: bool,
) -> Result<Added, http::Error> {
    // The path and query move over as they are (no re-parse, byte for byte).
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
    let uri = if absolute {
        let mut uri = Uri::builder().path_and_query(path);
        if let Some(scheme) = upstream.url.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = upstream.url.authority() {
            uri = uri.authority(authority.clone());
        }
        uri.build()?
    } else {
        Uri::from(path)
    };
    let mut names = Names::of(&parts.headers);
    if !names.host
        && let Some(v) = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        parts.headers.insert(header::HOST, v);
    }
    if strip_present(&mut parts.headers, names.hop_by_hop) {
        // `Connection` listed other names, forwarding headers among them perhaps.
        names = Names::of(&parts.headers);
    }
    if !trusted && names.forwarding {
        for name in &FORWARDING {
            parts.headers.remove(name);
        }
        names.forwarded_for = false;
        names.forwarded_proto = false;
    }
    // New names (the usual case) are left to the caller to add: see [`Added`].
    let mut added = Added::default();
    if names.forwarded_for {
        append(&mut parts.headers, &X_FORWARDED_FOR, peer_value(peer), true);
    } else {
        added.forwarded_for = Some(peer_value(peer));
    }
    // The scheme of this hop is ours to tell, unless a trusted proxy in front said it.
    // (An untrusted client's own was removed above.)
    if !trusted || !names.forwarded_proto {
        added.forwarded_proto = Some(HeaderValue::from_static(if tls { "https" } else { "http" }));
    }
    // The proxy has answered `100-continue` itself (hyper does, as the body is read) and
    // sends the whole body at once: an upstream told to expect it could answer first and
    // read the body as a request of its own.
    if names.expect {
        parts.headers.remove(header::EXPECT);
    }
    // HTTP/2 splits cookies over several fields; HTTP/1.1 wants one (RFC 9113 §8.2.3).
    if parts.version == Version::HTTP_2
        && names.cookie
        && parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .nth(1)
            .is_some()
    {
        let joined: Vec<u8> = parts
            .headers
            .get_all(header::COOKIE)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect::<Vec<_>>()
            .join(&b"; "[..]);
        if let Ok(v) = HeaderValue::from_bytes(&joined) {
            parts.headers.insert(header::COOKIE, v);
        }
    }
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    Ok(added)
}

/// The forwarding headers [`upstream_parts`] adds to a request that carried neither
/// name (or whose own was removed). Kept out of the header map for the lean exchange,
/// which writes them after the request's own headers: a map insert, and often the map's
/// growth, saved per request. Requests that go through hyper's client put them in the
/// map ([`Added::put_into`]).
#[derive(Debug, Default)]
pub struct Added {
    forwarded_for: Option<HeaderValue>,
    forwarded_proto: Option<HeaderValue>,
}

impl Added {
    /// The headers as (name, value) pairs, for the lean exchange's encoder.
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        [
            ("x-forwarded-for", self.forwarded_for.as_ref()),
            ("x-forwarded-proto", self.forwarded_proto.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value?)))
    }

    /// Puts the headers into `headers`, where neither name is present.
    pub fn put_into(self, headers: &mut HeaderMap) {
        if let Some(v) = self.forwarded_for {
            headers.insert(X_FORWARDED_FOR, v);
        }
        if let Some(v) = self.forwarded_proto {
            headers.insert(X_FORWARDED_PROTO, v);
        }
    }
}
