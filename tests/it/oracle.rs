//! The object-identity oracle: what fencegate decides on must be what the backend changes.
//! Random WebDAV requests (paths in several spellings, `Destination` values, collections,
//! `Depth`, `Overwrite`, odd methods), each with a token (now and then a stale one, or
//! none), go through fencegate to real servers: nginx's WebDAV module and wsgidav. After
//! each, the server's tree is read again. Every object the request changed (a file
//! written, removed or replaced, a collection removed) whose own scope is fenced must be
//! one whose scope fencegate decided for that request, with that token, and accepted (the
//! access log's line says what it decided). An object changed under a scope that was not
//! decided is a bypass: the test fails with the requests that led there.
//!
//! Directories a server makes on its own (nginx's `create_full_put_path`) are not counted:
//! they hold nothing until a fenced write fills them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use crate::support::oracle::{changed, next_line, seed, snapshot, steps};
use crate::support::{self, Client, Rng, nginx::Nginx};
use crate::webdav::WsgiDav;

/// The routes under test: one scope per file, one per tree (and the tree's top), and a
/// pass-through catch-all over the same server, the set-up where a bypass would hide.
fn config(upstream: SocketAddr) -> String {
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
[log]
access = "access.log"
[[upstream]]
name = "dav"
url = "http://{upstream}"
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
name = "tops"
path = "/trees/{{top}}"
scope = "tree/{{top}}"
upstream = "dav"
[[route]]
name = "rest"
path = "/{{*rest}}"
upstream = "dav"
fenced = false
"#
    )
}

/// An object's own scope, from where it lies in the server's tree (decoded names, as the
/// server stores them); `None` for the pass-through area.
fn own_scope(rel: &[String]) -> Option<String> {
    match rel {
        [top, rest @ ..] if top == "files" && !rest.is_empty() => {
            Some(format!("file/{}", rest.join("/")))
        }
        [top, tree, ..] if top == "trees" => Some(format!("tree/{tree}")),
        _ => None,
    }
}

/// A path from a few names, spelled as a client might: escapes in either case, a trailing
/// slash, now and then a doubled slash, a dot segment or an escaped slash (which the
/// fence refuses).
fn spell(rng: &mut Rng, segments: &[&str], slash: u64) -> String {
    let mut out = String::new();
    for s in segments {
        out.push('/');
        if rng.chance(20) {
            out.push_str(rng.pick(&["/", "./", "%2F", "%2e/"]));
        }
        for c in s.chars() {
            if rng.chance(6) {
                let hex = format!("%{:02X}", c as u32);
                out.push_str(&if rng.chance(2) {
                    hex.to_lowercase()
                } else {
                    hex
                });
            } else {
                out.push(c);
            }
        }
    }
    if out.is_empty() || rng.chance(slash) {
        out.push('/');
    }
    out
}

/// A path somewhere in the server's tree, with a trailing slash one time in `slash`. Few
/// names, so that requests meet: a file written, then its collection deleted or moved.
fn some_path(rng: &mut Rng, slash: u64) -> String {
    let names = ["a", "b", "c"];
    let mut segs: Vec<&str> = Vec::new();
    match rng.below(6) {
        0..=2 => segs.push("files"),
        3 | 4 => {
            segs.push("trees");
            if !rng.chance(5) {
                segs.push(rng.pick(&["t1", "t2"]));
            }
        }
        _ => {
            if !rng.chance(3) {
                segs.push("other");
            }
        }
    }
    for _ in 0..rng.below(3) + u64::from(segs.first() == Some(&"files")) {
        segs.push(rng.pick(&names));
    }
    spell(rng, &segs, slash)
}

