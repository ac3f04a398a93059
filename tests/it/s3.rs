//! `errors = "s3"`: over the test double, what the dialect changes and what it leaves;
//! and end to end, boto3 against fencegate in front of `s3s-fs`, a real S3 server that
//! verifies SigV4. Both are installed by `scripts/test.sh` (s3s-fs with `cargo install`
//! into `target/s3s-fs`, boto3 into the virtualenv `target/s3-venv`); the end-to-end test
//! run without them fails and says so.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support;

pub(super) const ACCESS_KEY: &str = "AKFENCEGATETEST";
pub(super) const SECRET_KEY: &str = "SKFENCEGATETESTsecret";
/// How long the boto3 script may take (it uploads about 5 MiB twice over loopback).
const SCRIPT_BOUND: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(20);

fn in_target(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(rel)
}

/// The installed tool at `rel` under target/, or a failure saying how to get it.
pub(super) fn tool(rel: &str, what: &str) -> PathBuf {
    let path = in_target(rel);
    assert!(
        path.is_file(),
        "{what} is missing ({}): run `bash scripts/test.sh`, which installs it",
        path.display()
    );
    path
}

/// An `s3s-fs` process on loopback, its data under a temporary root; killed on drop.
pub(super) struct S3sFs {
    child: Child,
    pub(super) addr: SocketAddr,
    _root: tempfile::TempDir,
}

impl S3sFs {
    /// On `port`; serving virtual-hosted requests too under each of `domains` (as the
    /// Host header names it, port included), if any.
    pub(super) fn start(port: u16, domains: &[&str]) -> S3sFs {
        let bin = tool("s3s-fs/bin/s3s-fs", "s3s-fs");
        let root = tempfile::tempdir().expect("s3s-fs root");
        let mut command = Command::new(bin);
        command
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY]);
        for domain in domains {
            command.args(["--domain", domain]);
        }
        let child = command
            .arg(root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn s3s-fs");
        let mut server = S3sFs {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            _root: root,
        };
        let deadline = Instant::now() + support::BOUND;
        while std::net::TcpStream::connect(server.addr).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("s3s-fs exited before listening: {status}");
            }
            assert!(Instant::now() < deadline, "s3s-fs did not listen");
            std::thread::sleep(POLL);
        }
        server
    }

    /// Where it keeps its buckets, objects and uploads (as files).
    pub(super) fn root(&self) -> &Path {
        self._root.path()
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The S3 endpoint's host, served by an `api = "s3"` route path-style and virtual-hosted;
/// the scripts resolve it (and its subdomains) to loopback.
pub(super) const ENDPOINT_HOST: &str = "s3.test";

pub(super) fn config(upstream: SocketAddr, listen: u16) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{listen}"
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
host = "{ENDPOINT_HOST}:{listen}"
virtual_host_domain = "{ENDPOINT_HOST}:{listen}"
path = "/{{bucket}}/{{*key}}"
scope = "object/{{bucket}}/{{key}}"
bucket_scope = "bucket/{{bucket}}"
upstream = "s3"
"#
    )
}

/// Runs a boto3 script of tests/it with `endpoint` (a URL or a port, as the script
/// takes it); its exit status and what it printed.
async fn boto3(script: &str, endpoint: &str) -> (std::process::ExitStatus, String, String) {
    let python = tool("s3-venv/bin/python", "the boto3 virtualenv");
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it")
        .join(script);
    let mut child = Command::new(python)
        .arg(script)
        .arg(endpoint)
        .args([ACCESS_KEY, SECRET_KEY])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn python");
    // Read on their own threads, so a full pipe never stalls the script.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + SCRIPT_BOUND;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait python") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the boto3 script took over {SCRIPT_BOUND:?}");
        }
        // The proxy runs on this runtime's other threads meanwhile.
        tokio::time::sleep(POLL).await;
    };
    let out = out.join().expect("stdout reader");
    let err = err.join().expect("stderr reader");
    (status, out, err)
}

