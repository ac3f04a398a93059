//! WebDAV's `Destination` read as the backend reads it (SPEC §16), against real nginx
//! WebDAV behind fencegate: a destination that a server could read as another path than
//! the fence routed (a raw `#`, which `http::Uri` drops and nginx keeps; a query; an
//! escaped `#`, `?` or `;`) is refused, and the fenced file it named stays as it was.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::s3::tool;
use crate::support::{self, Client, nginx::Nginx};

/// A wsgidav process (pip, in the virtualenv `target/dav-venv` that `scripts/test.sh`
/// makes) serving a temporary root on loopback, anonymous, with its default filesystem
/// provider and lock manager; killed on drop.
pub(super) struct WsgiDav {
    child: Child,
    pub(super) addr: SocketAddr,
    pub(super) root: tempfile::TempDir,
}

impl WsgiDav {
    pub(super) fn start() -> WsgiDav {
        let bin = tool("dav-venv/bin/wsgidav", "wsgidav");
        let root = tempfile::tempdir().expect("wsgidav root");
        let port = support::free_port();
        let child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--auth", "anonymous", "--no-config", "-q"])
            .arg("--root")
            .arg(root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn wsgidav");
        let mut server = WsgiDav {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            root,
        };
        let deadline = Instant::now() + support::BOUND;
        while std::net::TcpStream::connect(server.addr).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("wsgidav exited before listening: {status}");
            }
            assert!(Instant::now() < deadline, "wsgidav did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }
}

impl Drop for WsgiDav {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_nginx_reads_another_way_is_refused() {
    let dav = Nginx::webdav().expect("nginx with WebDAV");
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
name = "dav"
url = "http://{}"
[[route]]
name = "static"
path = "/static/{{*file}}"
upstream = "dav"
fenced = false
[[route]]
name = "files"
api = "plain"
path = "/files/{{*path}}"
scope = "file/{{path}}"
upstream = "dav"
"#,
        dav.addr()
    );
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let put = |path: &'static str, token: Option<&'static str>, body: &'static str| {
        let c = &c;
        async move {
            let mut headers = vec![];
            if let Some(t) = token {
                headers.push(("fencing-token", t));
            }
            c.send("PUT", path, &headers, body).await
        }
    };
    // B holds q3#summary at token 6; A holds q3 (another scope) at token 5.
    assert_eq!(
        put("/files/q3%23summary", Some("6"), "six").await.status,
        201
    );
    assert_eq!(put("/files/q3", Some("5"), "five").await.status, 201);
    assert_eq!(put("/static/x", None, "static").await.status, 201);
    for (source, token, dest) in [
        ("/files/q3", Some("5"), "/files/q3#summary"),
        ("/files/q3", Some("5"), "/files/q3#/../q3%23summary"),
        ("/static/x", None, "/static/x#/../../files/q3%23summary"),
        ("/files/q3", Some("5"), "/files/q3%23summary?x"),
        ("/files/q3", Some("5"), "/files/q3%3Fsummary"),
        ("/files/q3", Some("5"), "/files/q3%3Bsummary"),
    ] {
        let mut headers = vec![("destination", dest), ("overwrite", "T")];
        if let Some(t) = token {
            headers.push(("fencing-token", t));
        }
        let resp = c.send("COPY", source, &headers, "").await;
        assert_eq!(resp.status, 400, "COPY {source} -> {dest}: {resp:?}");
        assert_eq!(resp.result(), "invalid_request", "{dest}");
    }
    let on_disk = std::fs::read(dav.root().join("files/q3#summary")).expect("the fenced file");
    assert_eq!(on_disk, b"six", "the fenced file is intact");
    // Within a pass-through route, and within one scope, COPY goes through.
    let ok = c
        .send("COPY", "/static/x", &[("destination", "/static/y")], "")
        .await;
    assert!(matches!(ok.status, 201 | 204), "{ok:?}");
    assert_eq!(
        std::fs::read(dav.root().join("static/y")).expect("copied"),
        b"static"
    );
    let ok = c
        .send(
            "COPY",
            "/files/q3",
            &[("destination", "/files/q3"), ("fencing-token", "5")],
            "",
        )
        .await;
    // (nginx answers a copy onto itself 500; what matters is that it was forwarded.)
    assert_eq!(ok.result(), "accepted", "{ok:?}");
}

/// The routes of the collection tests: one scope per file (`files`), and one scope per
/// top-level tree (`trees`), both `api = "webdav"`, to `url`.
fn collection_routes(url: &str) -> String {
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
name = "dav"
url = "{url}"
[[route]]
name = "files"
api = "webdav"
path = "/files/{{*path}}"
scope = "file/{{path}}"
upstream = "dav"
[[route]]
name = "trees"
api = "webdav"
path = "/trees/{{top}}/{{*rest}}"
scope = "tree/{{top}}"
upstream = "dav"
"#
    )
}

