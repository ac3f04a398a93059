//! The object-identity oracle's S3 half: random S3 requests, each signed with SigV4 and
//! carrying a token (now and then a stale one, or none), go through fencegate's S3 route
//! to s3s-fs. The requests name objects every way S3 has: keys in the path in several
//! spellings, path-style and virtual-hosted, DeleteObjects bodies, browser-form uploads,
//! the upload ids of multipart uploads, CopyObject's source. After each, s3s-fs's tree is
//! read again: every file it changed (an object, its metadata, an upload's parts and
//! record) belongs to one object, and when that object's scope is fenced, fencegate must
//! have decided that scope for the request, with its token, and accepted it. Anything
//! else is a bypass: the test fails with the seed and the requests that led there.
//!
//! The set-up has an unfenced area on the same backend, where a bypass would hide: a
//! public bucket served on a host of its own (`public.test`), the upstream declaring
//! `distinct_hosts` (s3s-fs reads that Host as the bucket's name).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use crate::s3::{ACCESS_KEY, S3sFs, SECRET_KEY};
use crate::support::oracle::{changed, next_line, seed, snapshot, steps};
use crate::support::sigv4::{self, Keys};
use crate::support::{self, Client, Rng};

/// The buckets the S3 route fences, one scope per object.
const FENCED: [&str; 2] = ["bkt", "bk2"];
/// The public bucket: its own Host, a pass-through route.
const PUBLIC: &str = "public.test";
/// Few keys, so that requests meet: an object written, then deleted by another name.
const KEYS: [&str; 7] = ["a", "b", "d/a", "d/b", "é", "a b", "a+b"];
const CREDENTIALS: Keys<'static> = Keys {
    access: ACCESS_KEY,
    secret: SECRET_KEY,
};
const BOUNDARY: &str = "oracle0boundary";

/// The S3 route (path-style and virtual-hosted on `s3.test`), and the public bucket's
/// pass-through route on the same upstream.
fn config(upstream: SocketAddr, listen: u16) -> String {
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
[log]
access = "access.log"
[[upstream]]
name = "s3"
url = "http://{upstream}"
distinct_hosts = true
[[route]]
name = "objects"
api = "s3"
host = "s3.test:{listen}"
virtual_host_domain = "s3.test:{listen}"
path = "/{{bucket}}/{{*key}}"
scope = "object/{{bucket}}/{{key}}"
bucket_scope = "bucket/{{bucket}}"
upstream = "s3"
[[route]]
name = "public"
host = "{PUBLIC}"
path = "/{{*rest}}"
upstream = "s3"
fenced = false
"#
    )
}

/// A key as s3s-fs files it (a path under the bucket's directory): split at `/`, empty
/// and `.` segments dropped, `..` taking one back.
fn filed(key: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in key.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s.to_string()),
        }
    }
    out
}

/// The scope of the object at `key` (as filed) in `bucket`; `None` in the public bucket.
fn scope_of(bucket: &str, key: &[String]) -> Option<String> {
    if bucket == PUBLIC {
        return None;
    }
    Some(match key {
        [] => format!("bucket/{bucket}"),
        _ => format!("object/{bucket}/{}", key.join("/")),
    })
}

/// The own scope of a file of s3s-fs's tree: objects are files under their bucket's
/// directory; an object's metadata is `.bucket-{b64 bucket}.object-{b64 key}...json` at
/// the top; an upload is `.upload-{id}.json` and its parts `.upload_id-{id}.part-{n}`,
/// which belong to the object the upload was created for (`uploads`: id to bucket and
/// key, from CreateMultipartUpload's answers). An upload of no known object has a scope
/// no request decides.
fn own_scope(rel: &[String], uploads: &HashMap<String, (String, String)>) -> Option<String> {
    let upload = |id: &str| match uploads.get(id) {
        Some((bucket, key)) => scope_of(bucket, &filed(key)),
        None => Some(format!("(the unknown upload {id})")),
    };
    match rel {
        [name] if name.starts_with(".tmp.") => None,
        [name] if name.starts_with(".bucket-") => {
            let rest = &name[".bucket-".len()..];
            let (bucket, rest) = rest.split_once(".object-")?;
            let key = rest.split('.').next()?;
            let bucket = String::from_utf8(base64url(bucket)?).ok()?;
            let key = String::from_utf8(base64url(key)?).ok()?;
            scope_of(&bucket, &filed(&key))
        }
        [name] if name.starts_with(".upload_id-") => {
            upload(name[".upload_id-".len()..].split(".part-").next()?)
        }
        [name] if name.starts_with(".upload-") => upload(
            name[".upload-".len()..]
                .strip_suffix(".json")
                .unwrap_or(name),
        ),
        [bucket, key @ ..] => scope_of(bucket, &filed(&key.join("/"))),
        [] => None,
    }
}

