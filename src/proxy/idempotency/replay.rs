//! A retry's answer from its record: the stored response, marked as a duplicate.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::proxy::context::Verdict;
use crate::proxy::{Body, FENCING_RESULT};

/// The stored response, marked as a duplicate.
pub(super) fn replay(
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body_stored: bool,
    body: &[u8],
) -> Response<Body> {
    let body = if body_stored {
        Bytes::copy_from_slice(body)
    } else {
        Bytes::new()
    };
    let mut resp = Response::new(Full::new(body).map_err(|e| match e {}).boxed());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    for (n, v) in headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(n.as_bytes()),
            HeaderValue::from_bytes(&v),
        ) {
            if !body_stored && n == http::header::CONTENT_LENGTH {
                continue;
            }
            resp.headers_mut().append(n, v);
        }
    }
    resp.headers_mut()
        .insert(FENCING_RESULT, HeaderValue::from_static("duplicate"));
    resp.extensions_mut().insert(Verdict::Duplicate);
    if !body_stored {
        resp.headers_mut().insert(
            "idempotency-replay",
            HeaderValue::from_static("body-not-stored"),
        );
    }
    resp
}
