use super::headers::{HOP_BY_HOP, hop_by_hop_index};
use super::*;
use crate::proxy::BoxError;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Version};
use http_body::Frame;
use http_body_util::BodyExt;
use std::net::IpAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
#[test]
fn the_hop_by_hop_match_agrees_with_the_list() {
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
    }
    for name in [
        header::HOST,
        header::CONTENT_LENGTH,
        header::CONTENT_TYPE,
        HeaderName::from_static("fencing-token"),
        HeaderName::from_static("x-connection"),
        HeaderName::from_static("tes"),
    ] {
        assert_eq!(hop_by_hop_index(name.as_str()), None, "{name}");
    }
}

/// What reaches the upstream: no `Expect` (the proxy sends the whole body at once),
/// and an HTTP/2 request's cookie fields as one `cookie` line.
#[test]
fn expect_goes_and_http2_cookies_are_joined() {
    let upstream = crate::settings::Config::parse(
        "[store]\npath = \"m.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n[[route]]\nname = \"r\"\npath = \"/{*p}\"\nscope = \"s\"\nupstream = \"u\"\n",
        std::path::Path::new("."),
    )
    .unwrap()
    .upstreams
    .remove(0);
    for (version, cookie) in [
        (Version::HTTP_2, vec!["a=1; b=2; c=3"]),
        (Version::HTTP_11, vec!["a=1; b=2", "c=3"]),
    ] {
        let (mut parts, ()) = Request::builder()
            .version(version)
            .uri("http://h/x")
            .header("expect", "100-continue")
            .header("cookie", "a=1; b=2")
            .header("cookie", "c=3")
            .body(())
            .unwrap()
            .into_parts();
        upstream_parts(
            &mut parts,
            &upstream,
            IpAddr::from([127, 0, 0, 1]),
            false,
            false,
            false,
        )
        .unwrap();
        assert!(!parts.headers.contains_key(header::EXPECT));
        let cookies: Vec<_> = parts.headers.get_all(header::COOKIE).iter().collect();
        assert_eq!(cookies, cookie, "{version:?}");
    }
}

/// A streamed body (no length): its frames, ready one after another.
struct Frames(std::collections::VecDeque<Result<Frame<Bytes>, BoxError>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.get_mut().0.pop_front())
    }
}

/// `pieces` as a body without a length, then a failure of the client's if `fail`.
fn streamed(pieces: &[&'static [u8]], fail: bool) -> Body {
    let mut frames: std::collections::VecDeque<_> = pieces
        .iter()
        .map(|p| Ok(Frame::data(Bytes::from_static(p))))
        .collect();
    if fail {
        frames.push_back(Err("the client went away".into()));
    }
    Frames(frames).boxed()
}

/// What reaches the upstream of a streamed body under `max_body`: the data before the
/// frame that takes it past the limit, then an error that sets the flag; a client's
/// own failure does not.
#[tokio::test]
async fn a_streamed_body_fails_at_the_frame_past_max_body_and_says_so() {
    let (parts, ()) = Request::builder()
        .method("PUT")
        .uri("/x")
        .body(())
        .unwrap()
        .into_parts();
    for (pieces, fail, limit, data, tripped) in [
        (&[&b"abc"[..], b"de"][..], false, 5, &b"abcde"[..], false),
        (&[&b"abc"[..], b"def"][..], false, 5, &b"abc"[..], true),
        (&[&b"abcdef"[..]][..], false, 5, &b""[..], true),
        (&[&b"ab"[..]][..], true, 5, &b"ab"[..], false),
    ] {
        let (req, outgoing) = upstream_request(parts.clone(), streamed(pieces, fail), Some(limit));
        let mut body = req.into_body();
        let mut seen = Vec::new();
        let mut failed = false;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => seen.extend_from_slice(f.data_ref().unwrap()),
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        assert_eq!(seen, data, "{pieces:?}");
        assert_eq!(failed, tripped || fail, "{pieces:?}");
        assert_eq!(outgoing.tripped(), tripped, "{pieces:?}");
        assert_eq!(outgoing.written(), !failed, "{pieces:?}");
    }
}

#[test]
fn every_hop_by_hop_header_and_every_name_listed_in_connection_is_removed() {
    let mut headers = HeaderMap::new();
    for name in &HOP_BY_HOP {
        headers.append(name, HeaderValue::from_static("1"));
    }
    headers.append(header::CONNECTION, HeaderValue::from_static("close, X-A"));
    headers.append(
        header::CONNECTION,
        HeaderValue::from_static("keep-alive,x-b"),
    );
    // An element that is not ASCII does not hide the names beside it.
    headers.append(
        header::CONNECTION,
        HeaderValue::from_bytes(b"X-C,\t\xff , x-d").unwrap(),
    );
    for name in ["x-a", "x-b", "x-c", "x-d", "x-kept"] {
        headers.append(name, HeaderValue::from_static("1"));
    }
    strip_hop_by_hop(&mut headers);
    let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
    assert_eq!(left, ["x-kept"]);
}
