//! Trust (SPEC §9) over real sockets: authority clients with bearer secrets and scope
//! patterns, the holder as the authenticated client, lease ids shown to their holder
//! only, and token proofs that a `proof = "required"` route checks.

use crate::support;

use std::path::Path;

use fencegate::app::Running;
use support::{Client, Double};

const MAX: &str = "18446744073709551615:18446744073709551615";

/// Writes the secrets and a key pair into `dir`; answers the config: a proxy with a
/// `signed` route (proof required) and a `plain` one (proof off), and an authority with
/// clients `a` and `b` (both may use `signed/*` and `plain/*`; `a` also `a-only`).
fn trust_config(dir: &Path, upstream: std::net::SocketAddr) -> String {
    crate::support::write_secret(dir.join("a.token"), "secret-of-a\n");
    crate::support::write_secret(dir.join("b.token"), "secret-of-b");
    fencegate::proof::keygen(&dir.join("fence")).expect("keygen");
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
proof_keys = ["fence.pub"]
[authority]
listen = "127.0.0.1:0"
max_ttl = "60s"
signing_key = "fence.key"
[[authority.client]]
name = "a"
token_file = "a.token"
scopes = ["signed/*", "plain/*", "a-only"]
[[authority.client]]
name = "b"
token_file = "b.token"
scopes = ["signed/*", "plain/*"]
[[upstream]]
name = "u"
url = "http://{upstream}"
[[route]]
name = "signed"
path = "/signed/{{k}}"
scope = "signed/{{k}}"
upstream = "u"
proof = "required"
[[route]]
name = "plain"
path = "/plain/{{k}}"
scope = "plain/{{k}}"
upstream = "u"
"#
    )
}

async fn start(dir: &Path) -> (Running, Double, Client, Client) {
    let upstream = Double::start().await;
    let config = fencegate::settings::Config::parse(&trust_config(dir, upstream.addr), dir)
        .unwrap_or_else(|e| panic!("config: {e}"));
    let running = support::start(config).await;
    let authority = Client::new(running.authority_addr.expect("authority"));
    let proxy = Client::new(running.proxy_addr);
    (running, upstream, authority, proxy)
}

const A: &str = "Bearer secret-of-a";
const B: &str = "Bearer secret-of-b";

async fn call(c: &Client, who: &str, path: &str, body: &str) -> support::Resp {
    c.send(
        "POST",
        path,
        &[("content-type", "application/json"), ("authorization", who)],
        body,
    )
    .await
}