/// Unpadded URL-safe base64 (s3s-fs's names of metadata files).
fn base64url(text: &str) -> Option<Vec<u8>> {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in text.bytes() {
        let v = ABC.iter().position(|&a| a == c)? as u32;
        bits = (bits << 6) | v;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    Some(out)
}

/// Where a request is sent: its Host, the path up to the key, and the bucket s3s-fs
/// would read from them.
struct Place {
    host: String,
    prefix: String,
    bucket: &'static str,
}

/// Path-style most of the time, virtual-hosted, the public host, or a Host that names
/// the endpoint in another spelling (which fencegate refuses).
fn place(rng: &mut Rng, listen: u16) -> Place {
    let bucket = rng.pick(&FENCED);
    match rng.below(12) {
        0..=6 => Place {
            host: format!("s3.test:{listen}"),
            prefix: format!("/{bucket}"),
            bucket,
        },
        7..=9 => Place {
            host: format!("{bucket}.s3.test:{listen}"),
            prefix: String::new(),
            bucket,
        },
        10 => Place {
            host: rng.pick(&[PUBLIC, "PUBLIC.test"]).to_string(),
            prefix: String::new(),
            bucket: PUBLIC,
        },
        _ => {
            let odd = [
                format!("S3.test:{listen}"),
                "s3.test".to_string(),
                format!("s3.test:{listen}."),
                format!("{}.S3.test:{listen}", bucket.to_uppercase()),
                format!("{PUBLIC}:{listen}"),
                format!("127.0.0.1:{listen}"),
            ];
            Place {
                host: odd[rng.below(odd.len() as u64) as usize].clone(),
                prefix: format!("/{bucket}"),
                bucket,
            }
        }
    }
}

/// A key spelled in a path as a client might: escapes in either case (anything but
/// unreserved bytes always escaped), now and then an escaped or doubled slash, a dot
/// segment, a trailing slash.
fn spell_key(rng: &mut Rng, key: &str) -> String {
    let mut out = String::new();
    for (i, s) in key.split('/').enumerate() {
        if i > 0 {
            out.push_str(if rng.chance(12) {
                rng.pick(&["%2F", "%2f", "//"])
            } else {
                "/"
            });
        }
        if rng.chance(15) {
            out.push_str(rng.pick(&["./", "x/../", "%2E/", "%2e%2e/"]));
        }
        for b in s.bytes() {
            if (b.is_ascii_alphanumeric() || b"-_.~".contains(&b)) && !rng.chance(6) {
                out.push(b as char);
            } else if rng.chance(2) {
                out.push_str(&format!("%{b:02x}"));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    if rng.chance(15) {
        out.push('/');
    }
    out
}

/// A key as a DeleteObjects body names it: characters as references now and then
/// (decimal or hex), or in CDATA, or with a dot segment or doubled slash.
fn xml_key(rng: &mut Rng, key: &str) -> String {
    match rng.below(16) {
        0 => format!("<![CDATA[{key}]]>"),
        // s3s skips CDATA: a reader that kept it would read another key.
        3 => format!("{key}<![CDATA[x]]>"),
        1 => rng.pick(&["x/../", "./", "d//"]).to_string() + key,
        2 => format!("{key}/"),
        _ => key
            .chars()
            .map(|c| {
                if rng.chance(5) {
                    if rng.chance(2) {
                        format!("&#x{:x};", c as u32)
                    } else {
                        format!("&#{};", c as u32)
                    }
                } else {
                    c.to_string()
                }
            })
            .collect(),
    }
}

/// Another key, or (one time in `same`) this one.
fn near(rng: &mut Rng, key: &'static str, same: u64) -> &'static str {
    if rng.chance(same) {
        key
    } else {
        rng.pick(&KEYS)
    }
}

/// One request, before it is signed.
struct Request {
    method: &'static str,
    target: String,
    host: String,
    headers: Vec<(&'static str, String)>,
    body: String,
    /// A form upload signs its policy, not the request.
    form: bool,
}

/// What the run remembers of multipart uploads: id to bucket and key (as s3s-fs
/// answered), and the ETag of each id's part 1.
#[derive(Default)]
struct Uploads {
    of: HashMap<String, (String, String)>,
    ids: Vec<String>,
    etags: HashMap<String, String>,
}

impl Uploads {
    /// An upload id for a request on `bucket`: mostly one the run created (for any key and
    /// bucket, the public one too, and maybe completed or aborted since), else one nobody
    /// created.
    fn pick(&self, rng: &mut Rng, _bucket: &str) -> String {
        let ids: Vec<&String> = self.ids.iter().collect();
        if ids.is_empty() || rng.chance(8) {
            "0b5e55ed-0000-4000-8000-000000000000".to_string()
        } else {
            ids[rng.below(ids.len() as u64) as usize].clone()
        }
    }

    /// The object `id` was created for, as a path-style target (one time in two: else
    /// the request names another object, in the same scope or not).
    fn own_object(&self, rng: &mut Rng, id: &str) -> Option<String> {
        let (bucket, key) = self.of.get(id)?;
        (bucket != PUBLIC && rng.chance(2)).then(|| format!("/{bucket}/{}", spell_key(rng, key)))
    }
}

/// A random request: which operation, on which object, named how.
fn generate(rng: &mut Rng, listen: u16, step: usize, uploads: &Uploads) -> Request {
    let at = place(rng, listen);
    let key = rng.pick(&KEYS);
    let object = format!("{}/{}", at.prefix, spell_key(rng, key));
    let bucket_path = if at.prefix.is_empty() {
        "/".to_string()
    } else {
        at.prefix.clone()
    };
    // The object an upload was created for, path-style on the endpoint, now and then.
    let own = |rng: &mut Rng, id: &str, host: &mut String| {
        let target = uploads.own_object(rng, id)?;
        *host = format!("s3.test:{listen}");
        Some(target)
    };
    let mut r = Request {
        method: "PUT",
        target: object.clone(),
        host: at.host.clone(),
        headers: Vec::new(),
        body: String::new(),
        form: false,
    };
    match rng.below(21) {
        0..=4 => r.body = format!("put step {step}"),
        5..=6 => r.method = "DELETE",
        7..=9 => {
            r.method = "POST";
            let query = rng.pick(&["delete", "delete=", "delete&x-id=DeleteObjects", "Delete"]);
            r.target = format!("{bucket_path}?{query}");
            r.body = delete_body(rng, key);
        }
        10..=11 => {
            r.method = "POST";
            // Now and then on the object's path (S3 takes a form on the bucket only).
            r.target = if rng.chance(6) { object } else { bucket_path };
            r.form = true;
            r.headers.push((
                "content-type",
                format!("multipart/form-data; boundary={BOUNDARY}"),
            ));
            r.body = form_body(rng, key, at.bucket, step);
        }
        12..=13 => {
            r.method = "POST";
            r.target = format!("{object}?uploads");
        }
        14..=15 => {
            let id = uploads.pick(rng, at.bucket);
            let object = own(rng, &id, &mut r.host).unwrap_or(object);
            let name = rng.pick(&["uploadId", "uploadId", "uploadid"]);
            r.target = format!("{object}?partNumber=1&{name}={id}");
            if rng.chance(4) {
                // UploadPartCopy: the part's bytes from another object.
                let from = rng.pick(&FENCED);
                let source_key = rng.pick(&KEYS);
                r.headers.push((
                    "x-amz-copy-source",
                    format!("{from}/{}", spell_key(rng, source_key)),
                ));
            } else {
                r.body = format!("part step {step}");
            }
        }
        16 => {
            let id = uploads.pick(rng, at.bucket);
            let object = own(rng, &id, &mut r.host).unwrap_or(object);
            let etag = uploads.etags.get(&id).cloned().unwrap_or("\"0\"".into());
            r.method = "POST";
            r.target = format!("{object}?uploadId={id}");
            r.body = format!(
                "<CompleteMultipartUpload><Part><ETag>{}</ETag><PartNumber>1</PartNumber></Part></CompleteMultipartUpload>",
                etag.replace('"', "&quot;")
            );
        }
        17 => {
            let id = uploads.pick(rng, at.bucket);
            let object = own(rng, &id, &mut r.host).unwrap_or(object);
            r.method = "DELETE";
            r.target = format!("{object}?uploadId={id}");
        }
        20 => {
            // A DELETE on the bucket: DeleteBucket (s3s-fs removes the objects with it)
            // unless its query names a sub-resource S3 deletes instead.
            r.method = "DELETE";
            let query = rng.pick(&[
                "",
                "?x-id=DeleteBucket",
                "?tagging",
                "?Tagging",
                "?%74agging",
                "?delete",
                "?versionId=1",
            ]);
            r.target = format!("{bucket_path}{query}");
        }
        _ => {
            let from = if rng.chance(4) {
                PUBLIC
            } else {
                rng.pick(&FENCED)
            };
            let source_key = near(rng, key, 3);
            let source = format!("{from}/{}", spell_key(rng, source_key));
            let source = if rng.chance(2) {
                format!("/{source}")
            } else {
                source
            };
            r.headers.push(("x-amz-copy-source", source));
        }
    }
    r
}

/// A DeleteObjects body naming `key` and maybe others (mostly `key` again, by another
/// spelling), with odd whitespace between the elements.
fn delete_body(rng: &mut Rng, key: &'static str) -> String {
    let ws = |rng: &mut Rng| rng.pick(&["", "\n", " \t\r\n", "  "]);
    let mut body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>{}<Delete xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">{}",
        ws(rng),
        ws(rng)
    );
    if rng.chance(2) {
        body.push_str("<Quiet>true</Quiet>");
    }
    for i in 0..=rng.below(3) {
        let k = if i == 0 { key } else { near(rng, key, 2) };
        let spelled = xml_key(rng, k);
        let (a, b, c) = (ws(rng), ws(rng), ws(rng));
        body.push_str(&format!("<Object>{a}<Key>{spelled}</Key>{b}</Object>{c}"));
    }
    body.push_str("</Delete>");
    body
}

/// A browser-form upload of `key` (now and then under `${filename}`), signed for
/// `bucket`: the key field, the policy's fields, then the file.
fn form_body(rng: &mut Rng, key: &str, bucket: &str, step: usize) -> String {
    let key = if rng.chance(6) {
        "d/${filename}".to_string()
    } else {
        key.to_string()
    };
    // The key's part as a browser writes it, or with a charset, or a byte order mark
    // (s3s reads a field's bytes as UTF-8, whatever its part says).
    let (key, key_type) = match rng.below(10) {
        0 | 1 => {
            let charset = rng.pick(&["iso-8859-1", "utf-16le", "utf-16le", "UTF-8"]);
            (
                key,
                format!("\r\nContent-Type: text/plain; charset={charset}"),
            )
        }
        2 => (format!("\u{feff}{key}"), String::new()),
        _ => (key, String::new()),
    };
    let filename = rng.pick(&["a", "b", "upload.txt"]);
    let mut fields = vec![(rng.pick(&["key", "key", "Key"]), key)];
    fields.extend(sigv4::form_fields(CREDENTIALS, bucket));
    let mut body = String::new();
    for (i, (name, value)) in fields.into_iter().enumerate() {
        let headers = if i == 0 { key_type.as_str() } else { "" };
        body.push_str(&format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"{headers}\r\n\r\n{value}\r\n"
        ));
    }
    body.push_str(&format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: text/plain\r\n\r\nform step {step}\r\n--{BOUNDARY}--\r\n"
    ));
    body
}

/// The text of the first `<name>` element of an XML answer (references in it resolved,
/// the few S3 writes).
fn element(xml: &str, name: &str) -> Option<String> {
    let start = xml.find(&format!("<{name}>"))? + name.len() + 2;
    let len = xml[start..].find(&format!("</{name}>"))?;
    Some(
        xml[start..start + len]
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

/// s3s-fs behind fencegate, with the buckets made, and what was sent so far.
struct Harness {
    s3: S3sFs,
    proxy: fencegate::app::Running,
    client: Client,
    listen: u16,
    log: std::path::PathBuf,
    seen: usize,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start() -> Harness {
        let listen = support::free_port();
        let s3 = S3sFs::start(support::free_port(), &[&format!("s3.test:{listen}")]);
        // The buckets, there from the start (as a deployment has them).
        for b in FENCED.iter().chain([&PUBLIC]) {
            std::fs::create_dir_all(s3.root().join(b)).expect("mkdir");
        }
        let dir = tempfile::tempdir().expect("dir");
        let proxy = support::start_text(&config(s3.addr, listen), dir.path()).await;
        Harness {
            client: Client::new(proxy.proxy_addr),
            log: dir.path().join("access.log"),
            s3,
            proxy,
            listen,
            seen: 0,
            _dir: dir,
        }
    }

    /// Sends `r`, signed, with `token`; the answer and the access log's line for it.
    async fn send(
        &mut self,
        r: &Request,
        token: Option<&str>,
    ) -> (support::Resp, Option<serde_json::Value>) {
        let mut headers = r.headers.clone();
        headers.push(("host", r.host.clone()));
        if !r.form {
            headers.extend(sigv4::sign(
                CREDENTIALS,
                r.method,
                &r.target,
                &r.host,
                &r.headers,
                r.body.as_bytes(),
            ));
        }
        if let Some(t) = token {
            headers.push(("fencing-token", t.to_string()));
        }
        let sent: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let resp = self.client.send(r.method, &r.target, &sent, &r.body).await;
        let line = next_line(&self.log, &mut self.seen).await;
        (resp, line)
    }
}

/// Runs `steps` random requests against s3s-fs behind fencegate.
async fn run(seed: u64, steps: usize) {
    let mut h = Harness::start().await;
    let listen = h.listen;
    let mut rng = Rng(seed);
    let mut uploads = Uploads::default();
    let mut history = Vec::new();
    let mut accepted = 0;
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let mut changes = 0;
    for step in 1..=steps {
        let token = step as u64 + 10;
        let r = generate(&mut rng, listen, step, &uploads);
        // Now and then none, or one older than the scope's last by some steps.
        let sent_token = match rng.below(8) {
            0 => None,
            1 => Some(token.saturating_sub(5 + rng.below(40)).max(1).to_string()),
            _ => Some(token.to_string()),
        };
        // A bucket a DeleteBucket removed is there again (not counted: a directory
        // made is no change).
        for b in FENCED.iter().chain([&PUBLIC]) {
            std::fs::create_dir_all(h.s3.root().join(b)).expect("mkdir");
        }
        let before = snapshot(h.s3.root());
        let (resp, line) = h.send(&r, sent_token.as_deref()).await;
        let after = snapshot(h.s3.root());
        if r.target.contains("?uploads") && resp.status == 200 {
            let answer = (
                element(&resp.body, "UploadId"),
                element(&resp.body, "Bucket"),
                element(&resp.body, "Key"),
            );
            if let (Some(id), Some(b), Some(k)) = answer {
                uploads.ids.push(id.clone());
                uploads.of.insert(id, (b, k));
            }
        }
        if r.target.contains("partNumber=1") && resp.status == 200 {
            let id = r.target.rsplit('=').next().unwrap_or_default().to_string();
            if let Some(etag) = resp.headers.get("etag").and_then(|v| v.to_str().ok()) {
                uploads.etags.insert(id, etag.to_string());
            }
        }
        let result = line
            .as_ref()
            .and_then(|l| l["result"].as_str())
            .unwrap_or("");
        let scope = line.as_ref().and_then(|l| l["scope"].as_str());
        let decided_token = line.as_ref().and_then(|l| l["token"].as_str());
        let extra: Vec<String> = r.headers.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        history.push(format!(
            "{step}: {} {} Host: {} token={sent_token:?} {extra:?} body={:?} -> {} {result} scope={scope:?}",
            r.method,
            r.target,
            r.host,
            if r.form {
                // The key's part; the signed fields after it change with the clock.
                let end = r.body[2..].find("--").map_or(r.body.len(), |e| e + 2);
                format!("{}(signed fields, file)", &r.body[..end])
            } else {
                r.body.clone()
            },
            resp.status
        ));
        if result == "accepted" {
            accepted += 1;
        }
        *tally.entry(result.to_string()).or_default() += 1;
        let objects = changed(&before, &after);
        changes += objects.len();
        for object in objects {
            let Some(own) = own_scope(&object, &uploads.of) else {
                continue;
            };
            let ok = result == "accepted"
                && scope == Some(own.as_str())
                && decided_token.is_some()
                && decided_token == sent_token.as_deref();
            assert!(
                ok,
                "s3s-fs: a bypass at step {step}: {} (scope {own}) changed by a request decided as {result:?} on {scope:?}\nrequests (seed {seed}):\n{}\nanswer: {}",
                object.join("/"),
                history.join("\n"),
                resp.body
            );
        }
    }
    eprintln!("s3s-fs: {steps} requests, {changes} files changed, decisions {tally:?}");
    if std::env::var("ORACLE_TRACE").is_ok() {
        eprintln!("{}", history.join("\n"));
    }
    // The run must have exercised the fence, not only its refusals.
    assert!(
        accepted >= steps / 10,
        "s3s-fs: only {accepted} of {steps} accepted"
    );
    h.proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_object_s3s_fs_changes_was_decided_in_its_scope() {
    run(seed() ^ 3, steps(1000)).await;
}

/// A request with no headers of its own.
fn request(method: &'static str, target: String, host: &str, body: &str) -> Request {
    Request {
        method,
        target,
        host: host.to_string(),
        headers: Vec::new(),
        body: body.to_string(),
        form: false,
    }
}

/// A finding of this oracle, fixed: the form's key was read as multer's text, decoded by
/// the charset its part names, a byte order mark dropped; s3s takes the field's bytes as
/// they are. So `d/${filename}` sent as UTF-16 was decided on a scope of CJK characters
/// (a fresh one, which takes any token) and written as `d/${filename}`, and `\u{feff}é`
/// was decided as `é`. Both are refused now (400 `MalformedPOSTRequest`), nothing
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_form_key_is_read_as_its_bytes() {
    let mut h = Harness::start().await;
    let endpoint = format!("s3.test:{}", h.listen);
    for (key, part) in [
        (
            "d/${filename}",
            "\r\nContent-Type: text/plain; charset=utf-16le",
        ),
        ("\u{feff}\u{e9}", ""),
    ] {
        let mut body = format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"key\"{part}\r\n\r\n{key}\r\n"
        );
        for (name, value) in sigv4::form_fields(CREDENTIALS, "bkt") {
            body.push_str(&format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            ));
        }
        body.push_str(&format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nx\r\n--{BOUNDARY}--\r\n"
        ));
        let mut form = request("POST", "/bkt".into(), &endpoint, &body);
        form.form = true;
        form.headers.push((
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        ));
        let before = snapshot(h.s3.root());
        let (answer, line) = h.send(&form, Some("7")).await;
        assert_eq!(answer.status, 400, "{key:?}{part}: {}", answer.body);
        assert!(
            answer.body.contains("<Code>MalformedPOSTRequest</Code>"),
            "{}",
            answer.body
        );
        let result = line.as_ref().and_then(|l| l["result"].as_str());
        assert_ne!(result, Some("accepted"), "{line:?}");
        assert_eq!(
            changed(&before, &snapshot(h.s3.root())),
            Vec::<Vec<String>>::new()
        );
    }
    h.proxy.shutdown().await;
}

/// A finding of this oracle, fixed: a DELETE on the bucket with a query naming no
/// sub-resource (`?versionId=1`, `?delete`) was fenced as a request on the bucket's
/// settings; s3s reads it as a DeleteBucket, and s3s-fs removes the objects with the
/// bucket. It is a DeleteBucket to the fence now: refused while an object holds a mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_on_the_bucket_with_a_query_is_a_delete_bucket() {
    let mut h = Harness::start().await;
    let endpoint = format!("s3.test:{}", h.listen);
    let put = request("PUT", "/bkt/a".into(), &endpoint, "kept");
    let (written, _) = h.send(&put, Some("5")).await;
    assert_eq!(written.status, 200, "{}", written.body);
    for target in ["/bkt?versionId=1", "/bkt?delete", "/bkt?Tagging"] {
        let before = snapshot(h.s3.root());
        let (answer, line) = h
            .send(&request("DELETE", target.into(), &endpoint, ""), Some("9"))
            .await;
        assert_eq!(answer.status, 400, "{target}: {}", answer.body);
        let result = line.as_ref().and_then(|l| l["result"].as_str());
        assert_eq!(result, Some("multi_scope"), "{target}: {line:?}");
        assert_eq!(
            changed(&before, &snapshot(h.s3.root())),
            Vec::<Vec<String>>::new(),
            "{target}"
        );
    }
    h.proxy.shutdown().await;
}

/// A finding of this oracle: s3s-fs keeps multipart uploads by id alone, for any bucket
/// and Host, so a part, a completion or an abort sent through the public bucket's
/// pass-through route reached the upload of a fenced object with no decision. An
/// unfenced request naming an upload id on an upstream an S3 route fences is now
/// refused `multi_scope` when a fenced scope recorded that id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_through_the_public_host_cannot_join_a_fenced_upload() {
    let mut h = Harness::start().await;
    let endpoint = format!("s3.test:{}", h.listen);
    let create = request("POST", "/bkt/a?uploads".into(), &endpoint, "");
    let (created, _) = h.send(&create, Some("5")).await;
    assert_eq!(created.status, 200, "{}", created.body);
    let id = element(&created.body, "UploadId").expect("an upload id");
    let before = snapshot(h.s3.root());
    let part = request(
        "PUT",
        format!("/a?partNumber=1&uploadId={id}"),
        PUBLIC,
        "intruder",
    );
    let (answer, _) = h.send(&part, None).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(answer.body.contains("multi_scope"), "{}", answer.body);
    let after = snapshot(h.s3.root());
    assert_eq!(
        changed(&before, &after),
        Vec::<Vec<String>>::new(),
        "the public host put a part into the upload of bkt/a: {} {}",
        answer.status,
        answer.body
    );
    h.proxy.shutdown().await;
}

#[test]
fn files_of_s3s_fs_belong_to_their_objects() {
    let rel = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
    let mut uploads = HashMap::new();
    uploads.insert("u1".to_string(), ("bkt".to_string(), "d//a".to_string()));
    uploads.insert("u2".to_string(), (PUBLIC.to_string(), "a".to_string()));
    for (file, scope) in [
        ("bkt/d/a", Some("object/bkt/d/a")),
        ("bkt", Some("bucket/bkt")),
        ("public.test/a", None),
        // base64url of "bkt" and "d/a"
        (
            ".bucket-Ymt0.object-ZC9h.metadata.json",
            Some("object/bkt/d/a"),
        ),
        (
            ".bucket-Ymt0.object-ZC9h.internal.json",
            Some("object/bkt/d/a"),
        ),
        (".upload_id-u1.part-1", Some("object/bkt/d/a")),
        (".upload-u1.json", Some("object/bkt/d/a")),
        (".upload-u2.json", None),
        (".upload-u3.json", Some("(the unknown upload u3)")),
        (".tmp.1.internal.part", None),
    ] {
        assert_eq!(own_scope(&rel(file), &uploads).as_deref(), scope, "{file}");
    }
}
