//! `api = "s3"` routes (SPEC §15) over the test double: objects named outside the path
//! (a DeleteObjects body, an upload form, the Host of a virtual-hosted request) are fenced
//! on the scope the path would give them, requests on a bucket are fenced on its
//! `bucket_scope` or refused, and what is forwarded is the request as it came.

use std::net::SocketAddr;

use crate::support::{self, Client, Double, Resp};

const ENDPOINT: &str = "s3.test";

/// The S3 route in front of `upstream`; every other host's requests go to `web`, another
/// backend (on the S3 backend they would reach its objects by another Host: refused).
fn config(upstream: SocketAddr, web: SocketAddr, bucket_scope: bool) -> String {
    let extra = if bucket_scope {
        "bucket_scope = \"bucket/{bucket}\"\n"
    } else {
        ""
    };
    config_with(upstream, web, extra)
}

/// [`config`] with `extra` lines in the S3 route.
fn config_with(upstream: SocketAddr, web: SocketAddr, extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[store]
path = "marks.redb"
[fencing]
settle = "0s"
[[upstream]]
name = "s3"
url = "http://{upstream}"
[[route]]
name = "objects"
api = "s3"
host = "{ENDPOINT}"
virtual_host_domain = "{ENDPOINT}"
path = "/{{bucket}}/{{*key}}"
scope = "object/{{bucket}}/{{key}}"
{}upstream = "s3"
[[upstream]]
name = "web"
url = "http://{web}"
[[route]]
name = "other"
path = "/{{*rest}}"
upstream = "web"
fenced = false
"#,
        extra
    )
}

/// A request to the S3 endpoint (or `host`) with a token, when given.
async fn send(
    client: &Client,
    host: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
    extra: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut headers = vec![("host", host)];
    if let Some(t) = token {
        headers.push(("fencing-token", t));
    }
    headers.extend_from_slice(extra);
    client.send(method, target, &headers, body).await
}

/// Another backend, for the hosts that are not the S3 endpoint's.
async fn web() -> SocketAddr {
    Double::start().await.addr
}

fn delete_body(keys: &[&str]) -> String {
    let objects: String = keys
        .iter()
        .map(|k| format!("<Object><Key>{k}</Key></Object>"))
        .collect();
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">{objects}</Delete>"
    )
}

fn s3_code(r: &Resp) -> String {
    let start = r.body.find("<Code>").map(|i| i + 6).unwrap_or(0);
    let end = r.body.find("</Code>").unwrap_or(start);
    r.body[start..end].to_string()
}

#[tokio::test]
async fn delete_objects_is_fenced_on_the_keys_in_its_body() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(double.addr, web().await, false), dir.path()).await;
    let c = Client::new(proxy.proxy_addr);

    let put = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("6"),
        &[],
        "six",
    )
    .await;
    assert_eq!(put.result(), "accepted", "{put:?}");
    let before = double.seen().len();

    // The stale writer and the writer without a token: refused before anything is sent.
    let body = delete_body(&["reports/july.csv"]);
    let stale = send(&c, ENDPOINT, "POST", "/bkt?delete", Some("5"), &[], &body).await;
    assert_eq!(stale.status, 409, "{stale:?}");
    assert_eq!(s3_code(&stale), "StaleFence");
    assert!(
        stale
            .body
            .contains("<Scope>object/bkt/reports/july.csv</Scope>"),
        "{}",
        stale.body
    );
    let none = send(&c, ENDPOINT, "POST", "/bkt?delete", None, &[], &body).await;
    assert_eq!(none.status, 428, "{none:?}");
    assert_eq!(s3_code(&none), "MissingFencingToken");
    // Query spellings a backend may read as `delete`.
    for q in [
        "/bkt?DELETE",
        "/bkt?%64elete=",
        "/bkt?x-id=DeleteObjects&delete",
    ] {
        let r = send(&c, ENDPOINT, "POST", q, Some("5"), &[], &body).await;
        assert_eq!(r.status, 409, "{q}: {r:?}");
    }

    // Two scopes in one request: refused whole, nothing deleted, no mark advanced.
    let two = delete_body(&["reports/july.csv", "reports/august.csv"]);
    let multi = send(&c, ENDPOINT, "POST", "/bkt?delete", Some("9"), &[], &two).await;
    assert_eq!(multi.status, 400, "{multi:?}");
    assert_eq!(multi.result(), "multi_scope");
    assert_eq!(s3_code(&multi), "MultiScope");

    // Malformed or ambiguous bodies: S3's MalformedXML.
    for bad in [
        "<Delete><Object><Key>a</Key><Key>b</Key></Object></Delete>".to_string(),
        "<Delete><Object><Key>a<!-- -->b</Key></Object></Delete>".into(),
        "not xml".into(),
        delete_body(&["reports//july.csv"]),
        delete_body(&["reports/../july.csv"]),
    ] {
        let r = send(&c, ENDPOINT, "POST", "/bkt?delete", Some("9"), &[], &bad).await;
        assert_eq!(r.status, 400, "{bad}: {r:?}");
        assert_eq!(s3_code(&r), "MalformedXML", "{bad}: {}", r.body);
    }
    assert_eq!(
        double.seen().len(),
        before,
        "nothing refused reached the backend"
    );

    // The current owner: forwarded byte for byte, the mark kept (token 6 still current).
    let ok = send(&c, ENDPOINT, "POST", "/bkt?delete", Some("6"), &[], &body).await;
    assert_eq!(ok.result(), "accepted", "{ok:?}");
    let seen = double.seen();
    let last = seen.last().expect("forwarded");
    assert_eq!(last.method, "POST");
    assert_eq!(last.target, "/bkt?delete");
    assert_eq!(last.body, body.as_bytes());
    let again = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("9"),
        &[],
        "nine",
    )
    .await;
    assert_eq!(
        again.result(),
        "accepted",
        "token 9 was never admitted by the refusals"
    );
}