async fn status(c: &Client, who: &str, scope: &str) -> serde_json::Value {
    let r = c
        .send(
            "GET",
            &format!("/v1/locks?scope={scope}"),
            &[("authorization", who)],
            "",
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// (lease_id, token, proof) of an acquisition that must succeed.
async fn acquire(c: &Client, who: &str, scope: &str) -> (String, String, String) {
    let r = call(
        c,
        who,
        "/v1/locks/acquire",
        &format!(r#"{{"scope":"{scope}","ttl_ms":30000}}"#),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    let s = |k: &str| j[k].as_str().unwrap_or_default().to_string();
    (s("lease_id"), s("token"), s("proof"))
}

fn lease_body(scope: &str, lease_id: &str, token: &str, renew: bool) -> String {
    let ttl = if renew { r#","ttl_ms":30000"# } else { "" };
    format!(r#"{{"scope":"{scope}","lease_id":"{lease_id}","token":"{token}"{ttl}}}"#)
}

/// The reproduction of SPEC §9's authority hole: B reads A's lease id from the status,
/// releases A's lease, takes the lock and writes; A, its lease still live, is fenced out.
/// Now B sees no lease id, and B's release and renew with A's (lease_id, token) are
/// `lost` with nothing changed: A still holds the lease, renews it and writes.
#[tokio::test]
async fn another_client_can_neither_see_nor_end_a_lease() {
    let dir = tempfile::tempdir().expect("dir");
    let (running, _upstream, authority, proxy) = start(dir.path()).await;
    let (lease_a, token_a, _) = acquire(&authority, A, "plain/x").await;

    let seen_by_b = status(&authority, B, "plain%2Fx").await;
    assert_eq!(seen_by_b["holder"], "a");
    assert_eq!(
        seen_by_b["lease_id"],
        serde_json::Value::Null,
        "{seen_by_b}"
    );
    assert_eq!(
        status(&authority, A, "plain%2Fx").await["lease_id"],
        lease_a
    );

    // B has A's lease id and token somehow (a log, a leak): they are not enough.
    for (path, renew) in [("/v1/locks/release", false), ("/v1/locks/renew", true)] {
        let r = call(
            &authority,
            B,
            path,
            &lease_body("plain/x", &lease_a, &token_a, renew),
        )
        .await;
        assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("lost")));
    }
    let r = call(
        &authority,
        B,
        "/v1/locks/acquire",
        r#"{"scope":"plain/x","ttl_ms":1000}"#,
    )
    .await;
    assert_eq!((r.status, r.json()["result"].as_str()), (409, Some("busy")));

    // A is untouched: its write passes, its renewal renews, and it releases.
    let r = proxy.put("/plain/x", &token_a, "by a").await;
    assert_eq!((r.status, r.result()), (200, "accepted"), "{}", r.body);
    let r = call(
        &authority,
        A,
        "/v1/locks/renew",
        &lease_body("plain/x", &lease_a, &token_a, true),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call(
        &authority,
        A,
        "/v1/locks/release",
        &lease_body("plain/x", &lease_a, &token_a, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    running.shutdown().await;
}

#[tokio::test]
async fn every_call_needs_a_client_and_stays_in_its_scopes() {
    let dir = tempfile::tempdir().expect("dir");
    let (running, _upstream, authority, _proxy) = start(dir.path()).await;
    let acquire_s = r#"{"scope":"plain/s","ttl_ms":1000}"#;
    for who in [
        None,
        Some("Bearer nope"),
        Some("Basic c2VjcmV0LW9mLWE="),
        Some("Bearer "),
    ] {
        let mut headers = vec![("content-type", "application/json")];
        headers.extend(who.map(|w| ("authorization", w)));
        let r = authority
            .send("POST", "/v1/locks/acquire", &headers, acquire_s)
            .await;
        assert_eq!(r.status, 401, "{who:?}: {}", r.body);
        assert_eq!(r.json()["result"], "unauthenticated");
        assert_eq!(r.headers["www-authenticate"], "Bearer");
        assert_eq!(r.headers["content-type"], "application/problem+json");
        let r = authority.get("/v1/locks?scope=plain%2Fs").await;
        assert_eq!(r.status, 401);
    }
    // Two Authorization headers are not a choice between them.
    let r = authority
        .send(
            "POST",
            "/v1/locks/acquire",
            &[("authorization", "Bearer nope"), ("authorization", A)],
            acquire_s,
        )
        .await;
    assert_eq!(r.status, 401);

    // Out of the client's patterns: 403, for every call.
    let r = call(
        &authority,
        B,
        "/v1/locks/acquire",
        r#"{"scope":"a-only","ttl_ms":1000}"#,
    )
    .await;
    assert_eq!(
        (r.status, r.json()["result"].as_str()),
        (403, Some("forbidden"))
    );
    let r = authority
        .send("GET", "/v1/locks?scope=a-only", &[("authorization", B)], "")
        .await;
    assert_eq!(r.status, 403);
    let r = call(
        &authority,
        B,
        "/v1/locks/release",
        &lease_body("a-only", "1", "1", false),
    )
    .await;
    assert_eq!(r.status, 403);
    // A prefix pattern is a prefix, not a path rule: `signed/` itself is not in it.
    let r = call(
        &authority,
        B,
        "/v1/locks/acquire",
        r#"{"scope":"signedx","ttl_ms":1000}"#,
    )
    .await;
    assert_eq!(r.status, 403);

    // The holder is the client: `holder` may be left out, and may not name another.
    let r = call(
        &authority,
        B,
        "/v1/locks/acquire",
        r#"{"scope":"plain/h","holder":"a","ttl_ms":1000}"#,
    )
    .await;
    assert_eq!(
        (r.status, r.json()["result"].as_str()),
        (403, Some("forbidden"))
    );
    let r = call(
        &authority,
        A,
        "/v1/locks/acquire",
        r#"{"scope":"a-only","holder":"a","ttl_ms":1000}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(status(&authority, A, "a-only").await["holder"], "a");
    running.shutdown().await;
}

/// The reproduction of SPEC §9's proxy hole: the largest token, on a fenced route without
/// proofs, is accepted and leaves the scope unusable for good. With `proof = "required"`
/// it is 403 `invalid_proof` and the mark stays as it was; the authority's proof passes.
#[tokio::test]
async fn a_forged_token_is_refused_where_proofs_are_required() {
    let dir = tempfile::tempdir().expect("dir");
    let (running, upstream, authority, proxy) = start(dir.path()).await;
    let marks = running.app.gates.store().clone();

    // proof = "off": today's behaviour, and the hole.
    let r = proxy.put("/plain/brick", MAX, "").await;
    assert_eq!((r.status, r.result()), (200, "accepted"));
    let (_, token, _) = acquire(&authority, A, "plain/brick").await;
    let r = proxy.put("/plain/brick", &token, "").await;
    assert_eq!((r.status, r.result()), (409, "stale_fence"));

    let (_, token, proof) = acquire(&authority, A, "signed/s").await;
    assert!(proof.starts_with("v1."), "{proof}");
    let forwarded = upstream.seen().len();
    let put = |path: &'static str, token: String, proof: Option<String>| {
        let proxy = proxy.clone();
        async move {
            let mut headers = vec![("fencing-token", token.as_str())];
            if let Some(p) = &proof {
                headers.push(("fencing-proof", p.as_str()));
            }
            proxy.send("PUT", path, &headers, "body").await
        }
    };
    let refused = |r: &support::Resp, token: &str| {
        assert_eq!((r.status, r.result()), (403, "invalid_proof"), "{}", r.body);
        let j = r.json();
        assert_eq!(j["result"], "invalid_proof");
        assert_eq!(j["status"], 403);
        assert_eq!(j["token"], token);
        assert_eq!(r.headers["content-type"], "application/problem+json");
    };
    // No proof, a made-up one, and the real proof with another token.
    let r = put("/signed/s", MAX.into(), None).await;
    refused(&r, MAX);
    assert_eq!(r.json()["scope"], "signed/s");
    let fake = format!("v1.{}.{}", "0".repeat(16), "0".repeat(128));
    refused(&put("/signed/s", MAX.into(), Some(fake)).await, MAX);
    refused(
        &put("/signed/s", MAX.into(), Some(proof.clone())).await,
        MAX,
    );
    let next = (token.parse::<u64>().expect("counter") + 1).to_string();
    refused(
        &put("/signed/s", next.clone(), Some(proof.clone())).await,
        &next,
    );
    // The same proof replayed on another scope of the route.
    refused(
        &put("/signed/other", token.clone(), Some(proof.clone())).await,
        &token,
    );
    assert_eq!(upstream.seen().len(), forwarded, "nothing forwarded");
    assert_eq!(
        marks.get("signed/s").expect("mark"),
        None,
        "nothing advanced"
    );
    assert_eq!(marks.get("signed/other").expect("mark"), None);

    // The authority's proof for the real acquisition passes, and keeps passing.
    for _ in 0..3 {
        let r = put("/signed/s", token.clone(), Some(proof.clone())).await;
        assert_eq!((r.status, r.result()), (200, "accepted"), "{}", r.body);
    }
    assert_eq!(
        marks.get("signed/s").expect("mark").map(|t| t.to_string()),
        Some(token.clone())
    );

    let r = Client::new(running.admin_addr).get("/metrics").await;
    assert!(
        r.body
            .contains("fencegate_requests_total{route=\"signed\",result=\"invalid_proof\"} 5"),
        "{}",
        r.body
    );
    running.shutdown().await;
}

/// Once a gate has verified a proof, the same bytes for the same token pass without a
/// second verification; other bytes for that token are verified, not trusted.
#[tokio::test]
async fn a_verified_proof_is_remembered_but_another_is_checked() {
    let dir = tempfile::tempdir().expect("dir");
    let (running, _upstream, authority, proxy) = start(dir.path()).await;
    let (_, token, proof) = acquire(&authority, A, "signed/c").await;
    let keys = running.app.proxy.config().fencing.proof_keys.clone();
    let before = keys.verifications();
    let send = |proof: String| {
        let (proxy, token) = (proxy.clone(), token.clone());
        async move {
            proxy
                .send(
                    "PUT",
                    "/signed/c",
                    &[("fencing-token", &token), ("fencing-proof", &proof)],
                    "",
                )
                .await
        }
    };
    for _ in 0..5 {
        assert_eq!(send(proof.clone()).await.status, 200);
    }
    assert_eq!(
        keys.verifications() - before,
        1,
        "verified once, then remembered"
    );
    // The same key id, the signature changed in its last digit: verified, and refused.
    let last = proof.chars().last().expect("digit");
    let tampered = format!(
        "{}{}",
        &proof[..proof.len() - 1],
        if last == '0' { '1' } else { '0' }
    );
    assert_eq!(send(tampered).await.result(), "invalid_proof");
    assert_eq!(keys.verifications() - before, 2);
    assert_eq!(send(proof.clone()).await.status, 200);
    running.shutdown().await;
}

/// `fencegate keygen` writes the pair, the secret half 0600, and never overwrites.
#[test]
fn keygen_writes_a_key_pair_once() {
    let dir = tempfile::tempdir().expect("dir");
    let out = dir.path().join("keys-fence");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .arg("keygen")
            .arg("--out")
            .arg(&out)
            .output()
            .expect("running fencegate keygen")
    };
    let first = run();
    assert!(first.status.success(), "{first:?}");
    let key = dir.path().join("keys-fence.key");
    let public = dir.path().join("keys-fence.pub");
    assert!(String::from_utf8_lossy(&first.stdout).starts_with("key id "));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).expect("key").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let before = std::fs::read(&key).expect("key");
    assert!(
        std::fs::read_to_string(&public)
            .expect("pub")
            .starts_with("fencegate-verification-key v1\nkey-id ")
    );
    let second = run();
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    assert!(String::from_utf8_lossy(&second.stderr).contains("exists already"));
    assert_eq!(std::fs::read(&key).expect("key"), before, "not overwritten");
}