/// Put, multipart upload, stale put and stale delete through boto3, every request signed
/// with SigV4 and verified by s3s-fs behind fencegate: the refusals surface in boto3 as
/// `ClientError` with `Error.Code` "StaleFence" and fencegate's fields, and the object
/// keeps the token-6 content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_through_fencegate_to_a_sigv4_server() {
    let s3 = S3sFs::start(support::free_port(), &[]);
    let dir = tempfile::tempdir().expect("dir");
    let listen = support::free_port();
    let _proxy = support::start_text(&config(s3.addr, listen), dir.path()).await;
    let endpoint = format!("http://{ENDPOINT_HOST}:{listen}");
    let (status, out, err) = boto3("s3_sdk.py", &endpoint).await;
    println!("{out}");
    assert!(
        status.success(),
        "boto3 script failed ({status}):\n{out}\n{err}"
    );
    for step in [
        "create_bucket: ok",
        "put token 5: ok",
        "multipart token 6: ok",
        "get: token 6 content",
        "unsigned token header: ok",
        "wrong secret: refused by the server code=SignatureDoesNotMatch",
        "s3 sdk: all ok",
    ] {
        assert!(out.contains(step), "no `{step}` in:\n{out}");
    }
    for (what, presented) in [
        ("put token 4", "4"),
        ("delete token 4", "4"),
        ("unsigned put token 3", "3"),
    ] {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{what}: refused")))
            .unwrap_or_else(|| panic!("no refusal of `{what}` in:\n{out}"));
        assert!(line.contains("code=StaleFence status=409"), "{line}");
        assert!(line.contains("result=stale_fence"), "{line}");
        assert!(line.contains(&format!("presented={presented} ")), "{line}");
        assert!(line.contains("message=A newer lock generation"), "{line}");
    }
    let put4 = out
        .lines()
        .find(|l| l.starts_with("put token 4: refused"))
        .expect("put token 4");
    assert!(
        put4.contains("scope=object/reports/2026/july.csv "),
        "{put4}"
    );
    assert!(put4.contains("highest=6 "), "{put4}");
}

/// The ways S3 names an object outside the path (SPEC §15), through boto3 to s3s-fs
/// serving both addressing styles: DeleteObjects, a form upload, a virtual-hosted write
/// and a bucket's settings, each refused with a stale token or none and the object
/// intact; two scopes in one request refused; the current token's requests applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_cannot_reach_a_fenced_object_by_another_name() {
    let listen = support::free_port();
    let s3 = S3sFs::start(
        support::free_port(),
        &[&format!("{ENDPOINT_HOST}:{listen}")],
    );
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(s3.addr, listen), dir.path()).await;
    let (status, out, err) = boto3("s3_named.py", &listen.to_string()).await;
    println!("{out}");
    assert!(
        status.success(),
        "boto3 script failed ({status}):\n{out}\n{err}"
    );
    for step in [
        "delete_objects token 5: refused code=StaleFence status=409 result=stale_fence scope=object/bkt/reports/july.csv",
        "delete_objects no token: refused code=MissingFencingToken status=428",
        "delete_objects two scopes: refused code=MultiScope status=400 result=multi_scope",
        "delete_objects: object intact",
        "form upload token 5: status=409 result=stale_fence",
        "form upload no token: status=428 result=missing_token",
        "form upload with ${filename}: status=400 result=multi_scope",
        "form upload: object intact",
        "virtual put token 5: refused code=StaleFence status=409 result=stale_fence scope=object/bkt/reports/july.csv",
        "virtual delete_objects token 5: refused code=StaleFence status=409",
        "virtual-hosted: one scope with path-style",
        "bucket tagging token 0: refused code=StaleFence status=409 result=stale_fence scope=bucket/bkt",
        "upload_part of another key's upload: refused code=MultiScope status=400 result=multi_scope",
        "upload_part of an unknown upload: refused code=NoSuchUpload status=404 result=unknown_upload",
        "multipart: the upload is its key's",
        "form upload token 8: status=204 result=accepted",
        "delete_objects token 8: deleted",
        "s3 named: all ok",
    ] {
        assert!(out.contains(step), "no `{step}` in:\n{out}");
    }
    drop(proxy);
}