fn form(key: &str, file_name: &str, content: &str) -> String {
    format!(
        "--b0und\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\n{key}\r\n\
         --b0und\r\nContent-Disposition: form-data; name=\"policy\"\r\n\r\neyJ9\r\n\
         --b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{file_name}\"\r\n\
         Content-Type: text/csv\r\n\r\n{content}\r\n--b0und--\r\n"
    )
}

#[tokio::test]
async fn a_form_upload_is_fenced_on_its_key_field() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(double.addr, web().await, false), dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let ct = [("content-type", "multipart/form-data; boundary=b0und")];

    let put = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("6"),
        &[],
        "six",
    )
    .await;
    assert_eq!(put.result(), "accepted");
    let stale_form = form("reports/july.csv", "f.csv", &"5".repeat(100_000));
    let stale = send(&c, ENDPOINT, "POST", "/bkt", Some("5"), &ct, &stale_form).await;
    assert_eq!(stale.status, 409, "{stale:?}");
    assert!(
        stale
            .body
            .contains("<Scope>object/bkt/reports/july.csv</Scope>"),
        "{}",
        stale.body
    );
    let none = send(&c, ENDPOINT, "POST", "/bkt/", None, &ct, &stale_form).await;
    assert_eq!(none.status, 428, "{none:?}");
    let two_keys = format!(
        "--b0und\r\nContent-Disposition: form-data; name=\"Key\"\r\n\r\nother\r\n{}",
        form("reports/july.csv", "f", "x")
    );
    let dup = send(&c, ENDPOINT, "POST", "/bkt", Some("7"), &ct, &two_keys).await;
    assert_eq!(dup.status, 400, "{dup:?}");
    assert_eq!(s3_code(&dup), "MalformedPOSTRequest");

    // `${filename}`: AWS resolves it, some servers store the key as written; both keys
    // are named, and on a route of one scope per object they are two scopes.
    let var = form("reports/${filename}", "july.csv", "7");
    let multi = send(&c, ENDPOINT, "POST", "/bkt", Some("7"), &ct, &var).await;
    assert_eq!(multi.status, 400, "{multi:?}");
    assert_eq!(multi.result(), "multi_scope");

    let fresh = form("reports/july.csv", "f.csv", &"7".repeat(100_000));
    let ok = send(&c, ENDPOINT, "POST", "/bkt", Some("7"), &ct, &fresh).await;
    assert_eq!(ok.result(), "accepted", "{ok:?}");
    let seen = double.seen();
    let last = seen.last().expect("forwarded");
    assert_eq!(
        last.body,
        fresh.as_bytes(),
        "the form goes on byte for byte"
    );
    assert_eq!(seen.len(), 2, "the refused forms never reached the backend");
    let stale_put = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("6"),
        &[],
        "6",
    )
    .await;
    assert_eq!(
        stale_put.status, 409,
        "the form's token 7 is the object's mark"
    );
}