/// What each WebDAV server under test must show (SPEC §16): with one scope per file, a
/// DELETE, MOVE or COPY of a collection whose member is fenced under its own scope is
/// refused 409 `multi_scope` whatever its token or spelling, and the member stays; a
/// collection with no fenced member, and every collection operation within one scope
/// (one scope per tree), passes with the current token. `on_disk(path)` reads a file of
/// the server's root; the root holds the directories `files` and `trees/a`.
async fn collections_are_fenced_with_their_members(
    c: &Client,
    on_disk: &dyn Fn(&str) -> Option<Vec<u8>>,
) {
    let send = |method: &'static str, path: &'static str, headers: &'static [(&str, &str)]| {
        c.send(method, path, headers, "")
    };
    // B holds q4/final at token 6.
    let made = send("MKCOL", "/files/q4/", &[("fencing-token", "1")]).await;
    assert_eq!(made.status, 201, "{made:?}");
    let put = c
        .send("PUT", "/files/q4/final", &[("fencing-token", "6")], "six")
        .await;
    assert!(matches!(put.status, 201 | 204), "{put:?}");
    // A, with token 5: its DELETE of the file is stale, and the collection is a new scope.
    let stale = send("DELETE", "/files/q4/final", &[("fencing-token", "5")]).await;
    assert_eq!(
        (stale.status, stale.result()),
        (409, "stale_fence"),
        "{stale:?}"
    );
    for (method, path, headers) in [
        ("DELETE", "/files/q4/", &[("fencing-token", "5")][..]),
        ("DELETE", "/files/q4", &[("fencing-token", "5")]),
        ("DELETE", "/files/q4/", &[("fencing-token", "6")]),
        ("DELETE", "/files/q%34/", &[("fencing-token", "5")]),
        ("delete", "/files/q4/", &[("fencing-token", "5")]),
        ("BDELETE", "/files/q4/", &[("fencing-token", "5")]),
        (
            "DELETE",
            "/files/q4/",
            &[("fencing-token", "5"), ("depth", "0")],
        ),
        (
            "MOVE",
            "/files/q4/",
            &[("fencing-token", "5"), ("destination", "/files/q4")],
        ),
        (
            "COPY",
            "/files/q4",
            &[
                ("fencing-token", "5"),
                ("destination", "/files/q4/"),
                ("overwrite", "T"),
            ],
        ),
        (
            "COPY",
            "/files/q4",
            &[
                ("fencing-token", "5"),
                ("destination", "/files/q4/"),
                ("overwrite", "F"),
            ],
        ),
    ] {
        let resp = c.send(method, path, headers, "").await;
        assert_eq!(
            (resp.status, resp.result()),
            (409, "multi_scope"),
            "{method} {path} {headers:?}: {resp:?}"
        );
        assert!(resp.body.contains("file/q4/final"), "{}", resp.body);
    }
    // Onto the collection from another scope: refused by the one-scope rule.
    let made = send("MKCOL", "/files/q3/", &[("fencing-token", "1")]).await;
    assert_eq!(made.status, 201, "{made:?}");
    for method in ["MOVE", "COPY"] {
        let resp = c
            .send(
                method,
                "/files/q3/",
                &[
                    ("fencing-token", "1"),
                    ("destination", "/files/q4/"),
                    ("overwrite", "T"),
                ],
                "",
            )
            .await;
        assert_eq!(resp.status, 400, "{method}: {resp:?}");
        assert_eq!(resp.result(), "multi_scope", "{method}");
    }
    assert_eq!(
        on_disk("files/q4/final").as_deref(),
        Some(&b"six"[..]),
        "the fenced file is intact"
    );
    // A collection none of whose members is fenced apart is one scope's: it goes.
    let gone = send("DELETE", "/files/q3/", &[("fencing-token", "1")]).await;
    assert_eq!(gone.result(), "accepted", "{gone:?}");
    assert!(matches!(gone.status, 200 | 204), "{gone:?}");
    // One scope per tree: the same operations pass with the current token.
    let made = send("MKCOL", "/trees/a/x/", &[("fencing-token", "3")]).await;
    assert_eq!(made.status, 201, "{made:?}");
    let put = c
        .send("PUT", "/trees/a/x/y", &[("fencing-token", "3")], "why")
        .await;
    assert!(matches!(put.status, 201 | 204), "{put:?}");
    for (method, path, dest) in [
        ("COPY", "/trees/a/x/", "/trees/a/z/"),
        ("MOVE", "/trees/a/z/", "/trees/a/w/"),
    ] {
        let resp = c
            .send(
                method,
                path,
                &[("fencing-token", "3"), ("destination", dest)],
                "",
            )
            .await;
        assert_eq!(resp.result(), "accepted", "{method}: {resp:?}");
        assert!(matches!(resp.status, 201 | 204), "{method}: {resp:?}");
    }
    assert_eq!(on_disk("trees/a/w/y").as_deref(), Some(&b"why"[..]));
    let gone = send("DELETE", "/trees/a/x/", &[("fencing-token", "3")]).await;
    assert!(matches!(gone.status, 200 | 204), "{gone:?}");
    assert_eq!(on_disk("trees/a/x/y"), None, "deleted with its collection");
    let stale = send("DELETE", "/trees/a/w/", &[("fencing-token", "2")]).await;
    assert_eq!(stale.result(), "stale_fence", "{stale:?}");
    assert_eq!(on_disk("trees/a/w/y").as_deref(), Some(&b"why"[..]));
    // Scopes are case-sensitive: so must the server be (it is, on a Linux filesystem).
    for (path, body) in [("/files/Case", "upper"), ("/files/case", "lower")] {
        let put = c.send("PUT", path, &[("fencing-token", "1")], body).await;
        assert!(matches!(put.status, 201 | 204), "{path}: {put:?}");
    }
    assert_eq!(on_disk("files/Case").as_deref(), Some(&b"upper"[..]));
    assert_eq!(on_disk("files/case").as_deref(), Some(&b"lower"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_collections_are_fenced_with_their_members() {
    let dav = Nginx::webdav().expect("nginx with WebDAV");
    let dir = tempfile::tempdir().expect("dir");
    let text = collection_routes(&format!("http://{}", dav.addr()));
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let root = dav.root().to_path_buf();
    for d in ["files", "trees/a"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    collections_are_fenced_with_their_members(&c, &|p| std::fs::read(root.join(p)).ok()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wsgidav_collections_are_fenced_with_their_members() {
    let dav = WsgiDav::start();
    let dir = tempfile::tempdir().expect("dir");
    let text = collection_routes(&format!("http://{}", dav.addr));
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let root = dav.root.path().to_path_buf();
    for d in ["files", "trees/a"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    collections_are_fenced_with_their_members(&c, &|p| std::fs::read(root.join(p)).ok()).await;
}

/// litmus's suites, each run against a fresh base collection of its own (a suite ends by
/// deleting its `litmus/` collection, which a route with one scope per file refuses once
/// a member was fenced, and the next suite begins by creating it).
const LITMUS_SUITES: [&str; 5] = ["basic", "copymove", "props", "locks", "http"];

/// Where litmus through an `api = "webdav"` route with one scope per file (each request
/// with token 1) differs from litmus straight to the server: (server, suite, test, why).
/// A test that fails through the fence and passes directly, or the other way round, must
/// be here, and everything here must differ.
const LITMUS_DIFFERENCES: [(&str, &str, &str, &str); 10] = [
    ("wsgidav", "copymove", "copy_simple", CROSS_SCOPE),
    ("wsgidav", "copymove", "copy_overwrite", CROSS_SCOPE),
    ("wsgidav", "copymove", "copy_coll", CROSS_SCOPE),
    ("wsgidav", "copymove", "copy_shallow", COLLECTION_KEPT),
    ("wsgidav", "copymove", "move", CROSS_SCOPE),
    ("wsgidav", "copymove", "move_coll", CROSS_SCOPE),
    ("wsgidav", "locks", "copy", CROSS_SCOPE),
    ("nginx", "copymove", "copy_simple", CROSS_SCOPE),
    ("nginx", "copymove", "copy_coll", CROSS_SCOPE),
    ("nginx", "copymove", "copy_shallow", COLLECTION_KEPT),
];
const CROSS_SCOPE: &str =
    "a COPY or MOVE to another name is another scope with one scope per file: 400 multi_scope";
const COLLECTION_KEPT: &str = "its MKCOL finds the collection copy_coll left: that test's DELETE of it was refused 409 multi_scope (a member was fenced apart)";

/// The names of the tests litmus reports as failed in `out`. A test's line is
/// `  7. copy_coll.............  7. copy_coll............. FAIL (...)`; after a warning its
/// FAIL may come on a line of its own (`    ...... FAIL (...)`), which is the last
/// named test's.
fn litmus_failures(out: &str) -> std::collections::BTreeSet<String> {
    let mut failed = std::collections::BTreeSet::new();
    let mut current: Option<String> = None;
    for line in out.lines() {
        let at = line.find(" FAIL");
        let words: Vec<&str> = line[..at.unwrap_or(line.len())]
            .split_whitespace()
            .collect();
        let numbered = |w: &&str| {
            w.len() > 1 && w.ends_with('.') && w[..w.len() - 1].bytes().all(|b| b.is_ascii_digit())
        };
        if let Some(i) = words.iter().rposition(numbered)
            && let Some(name) = words.get(i + 1)
        {
            current = Some(name.trim_end_matches('.').to_string());
        }
        if at.is_some()
            && let Some(name) = &current
        {
            failed.insert(name.clone());
        }
    }
    failed
}

/// Runs litmus's `suite` against `url` (bounded by coreutils `timeout`); what it printed.
/// litmus writes `debug.log` and `child.log` where it runs: in a directory of its own.
async fn litmus(url: String, suite: &'static str) -> String {
    tokio::task::spawn_blocking(move || {
        let here = tempfile::tempdir().expect("litmus's directory");
        let out = Command::new("timeout")
            .args(["120", "litmus", &url])
            .current_dir(here.path())
            .env("TESTS", suite)
            .stdin(Stdio::null())
            .output()
            .expect("litmus (apt-get install litmus; scripts/test.sh installs it)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            text.contains(&format!("summary for `{suite}'")),
            "litmus {suite} at {url} did not finish: {text}"
        );
        text
    })
    .await
    .expect("litmus task")
}

/// litmus straight to `server` at `backend`, and through fencegate's `api = "webdav"`
/// route with one scope per file (token 1 on every request, added by an nginx in front,
/// as litmus cannot add a header): every difference is listed, with its reason, in
/// [`LITMUS_DIFFERENCES`]. `root` is the server's document root.
async fn litmus_differs_only_where_listed(
    server: &str,
    backend: SocketAddr,
    root: &std::path::Path,
) {
    let dir = tempfile::tempdir().expect("dir");
    let text = collection_routes(&format!("http://{backend}"));
    let proxy = support::start_text(&text, dir.path()).await;
    let front = Nginx::token_front(proxy.proxy_addr.port(), 1).expect("nginx in front");
    let mut found = Vec::new();
    for suite in LITMUS_SUITES {
        let (direct, fenced) = (format!("{suite}-direct"), format!("{suite}-fenced"));
        for d in [&direct, &fenced] {
            std::fs::create_dir_all(root.join("files").join(d)).expect("base collection");
        }
        let direct = litmus(format!("http://{backend}/files/{direct}/"), suite).await;
        let fenced = litmus(format!("http://{}/files/{fenced}/", front.addr()), suite).await;
        let (direct, fenced) = (litmus_failures(&direct), litmus_failures(&fenced));
        for test in direct.symmetric_difference(&fenced) {
            found.push((suite.to_string(), test.clone()));
        }
    }
    let mut want: Vec<(String, String)> = LITMUS_DIFFERENCES
        .iter()
        .filter(|(s, ..)| *s == server)
        .map(|(_, suite, test, _)| (suite.to_string(), test.to_string()))
        .collect();
    found.sort();
    want.sort();
    assert_eq!(
        found, want,
        "{server}: litmus through the fence vs directly"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn litmus_through_a_webdav_route_to_wsgidav() {
    let dav = WsgiDav::start();
    let root = dav.root.path().to_path_buf();
    litmus_differs_only_where_listed("wsgidav", dav.addr, &root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn litmus_through_a_webdav_route_to_nginx() {
    let dav = Nginx::webdav().expect("nginx with WebDAV");
    let root = dav.root().to_path_buf();
    litmus_differs_only_where_listed("nginx", dav.addr(), &root).await;
}

/// rclone through an `api = "webdav"` route with one scope per file, token 1 on every
/// request (`--header`), to wsgidav: sync, check and a move from local files are correct;
/// what would cross scopes is refused and changes nothing: a server-side move to another
/// name (400 `multi_scope`), a purge of a directory (409 `multi_scope`), and the
/// removal of a directory whose files a sync deleted (409 `multi_scope`, which rclone logs
/// at debug level: the empty directory stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rclone_through_a_webdav_route() {
    let dav = WsgiDav::start();
    let root = dav.root.path().to_path_buf();
    std::fs::create_dir_all(root.join("files")).expect("files");
    let dir = tempfile::tempdir().expect("dir");
    let text = collection_routes(&format!("http://{}", dav.addr));
    let proxy = support::start_text(&text, dir.path()).await;
    let url = format!("http://{}", proxy.proxy_addr);
    let local = tempfile::tempdir().expect("local");
    let src = local.path().join("src");
    for (path, body) in [("a.txt", "a"), ("sub/b.txt", "b"), ("gone/c.txt", "c")] {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, body).expect("write");
    }
    let rclone = move |args: Vec<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let out = Command::new("timeout")
                .args(["60", "rclone", "--config", "/dev/null", "--retries", "1"])
                .args(["--webdav-url", &url, "--header", "Fencing-Token: 1"])
                .args(&args)
                .stdin(Stdio::null())
                .output()
                .expect("rclone (apt-get install rclone; scripts/test.sh installs it)");
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        })
    };
    let s = |p: &std::path::Path| p.display().to_string();
    let remote = ":webdav:/files/r".to_string();
    let (ok, err) = rclone(vec!["sync".into(), s(&src), remote.clone()])
        .await
        .expect("run");
    assert!(ok, "sync: {err}");
    assert_eq!(
        std::fs::read(root.join("files/r/sub/b.txt"))
            .ok()
            .as_deref(),
        Some(&b"b"[..])
    );
    let (ok, err) = rclone(vec!["check".into(), s(&src), remote.clone()])
        .await
        .expect("run");
    assert!(ok, "check: {err}");
    // A directory gone from the source: its file is deleted (its own scope), the
    // directory's DELETE is refused (a member was fenced apart), and the sync succeeds.
    std::fs::remove_dir_all(src.join("gone")).expect("rm");
    let (ok, err) = rclone(vec!["sync".into(), s(&src), remote.clone(), "-vv".into()])
        .await
        .expect("run");
    assert!(ok, "sync: {err}");
    assert!(err.contains("multi_scope"), "{err}");
    assert!(!root.join("files/r/gone/c.txt").exists());
    assert!(root.join("files/r/gone").is_dir(), "the directory stays");
    let (ok, err) = rclone(vec!["check".into(), s(&src), remote.clone()])
        .await
        .expect("run");
    assert!(ok, "check: {err}");
    // A server-side move to another name: another scope.
    let (ok, err) = rclone(vec![
        "moveto".into(),
        format!("{remote}/a.txt"),
        format!("{remote}/a2.txt"),
    ])
    .await
    .expect("run");
    assert!(!ok && err.contains("multi_scope"), "moveto: {err}");
    assert!(root.join("files/r/a.txt").is_file() && !root.join("files/r/a2.txt").exists());
    // A purge: one DELETE of the directory, whose file is fenced apart.
    let (ok, err) = rclone(vec!["purge".into(), format!("{remote}/sub")])
        .await
        .expect("run");
    assert!(!ok && err.contains("multi_scope"), "purge: {err}");
    assert_eq!(
        std::fs::read(root.join("files/r/sub/b.txt"))
            .ok()
            .as_deref(),
        Some(&b"b"[..])
    );
    // A move from local files: uploads (each its own scope), then local deletes.
    let up = local.path().join("up");
    std::fs::create_dir_all(&up).expect("mkdir");
    std::fs::write(up.join("m.txt"), "m").expect("write");
    let (ok, err) = rclone(vec!["move".into(), s(&up), format!("{remote}/up")])
        .await
        .expect("run");
    assert!(ok, "move: {err}");
    assert_eq!(
        std::fs::read(root.join("files/r/up/m.txt")).ok().as_deref(),
        Some(&b"m"[..])
    );
    assert!(!up.join("m.txt").exists());
}

/// A collection's DELETE and a new member's PUT at once (SPEC §16): while the DELETE is
/// at the backend, the PUT is refused 503 `draining` and not forwarded (the DELETE could
/// remove what it writes); its mark stays, so the collection's next DELETE is refused.
/// Another collection's member passes meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_member_waits_for_its_collections_delete() {
    let double = support::Double::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let text = collection_routes(&format!("http://{}", double.addr));
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let deleting = {
        let c = Client::new(proxy.proxy_addr);
        tokio::spawn(async move {
            c.send(
                "DELETE",
                "/files/q4/",
                &[("fencing-token", "1"), ("x-test-hold", "delete")],
                "",
            )
            .await
        })
    };
    double.arrived("delete").await;
    let put = c
        .send("PUT", "/files/q4/new", &[("fencing-token", "1")], "new")
        .await;
    assert_eq!((put.status, put.result()), (503, "draining"), "{put:?}");
    assert!(put.headers.contains_key("retry-after"), "{put:?}");
    let other = c
        .send("PUT", "/files/q5/new", &[("fencing-token", "1")], "new")
        .await;
    assert_eq!(other.result(), "accepted", "{other:?}");
    assert!(
        !double.seen().iter().any(|s| s.target == "/files/q4/new"),
        "the refused PUT was not forwarded"
    );
    double.release("delete");
    let deleted = deleting.await.expect("delete task");
    assert_eq!((deleted.status, deleted.result()), (200, "accepted"));
    let again = c
        .send("DELETE", "/files/q4/", &[("fencing-token", "1")], "")
        .await;
    assert_eq!(
        (again.status, again.result()),
        (409, "multi_scope"),
        "the refused PUT's mark stays: {again:?}"
    );
    let put = c
        .send("PUT", "/files/q4/new", &[("fencing-token", "1")], "new")
        .await;
    assert_eq!(put.result(), "accepted", "{put:?}");
}

/// A collection above a fenced WebDAV route's objects (`/files`, the parent of every
/// object of `/files/{*path}`; `/trees`, of every scope `tree/{top}`) is routed elsewhere
/// (here to a pass-through catch-all): a DELETE, MOVE or COPY of it, or a MOVE or COPY
/// onto it, would change fenced files beneath without their tokens. Each is refused
/// `multi_scope`, nothing is forwarded, and the fenced files stay (SPEC §16). A tree's
/// top collection (`/trees/a`) holds objects of one scope, `tree/a`: fenced on it, as
/// any of the tree's requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collection_above_a_fenced_tree_is_refused() {
    let dav = Nginx::webdav().expect("nginx with WebDAV");
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
name = "dav"
url = "http://{}"
[[route]]
name = "files"
api = "webdav"
path = "/files/{{*path}}"
scope = "file/{{path}}"
upstream = "dav"
[[route]]
name = "trees"
api = "webdav"
path = "/trees/{{top}}/{{*rest}}"
scope = "tree/{{top}}"
upstream = "dav"
[[route]]
name = "tree-tops"
path = "/trees/{{top}}"
scope = "tree/{{top}}"
upstream = "dav"
[[route]]
name = "rest"
path = "/{{*rest}}"
upstream = "dav"
fenced = false
"#,
        dav.addr()
    );
    let proxy = support::start_text(&text, dir.path()).await;
    let c = Client::new(proxy.proxy_addr);
    let put = c
        .send("PUT", "/files/q4/final", &[("fencing-token", "6")], "six")
        .await;
    assert_eq!(put.status, 201, "{put:?}");
    let put = c
        .send("PUT", "/trees/a/x", &[("fencing-token", "2")], "ex")
        .await;
    assert_eq!(put.status, 201, "{put:?}");
    std::fs::create_dir_all(dav.root().join("other/d")).expect("mkdir");
    for (method, path, dest) in [
        ("DELETE", "/files", None),
        ("DELETE", "/files/", None),
        ("delete", "/files/", None),
        ("BDELETE", "/files/", None),
        ("MOVE", "/files/", Some("/stolen/")),
        ("COPY", "/files", Some("/stolen/")),
        ("MOVE", "/other/d/", Some("/files/")),
        ("COPY", "/other/d/", Some("/files")),
        ("MOVE", "/other/d/", Some("/")),
        ("DELETE", "/trees", None),
        ("DELETE", "/trees/", None),
    ] {
        let mut headers = vec![("overwrite", "T")];
        if let Some(d) = dest {
            headers.push(("destination", d));
        }
        let resp = c.send(method, path, &headers, "").await;
        assert_eq!(
            (resp.status, resp.result()),
            (400, "multi_scope"),
            "{method} {path} -> {dest:?}: {resp:?}"
        );
    }
    assert_eq!(
        std::fs::read(dav.root().join("files/q4/final")).expect("the fenced file"),
        b"six"
    );
    assert_eq!(
        std::fs::read(dav.root().join("trees/a/x")).expect("the fenced tree's file"),
        b"ex"
    );
    // The tree's top collection is its one scope's (`tree/a`): a pass-through request
    // may not write it, a stale token is refused, and its own token deletes it.
    let resp = c
        .send(
            "MOVE",
            "/other/d/",
            &[("destination", "/trees/a"), ("overwrite", "T")],
            "",
        )
        .await;
    assert_eq!(
        (resp.status, resp.result()),
        (400, "invalid_request"),
        "{resp:?}"
    );
    let resp = c
        .send("DELETE", "/trees/a/", &[("fencing-token", "1")], "")
        .await;
    assert_eq!(
        (resp.status, resp.result()),
        (409, "stale_fence"),
        "{resp:?}"
    );
    assert!(dav.root().join("trees/a/x").is_file());
    let resp = c
        .send("DELETE", "/trees/a/", &[("fencing-token", "2")], "")
        .await;
    assert_eq!(resp.result(), "accepted", "{resp:?}");
    assert!(!dav.root().join("trees/a").exists());
    // What changes one resource there, and collections elsewhere, still pass.
    let ok = c.send("PROPFIND", "/files/", &[("depth", "0")], "").await;
    assert_ne!(ok.status, 400, "forwarded: {ok:?}");
    let ok = c.send("DELETE", "/other/d/", &[], "").await;
    assert!(matches!(ok.status, 200 | 204), "{ok:?}");
}