/// boto3's own retry of a keyed PutObject whose answer a hop between it and fencegate
/// lost (a 503 in its place): botocore signs the retry anew (another `X-Amz-Date`,
/// `Authorization` and `amz-sdk-request`), and fencegate takes it for the same request,
/// replaying the stored answer (`duplicate`); the backend sees one PutObject. The same key
/// with another `x-amz-meta-*` or `Content-Type` is 422 `key_reused`
/// (tests/it/s3_retry.py has the story).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boto3_retry_of_a_lost_answer_is_a_duplicate() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let listen = support::free_port();
    let text = config(double.addr, listen).replace(
        "upstream = \"s3\"\n",
        "upstream = \"s3\"\nidempotency = \"optional\"\n",
    );
    assert!(text.contains("idempotency = \"optional\""), "{text}");
    let proxy = support::start_text(&text, dir.path()).await;
    let (status, out, err) = boto3("s3_retry.py", &listen.to_string()).await;
    println!("{out}");
    assert!(
        status.success(),
        "boto3 script failed ({status}):\n{out}\n{err}"
    );
    for step in [
        "retry after 503: ok attempts=2 fencegate=200 accepted,200 duplicate",
        "retry re-signed: amz-sdk-request authorization x-amz-date changed",
        "retry attempt header: attempt=2",
        "other metadata, same key: refused status=422 result=key_reused",
        "other content type, same key: refused status=422 result=key_reused",
        "s3 retry: all ok",
    ] {
        assert!(out.contains(step), "no `{step}` in:\n{out}");
    }
    let puts: Vec<_> = double
        .seen()
        .into_iter()
        .filter(|s| s.method == "PUT")
        .collect();
    assert_eq!(
        puts.len(),
        1,
        "the backend applied the PutObject once: {puts:?}"
    );
    assert_eq!(puts[0].target, "/bkt/reports/july.csv");
    proxy.shutdown().await;
}

/// The same routes twice over the test double, one in each dialect: fencegate's refusals
/// differ only in body and `Content-Type`; answers from the upstream, and a pass-through
/// route's, are the same bytes in both.
#[tokio::test]
async fn the_dialect_changes_only_fencegates_own_bodies() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let text = format!(
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
name = "u"
url = "http://{}"
[[route]]
name = "xml"
api = "plain"
path = "/xml/{{bucket}}/{{*key}}"
scope = "xml/{{key}}"
upstream = "u"
errors = "s3"
[[route]]
name = "xml-open"
path = "/xml-open/{{*key}}"
upstream = "u"
fenced = false
errors = "s3"
[[route]]
name = "json"
api = "plain"
path = "/json/{{bucket}}/{{*key}}"
scope = "json/{{key}}"
upstream = "u"
"#,
        double.addr
    );
    let proxy = support::start_text(&text, dir.path()).await;
    let client = support::Client::new(proxy.proxy_addr);
    // Headers fencegate sets on every answer it makes; the rest must match too.
    let same_heads = |a: &support::Resp, b: &support::Resp| {
        assert_eq!(a.status, b.status);
        for name in [
            "fencing-result",
            "cache-control",
            "retry-after",
            "connection",
        ] {
            assert_eq!(a.headers.get(name), b.headers.get(name), "{name}");
        }
        let names = |r: &support::Resp| {
            let mut v: Vec<String> = r.headers.keys().map(|k| k.to_string()).collect();
            v.sort();
            v
        };
        assert_eq!(names(a), names(b));
    };

    for (dialect, base) in [("xml", "/xml/b"), ("json", "/json/b")] {
        let ok = client.put(&format!("{base}/a&b'c.txt"), "7", "x").await;
        assert_eq!(ok.status, 200, "{dialect}: {ok:?}");
        assert_eq!(ok.result(), "accepted");
        assert_eq!(ok.headers["x-upstream"], "double");
        assert_eq!(ok.body, format!("PUT {base}/a&b'c.txt token=7"));
    }

    let stale_xml = client.put("/xml/b/a&b'c.txt", "6", "x").await;
    let stale_json = client.put("/json/b/a&b'c.txt", "6", "x").await;
    same_heads(&stale_xml, &stale_json);
    assert_eq!(stale_xml.status, 409);
    assert_eq!(stale_xml.headers["content-type"], "application/xml");
    assert_eq!(
        stale_json.headers["content-type"],
        "application/problem+json"
    );
    let id = stale_xml.headers["x-request-id"]
        .to_str()
        .expect("request id");
    assert_eq!(
        stale_xml.body,
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>StaleFence</Code>\
             <Message>A newer lock generation reached this scope; discard this work and re-acquire</Message>\
             <Resource>/xml/b/a&amp;b&apos;c.txt</Resource><RequestId>{id}</RequestId>\
             <FencingResult>stale_fence</FencingResult><Scope>xml/a&amp;b&apos;c.txt</Scope>\
             <Presented>6</Presented><HighestAccepted>7</HighestAccepted></Error>"
        )
    );
    assert_eq!(stale_json.json()["result"], "stale_fence");

    let missing_xml = client.send("DELETE", "/xml/b/k", &[], "").await;
    let missing_json = client.send("DELETE", "/json/b/k", &[], "").await;
    same_heads(&missing_xml, &missing_json);
    assert_eq!(missing_xml.status, 428);
    assert!(
        missing_xml
            .body
            .contains("<Code>MissingFencingToken</Code>"),
        "{}",
        missing_xml.body
    );
    assert!(missing_xml.body.contains("<Scope>xml/k</Scope>"));
    assert!(!missing_xml.body.contains("<Presented>"));

    // A pass-through route on the S3 dialect: the upstream's answer as it is.
    let open = client.get("/xml-open/any/thing").await;
    assert_eq!(open.status, 200);
    assert_eq!(open.headers["x-upstream"], "double");
    assert_eq!(open.body, "GET /xml-open/any/thing token=-");
    assert!(open.headers.get("fencing-result").is_none());
}