#[tokio::test]
async fn both_addressing_styles_render_one_scope() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(double.addr, web().await, false), dir.path()).await;
    let c = Client::new(proxy.proxy_addr);

    let path_style = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("6"),
        &[],
        "6",
    )
    .await;
    assert_eq!(path_style.result(), "accepted");
    let vhost = "bkt.s3.test";
    let stale = send(&c, vhost, "PUT", "/reports/july.csv", Some("5"), &[], "5").await;
    assert_eq!(stale.status, 409, "{stale:?}");
    assert!(
        stale
            .body
            .contains("<Scope>object/bkt/reports/july.csv</Scope>"),
        "{}",
        stale.body
    );
    let stale_delete = send(
        &c,
        vhost,
        "POST",
        "/?delete",
        Some("5"),
        &[],
        &delete_body(&["reports/july.csv"]),
    )
    .await;
    assert_eq!(stale_delete.status, 409, "{stale_delete:?}");
    // A Host the backend could read as another bucket (S3 servers match their domain
    // byte for byte and read any other Host as a bucket's name): refused.
    for host in [
        "BKT-2.S3.TEST:80",
        "bkt.S3.test",
        "s3.test:80",
        "bkt.s3.test:8080",
        "S3.test",
    ] {
        let r = send(
            &c,
            host,
            "PUT",
            "/bkt/reports/july.csv",
            Some("9"),
            &[],
            "x",
        )
        .await;
        assert_eq!(r.status, 400, "{host}: {r:?}");
        assert_eq!(r.result(), "invalid_request", "{host}");
    }
    let ok = send(&c, vhost, "PUT", "/reports/july.csv", Some("8"), &[], "8").await;
    assert_eq!(ok.result(), "accepted");
    let seen = double.seen();
    let last = seen.last().expect("forwarded");
    assert_eq!(last.target, "/reports/july.csv", "forwarded as received");
    assert_eq!(last.header("host"), Some(vhost));
    let stale_path = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt/reports/july.csv",
        Some("7"),
        &[],
        "7",
    )
    .await;
    assert_eq!(stale_path.status, 409, "{stale_path:?}");
    // Another host is not the S3 route's: the catch-all pass-through takes it.
    let other = send(
        &c,
        "bkt.elsewhere.test",
        "GET",
        "/reports/july.csv",
        None,
        &[],
        "",
    )
    .await;
    assert_eq!(other.status, 200);
    assert!(other.headers.get("fencing-result").is_none());
}

