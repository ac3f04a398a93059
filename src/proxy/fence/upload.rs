//! An S3 CreateMultipartUpload decided here: its answer's upload id recorded with the
//! scope, durably, before the answer goes on (SPEC §15).

use bytes::Bytes;
use http::Response;

use crate::metrics::Op;
use crate::proxy::{Body, BoxError, Outcome, Table};

/// Why an upstream answer's body could not be read whole.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum AnswerError {
    #[error("{0}")]
    Body(#[source] BoxError),
    #[error("longer than {limit} bytes")]
    TooLong { limit: usize },
}

/// An upstream answer's body, whole, up to `limit` bytes.
async fn read_answer(mut body: Body, limit: usize) -> Result<Bytes, AnswerError> {
    use http_body_util::BodyExt;
    let mut out = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(AnswerError::Body)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > limit {
                return Err(AnswerError::TooLong { limit });
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out.freeze())
}

/// Records the upload id of a CreateMultipartUpload's successful answer with its
/// scope (SPEC §15), durably, before the answer goes on. An answer whose id cannot be
/// read goes on unrecorded (its parts will be refused as unknown, loudly); a record
/// that cannot be made durable, or past the bounds on records (the store's and its
/// client's, as for idempotency records: see `idempotency.max_records*`), is 503
/// `unavailable`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_upload(
    store: &crate::store::MarkStore,
    resp: Response<Body>,
    table: &Table,
    scope: String,
    route: usize,
    token: crate::token::Token,
    client: std::net::IpAddr,
) -> Response<Body> {
    use crate::proxy::s3::upload;
    use http_body_util::BodyExt;
    if resp.status() != http::StatusCode::OK {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let op = Op::of(&http::Method::POST);
    let bytes = match read_answer(body, upload::MAX_ANSWER).await {
        Ok(b) => b,
        Err(detail) => {
            let outcome = Outcome::UpstreamTimeout {
                scope: Some(scope),
                detail: format!(
                    "the CreateMultipartUpload answer could not be read whole ({detail}); the upload may have been created"
                ),
            };
            return table.refuse(route, op, outcome, None);
        }
    };
    match upload::answered_id(&bytes) {
        Err(detail) => {
            tracing::warn!(%scope, %detail, "a CreateMultipartUpload answer without an upload id to record");
        }
        Ok(id) => {
            let upstream = &table.config.upstreams[table.config.routes[route].upstream].name;
            let now = crate::proxy::now_secs();
            let value = upload::record_value(now + upload::UPLOAD_TTL.as_secs(), &scope);
            let key = upload::record_key(upstream, &id);
            let settings = &table.config.idempotency;
            // Every upload record shares one scope of its own: the store's bound stands
            // for it.
            let quota = crate::store::quota::RecordQuota {
                total: settings.max_records,
                per_scope: settings.max_records,
                per_client: settings.max_records_per_client,
                reserve: 0,
                min_free: table.config.store.min_free,
            };
            let stored = store
                .claim_within(
                    key,
                    value,
                    None,
                    now,
                    Some((crate::store::quota::client_key(client), quota)),
                )
                .await;
            use crate::store::marks::Claimed;
            let ours = match &stored {
                Ok(Claimed::Claimed) => true,
                Ok(Claimed::Held(v)) => upload::record_scope(v, now) == Some(scope.as_str()),
                Ok(Claimed::Rejected(why)) => {
                    tracing::warn!(%scope, reason = why.describe(), "a multipart upload not recorded: past a bound on records");
                    false
                }
                Err(_) => false,
            };
            if !ours {
                return table.refuse(route, op, Outcome::Unavailable { scope, token }, None);
            }
        }
    }
    let body = http_body_util::Full::new(bytes)
        .map_err(|never| match never {})
        .boxed();
    Response::from_parts(parts, body)
}
