//! WebDAV's `Destination` read as the backend reads it (SPEC §16), against real nginx
//! WebDAV behind fencegate: a destination that a server could read as another path than
//! the fence routed (a raw `#`, which `http::Uri` drops and nginx keeps; a query; an
//! escaped `#`, `?` or `;`) is refused, and the fenced file it named stays as it was.

use crate::support::{self, Client, nginx::Nginx};

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