#[tokio::test]
async fn requests_on_a_bucket_take_its_scope_or_are_refused() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(double.addr, web().await, false), dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let lifecycle = "<LifecycleConfiguration/>";
    for (method, target, token) in [
        ("PUT", "/bkt?lifecycle", Some("1")),
        ("PUT", "/bkt?lifecycle", None),
        ("DELETE", "/bkt", Some("1")),
        ("POST", "/bkt?policy", Some("1")),
        ("GET", "/bkt", Some("1")),
        ("PUT", "/", Some("1")),
        ("DELETE", "/", None),
    ] {
        let r = send(&c, ENDPOINT, method, target, token, &[], lifecycle).await;
        assert_eq!(r.status, 403, "{method} {target}: {r:?}");
        assert_eq!(r.result(), "unfenced_operation");
        assert_eq!(s3_code(&r), "UnfencedOperation");
    }
    assert!(double.seen().is_empty(), "{:?}", double.seen());
    // Reads without a token pass: listing a bucket, the service, an object.
    for target in ["/bkt", "/bkt?list-type=2", "/", "/bkt/k"] {
        let r = send(&c, ENDPOINT, "GET", target, None, &[], "").await;
        assert_eq!(r.status, 200, "{target}: {r:?}");
        assert!(r.headers.get("fencing-result").is_none(), "{target}");
    }
    // A refusal before routing on the S3 host speaks S3.
    let bad = send(&c, ENDPOINT, "GET", "/bkt/a//b", None, &[], "").await;
    assert_eq!(bad.status, 400);
    assert_eq!(s3_code(&bad), "InvalidURI", "{}", bad.body);
    let elsewhere = send(&c, "other.test", "GET", "/a//b", None, &[], "").await;
    assert_eq!(elsewhere.status, 400);
    assert_eq!(
        elsewhere.headers["content-type"],
        "application/problem+json"
    );

    // With a bucket_scope, the bucket's changes are fenced on it.
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(double.addr, web().await, true), dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let ok = send(
        &c,
        ENDPOINT,
        "PUT",
        "/bkt?lifecycle",
        Some("3"),
        &[],
        lifecycle,
    )
    .await;
    assert_eq!(ok.result(), "accepted", "{ok:?}");
    let stale = send(
        &c,
        "bkt.s3.test",
        "DELETE",
        "/?lifecycle",
        Some("2"),
        &[],
        "",
    )
    .await;
    assert_eq!(stale.status, 409, "{stale:?}");
    assert!(
        stale.body.contains("<Scope>bucket/bkt</Scope>"),
        "{}",
        stale.body
    );
    let missing = send(&c, ENDPOINT, "DELETE", "/bkt", None, &[], "").await;
    assert_eq!(missing.status, 428, "{missing:?}");
    // DeleteBucket: some servers (s3s-fs) delete a bucket with its objects, so one with
    // a fenced object under another scope is refused; an empty one passes.
    let put = send(&c, ENDPOINT, "PUT", "/bkt/k", Some("1"), &[], "x").await;
    assert_eq!(put.result(), "accepted");
    for target in ["/bkt", "/bkt/", "/bkt?x-id=DeleteBucket"] {
        let r = send(&c, ENDPOINT, "DELETE", target, Some("4"), &[], "").await;
        assert_eq!(r.status, 400, "{target}: {r:?}");
        assert_eq!(r.result(), "multi_scope");
    }
    let r = send(&c, "bkt.s3.test", "DELETE", "/", Some("4"), &[], "").await;
    assert_eq!(r.result(), "multi_scope", "virtual-hosted: {r:?}");
    let empty = send(&c, ENDPOINT, "DELETE", "/empty", Some("1"), &[], "").await;
    assert_eq!(empty.result(), "accepted", "{empty:?}");
}

/// `keys = "opaque"`: keys S3 allows and a path's rules refuse are keys of their own, one
/// scope per spelling of one key, in the path and in a body alike.
#[tokio::test]
async fn opaque_keys_are_keys_of_their_own() {
    let double = Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let text = config_with(double.addr, web().await, "keys = \"opaque\"\n");
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let put = |target: &'static str, token: &'static str| {
        let c = &c;
        async move { send(c, ENDPOINT, "PUT", target, Some(token), &[], "x").await }
    };
    for (target, token) in [
        ("/bkt/a//b", "5"),
        ("/bkt/a/./b", "5"),
        ("/bkt/a%5Cb", "5"),
        ("/bkt/dir/", "5"),
        ("/bkt/a/b", "1"),
    ] {
        let r = put(target, token).await;
        assert_eq!(r.result(), "accepted", "{target}: {r:?}");
    }
    // The same keys spelt otherwise, in the path and in a DeleteObjects body.
    for target in [
        "/bkt/a%2F%2Fb",
        "/bkt/a%2F.%2Fb",
        "/bkt/a\\b",
        "/bkt/dir%2F",
    ] {
        let r = put(target, "4").await;
        assert_eq!(r.status, 409, "{target}: {r:?}");
    }
    let body = delete_body(&["a//b"]);
    let r = send(&c, ENDPOINT, "POST", "/bkt?delete", Some("4"), &[], &body).await;
    assert_eq!(r.status, 409, "{r:?}");
    assert!(
        r.body.contains("<Scope>object/bkt/a//b</Scope>"),
        "{}",
        r.body
    );
    let r = send(&c, "bkt.s3.test", "PUT", "/a//b", Some("4"), &[], "x").await;
    assert_eq!(r.status, 409, "virtual-hosted: {r:?}");
    // Still refused: control characters, bad escapes, a bucket that is not one segment.
    for target in ["/bkt/a%0Ab", "/bkt/a%zz", "//k", "/b%2Fx/k"] {
        let r = put(target, "9").await;
        assert_eq!(r.status, 400, "{target}: {r:?}");
        assert_eq!(r.result(), "invalid_path");
    }
}