/// `fencegate probe --keys`: s3s-fs stores objects as files, so `a//b` is `a/b` there and
/// an S3 route in front of it needs `keys = "strict"`; a store that keeps keys as given
/// may have `keys = "opaque"`. Requests are signed (s3s-fs refuses a wrong secret).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_tells_which_keys_a_backend_needs() {
    let s3 = S3sFs::start(support::free_port(), &[]);
    let python = tool("s3-venv/bin/python", "the boto3 virtualenv");
    let created = Command::new(python)
        .arg("-c")
        .arg(format!(
            "import boto3; boto3.client('s3', endpoint_url='http://{}', aws_access_key_id='{ACCESS_KEY}', aws_secret_access_key='{SECRET_KEY}', region_name='us-east-1').create_bucket(Bucket='probe')",
            s3.addr
        ))
        .status()
        .expect("python");
    assert!(created.success());
    let probe = |secret: &str, url: String| {
        Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args([
                "probe",
                "--keys",
                &url,
                "--access-key",
                ACCESS_KEY,
                "--secret-key",
                secret,
            ])
            .output()
            .expect("fencegate probe")
    };
    let out = probe(SECRET_KEY, format!("http://{}/probe", s3.addr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("a//b       (next to a/b): the same object as `a/b`"),
        "{text}"
    );
    assert!(text.contains("keys = \"strict\""), "{text}");
    let wrong = probe("wrong", format!("http://{}/probe", s3.addr));
    assert!(
        !wrong.status.success(),
        "a wrong secret is refused by s3s-fs"
    );

    // A store that keeps every key as sent, by its raw path.
    let verbatim = verbatim_store().await;
    let out = probe(SECRET_KEY, format!("http://{verbatim}/bucket"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("keys = \"opaque\""), "{text}");
    assert!(!text.contains("the same object"), "{text}");
}

/// An HTTP store of bodies by raw path (PUT, GET, DELETE), on loopback.
async fn verbatim_store() -> SocketAddr {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let objects: Arc<Mutex<HashMap<String, Bytes>>> = Arc::default();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let objects = objects.clone();
            let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let objects = objects.clone();
                async move {
                    let path = req.uri().path().to_string();
                    let method = req.method().clone();
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let mut map = objects.lock().expect("store");
                    let (status, out) = match method {
                        http::Method::PUT => {
                            map.insert(path, body);
                            (200, Bytes::new())
                        }
                        http::Method::GET => match map.get(&path) {
                            Some(b) => (200, b.clone()),
                            None => (404, Bytes::new()),
                        },
                        http::Method::DELETE => {
                            map.remove(&path);
                            (204, Bytes::new())
                        }
                        _ => (405, Bytes::new()),
                    };
                    let mut resp = http::Response::new(Full::new(out));
                    *resp.status_mut() = http::StatusCode::from_u16(status).expect("status");
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}
