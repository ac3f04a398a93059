//! The body every service here answers with: any `http_body::Body` of `Bytes`, boxed.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type Body = BoxBody<Bytes, BoxError>;