/// Runs `steps` random requests against the server at `upstream` whose tree is `root`.
async fn run(server: &str, upstream: SocketAddr, root: &Path, seed: u64, steps: usize) {
    // The collections the routes serve, there from the start (as a deployment has them).
    for d in ["files", "trees/t1", "trees/t2", "other"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    let dir = tempfile::tempdir().expect("dir");
    let proxy = support::start_text(&config(upstream), dir.path()).await;
    let client = Client::new(proxy.proxy_addr);
    let log = dir.path().join("access.log");
    let mut seen = 0;
    let mut rng = Rng(seed);
    let mut history = Vec::new();
    let mut accepted = 0;
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let mut changes = 0;
    for step in 1..=steps {
        let token = step as u64 + 10;
        let method = rng.pick(&[
            "PUT", "PUT", "PUT", "MKCOL", "DELETE", "DELETE", "COPY", "COPY", "MOVE", "MOVE",
            "delete", "BDELETE",
        ]);
        let path = some_path(&mut rng, if method == "PUT" { 12 } else { 3 });
        let mut headers: Vec<(&str, String)> = Vec::new();
        match rng.below(8) {
            0 => {}
            1 => headers.push(("fencing-token", (token - 5).to_string())),
            _ => headers.push(("fencing-token", token.to_string())),
        }
        if matches!(method, "COPY" | "MOVE") {
            let target = some_path(&mut rng, 3);
            let dest = match rng.below(6) {
                0 => format!("http://{}{target}", proxy.proxy_addr),
                1 => format!("{target}#x"),
                _ => target,
            };
            headers.push(("destination", dest));
            headers.push(("overwrite", rng.pick(&["T", "F"]).to_string()));
        }
        if rng.chance(3) {
            headers.push(("depth", rng.pick(&["0", "1", "infinity"]).to_string()));
        }
        // Only a PUT has a body: servers refuse one on a DELETE, MKCOL, COPY or MOVE.
        let body = if method == "PUT" {
            format!("{server} step {step}")
        } else {
            String::new()
        };
        let before = snapshot(root);
        let sent: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let resp = client.send(method, &path, &sent, &body).await;
        let line = next_line(&log, &mut seen).await;
        let after = snapshot(root);
        let result = line
            .as_ref()
            .and_then(|l| l["result"].as_str())
            .unwrap_or("");
        let scope = line.as_ref().and_then(|l| l["scope"].as_str());
        let decided_token = line.as_ref().and_then(|l| l["token"].as_str());
        history.push(format!(
            "{method} {path} {headers:?} -> {} {result} scope={scope:?}",
            resp.status
        ));
        if result == "accepted" {
            accepted += 1;
        }
        *tally.entry(result.to_string()).or_default() += 1;
        let objects = changed(&before, &after);
        changes += objects.len();
        for object in objects {
            let Some(own) = own_scope(&object) else {
                continue;
            };
            let sent_token = headers
                .iter()
                .find(|(k, _)| *k == "fencing-token")
                .map(|(_, v)| v.as_str());
            let ok = result == "accepted"
                && scope == Some(own.as_str())
                && decided_token.is_some()
                && decided_token == sent_token;
            assert!(
                ok,
                "{server}: a bypass: {} (scope {own}) changed by a request decided as {result} on {scope:?}\nrequests (seed {seed}):\n{}",
                object.join("/"),
                history.join("\n")
            );
        }
    }
    eprintln!("{server}: {steps} requests, {changes} objects changed, decisions {tally:?}");
    if std::env::var("ORACLE_TRACE").is_ok() {
        eprintln!("{}", history.join("\n"));
    }
    // The run must have exercised the fence, not only its refusals.
    assert!(
        accepted >= steps / 10,
        "{server}: only {accepted} of {steps} accepted"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_object_nginx_changes_was_decided_in_its_scope() {
    let dav = Nginx::webdav().expect("nginx with WebDAV (run scripts/test.sh)");
    run("nginx", dav.addr(), dav.root(), seed(), steps(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_object_wsgidav_changes_was_decided_in_its_scope() {
    let dav = WsgiDav::start();
    run("wsgidav", dav.addr, dav.root.path(), seed() ^ 1, steps(300)).await;
}
