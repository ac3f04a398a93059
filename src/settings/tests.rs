//! The assembled file's tests: every section through [`super::Config::parse`], the
//! checks that span sections, and the description `check-config` prints.

use super::*;
use crate::route::{PathTemplate, ScopeTemplate};
use std::time::Duration;

const GOOD: &str = r#"
[server]
listen = "127.0.0.1:8080"
[store]
path = "data/x.redb"
[fencing]
drain_timeout = "2s"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "objects"
"#;

#[test]
fn good_config() {
    let c = Config::parse(GOOD, Path::new("/etc/fg")).unwrap();
    assert_eq!(c.store.path, Path::new("/etc/fg/data/x.redb"));
    assert_eq!(c.fencing.drain_timeout, Duration::from_secs(2));
    assert_eq!(c.fencing.settle, Duration::from_secs(5));
    assert_eq!(c.routes[0].equal, EqualPolicy::Accept);
    assert!(c.routes[0].fences_method(&Method::PUT));
    assert!(!c.routes[0].fences_method(&Method::GET));
}

/// Loading `text` fails with an error at each of `paths` (among others, perhaps).
fn errors_at(text: &str, paths: &[&str]) -> Vec<ConfigError> {
    let errs = Config::parse(text, Path::new(".")).unwrap_err().0;
    for want in paths {
        assert!(
            errs.iter().any(|e| e.path == *want),
            "missing {want} in {errs:?}"
        );
    }
    errs
}

/// Allowed, but likely mistakes: warned about, not refused.
#[test]
fn warns_of_listeners_beyond_loopback_without_tls() {
    let dir = tempfile::tempdir().expect("dir");
    crate::config::value::write_private(dir.path().join("admin.token"), "t0ken-of-the-admin");
    let text = "[admin]\nlisten = \"0.0.0.0:9090\"\ntoken_file = \"admin.token\"\n[store]\npath = \"x.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n[[route]]\nname = \"r\"\npath = \"/r\"\nscope = \"r\"\nupstream = \"u\"\n";
    let c = Config::parse(text, dir.path()).expect("parses");
    assert!(
        c.warnings()
            .iter()
            .any(|w| w.starts_with("[admin] listens on 0.0.0.0:9090 without tls")),
        "{:?}",
        c.warnings()
    );
    let local = text.replace("0.0.0.0:9090", "127.0.0.1:9090");
    let c = Config::parse(&local, dir.path()).expect("parses");
    assert!(c.warnings().iter().all(|w| !w.starts_with("[admin]")));
    assert!(
        c.describe()
            .contains("fencing header fencing-token · drain_timeout")
    );
}

/// A share of two descriptors admits a connection but none of its HTTP/2 streams: said at
/// load, not learnt from 502s.
#[test]
fn warns_of_a_descriptor_share_that_refuses_every_http2_stream() {
    let text = "[server]\nmax_descriptors_per_ip = 2\n[store]\npath = \"x.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n[[route]]\nname = \"r\"\npath = \"/r\"\nscope = \"r\"\nupstream = \"u\"\n";
    let warned = |text: &str| {
        Config::parse(text, Path::new("."))
            .expect("parses")
            .warnings()
            .iter()
            .any(|w| w.starts_with("[server] max_descriptors_per_ip = 2:"))
    };
    assert!(warned(text));
    assert!(!warned(&text.replace("= 2\n", "= 3\n")));
}

#[test]
fn warns_of_shared_scopes_and_pass_through_routes_over_fenced_paths() {
    let routes = r#"
[[route]]
name = "public"
path = "/{x}/{y}/{z}"
upstream = "objects"
fenced = false
[[route]]
name = "kv"
api = "plain"
path = "/kv/{bucket}/{*key}"
scope = "kv/{bucket}:{key}"
upstream = "objects"
[[route]]
name = "reports"
path = "/reports/{report}/{*rest}"
scope = "report/{report}"
upstream = "objects"
[[route]]
name = "files"
api = "plain"
path = "/files/{a}/{*rest}"
scope = "f/{a}/{rest}"
upstream = "objects"
host = "files.example"
[[route]]
name = "other-host"
path = "/{p}"
upstream = "objects"
fenced = false
host = "other.example"
[[route]]
name = "top"
path = "/{q}"
scope = "top/{q}"
upstream = "objects"
equal = "reject"
idempotency = "optional"
"#;
    // The backend serves each host name its own objects (SPEC §2: else `other-host`
    // and `top` would fence /a two ways, which is refused, not warned about).
    let text = GOOD.split("[[route]]").next().unwrap_or_default().replace(
        "url = \"http://127.0.0.1:9000\"\n",
        "url = \"http://127.0.0.1:9000\"\ndistinct_hosts = true\n",
    ) + routes;
    let c = Config::parse(&text, Path::new(".")).expect("a config with warnings loads");
    assert!(Config::parse(&text.replace("distinct_hosts = true\n", ""), Path::new(".")).is_err());
    let w = c.warnings();
    let has = |needle: &str| w.iter().any(|x| x.contains(needle));
    assert!(
        has("route `kv`: scope `kv/{bucket}:{key}` joins captures `bucket` and `key`"),
        "{w:#?}"
    );
    assert!(
        has("route `kv` is fenced, but pass-through route `public`"),
        "{w:#?}"
    );
    assert!(has("(such as /kv/a/a)"), "{w:#?}");
    assert!(
        has(
            "route `reports` is fenced, but pass-through route `public` (/{x}/{y}/{z}) comes first and takes some of its paths (such as /reports/a/a)"
        ),
        "{w:#?}"
    );
    assert!(
        has("route `files` is fenced, but pass-through route `public`"),
        "{w:#?}"
    );
    // A pass-through route for one host takes that host's paths of a route for all.
    assert!(
        has(
            "route `top` is fenced, but pass-through route `other-host` (/{p}) comes first and takes some of its paths (such as /a)"
        ),
        "{w:#?}"
    );
    // Another host (`files` after `other-host`), or no common path (`top` after
    // `public`): nothing to say.
    assert!(
        has("route `top`: idempotency with equal = \"reject\""),
        "{w:#?}"
    );
    assert_eq!(w.len(), 6, "{w:#?}");
    assert!(
        Config::parse(GOOD, Path::new("."))
            .unwrap()
            .warnings()
            .is_empty()
    );
}

#[test]
fn the_buffered_budget_holds_at_least_one_request_body() {
    let text =
        format!("{GOOD}\n[idempotency]\nmax_request_body = \"1MiB\"\nmax_buffered = \"512KiB\"\n");
    errors_at(&text, &["idempotency.max_buffered"]);
    let text = text.replace("512KiB", "1MiB");
    let c = Config::parse(&text, Path::new(".")).expect("equal is enough");
    assert_eq!(c.idempotency.max_buffered, 1 << 20);
    let c = Config::parse(GOOD, Path::new(".")).unwrap();
    assert_eq!(c.idempotency.max_buffered, 128 << 20);
}

/// `fingerprint_ignore`: lowercase header names or `prefix*`, sorted and deduplicated;
/// anything else refused at its index (a bare `*` would blind the fingerprint).
#[test]
fn fingerprint_ignore_takes_lowercase_names_and_prefixes() {
    let text = format!(
        "{GOOD}\n[idempotency]\nfingerprint_ignore = [\"x-my-trace\", \"x-span-*\", \"x-my-trace\", \"cf-ray\"]\n"
    );
    let c = Config::parse(&text, Path::new(".")).expect("valid names");
    let ignored = &c.idempotency.fingerprint_ignore;
    assert_eq!(ignored.names, ["cf-ray", "x-my-trace"]);
    assert_eq!(ignored.prefixes, ["x-span-"]);
    assert!(ignored.covers("x-span-id") && ignored.covers("cf-ray"));
    assert!(!ignored.covers("x-my-trace-2") && !ignored.covers("destination"));
    let text = format!(
        "{GOOD}\n[idempotency]\nfingerprint_ignore = [\"ok\", \"X-Trace\", \"*\", \"a b\", \"x:y\", \"\", \"a*b\"]\n"
    );
    let errs = errors_at(
        &text,
        &[
            "idempotency.fingerprint_ignore[1]",
            "idempotency.fingerprint_ignore[2]",
            "idempotency.fingerprint_ignore[3]",
            "idempotency.fingerprint_ignore[4]",
            "idempotency.fingerprint_ignore[5]",
            "idempotency.fingerprint_ignore[6]",
        ],
    );
    assert!(
        !errs
            .iter()
            .any(|e| e.path == "idempotency.fingerprint_ignore[0]"),
        "{errs:?}"
    );
    let upper = errs
        .iter()
        .find(|e| e.path == "idempotency.fingerprint_ignore[1]")
        .expect("X-Trace");
    assert!(upper.to_string().contains("`x-trace`"), "{upper}");
}

/// A good `[cluster]` loads in a build with etcd (its secret read, only its digest
/// kept), and is refused where a cluster would break its promises: idempotency records
/// are one instance's, so is a WebDAV collection's view of the marks beneath it, a
/// local authority's epochs one instance's file, and the peer listener must be its own. A build without etcd refuses the table by name.
#[test]
fn a_cluster_table_loads_with_its_limits() {
    let dir = tempfile::tempdir().expect("dir");
    let secret = dir.path().join("peer.secret");
    crate::config::value::write_private(&secret, "0123456789abcdef0123456789abcdef\n");
    let table = format!(
        "\n[cluster]\nname = \"fg-a\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n\
             peer_listen = \"127.0.0.1:7401\"\npeer_secret_file = \"{}\"\n",
        secret.display()
    );
    let text = format!("{GOOD}{table}");
    #[cfg(not(feature = "etcd"))]
    {
        let errs = errors_at(&text, &["cluster"]);
        assert!(errs[0].message.contains("--features etcd"), "{errs:?}");
    }
    #[cfg(feature = "etcd")]
    {
        let c = Config::parse(&text, Path::new(".")).expect("a good table loads");
        let cluster = c.cluster.expect("[cluster]");
        assert_eq!(cluster.name, "fg-a");
        assert_eq!(
            cluster.peer_key,
            crate::cluster::config::PeerKey::of("0123456789abcdef0123456789abcdef")
        );
        assert!(
            !format!("{cluster:?}").contains(&cluster.peer_key.0),
            "not in logs"
        );
        crate::config::value::write_private(&secret, "short\n");
        errors_at(&text, &["cluster.peer_secret_file"]);
        crate::config::value::write_private(&secret, "0123456789abcdef0123456789abcdef\n");
        let idem = text.replace(
            "upstream = \"objects\"",
            "upstream = \"objects\"\nidempotency = \"optional\"",
        );
        errors_at(&idem, &["route[0].idempotency"]);
        // A WebDAV route with one scope per object: its collections' check reads the
        // marks beneath a scope, spread over the instances. One scope per tree is fine.
        let dav = text.replace(
            "scope = \"report/{report}\"",
            "scope = \"report/{report}/{rest}\"\napi = \"webdav\"",
        );
        errors_at(&dav, &["route[0].api"]);
        let tree = text.replace(
            "scope = \"report/{report}\"",
            "scope = \"report/{report}\"\napi = \"webdav\"",
        );
        Config::parse(&tree, Path::new(".")).expect("one scope per tree in a cluster");
        let shared = text.replace("127.0.0.1:7401", "127.0.0.1:8080");
        errors_at(&shared, &["cluster.peer_listen"]);
        let anywhere = text.replace("127.0.0.1:7401", "0.0.0.0:7401");
        errors_at(&anywhere, &["cluster.peer_listen"]);
    }
}

#[test]
fn a_cluster_table_has_its_keys_checked() {
    let text = format!(
        "{GOOD}\n[cluster]\nname = \"fg a\"\ncluster_name = \"x/y\"\n\
             etcd_endpoints = [\"127.0.0.1:2379\"]\nshards = 0\nownership_ttl = \"500ms\"\n\
             drift_margin = \"2s\"\nfence_command = []\n"
    );
    let errs = errors_at(
        &text,
        &[
            "cluster.name",
            "cluster.cluster_name",
            "cluster.etcd_endpoints[0]",
            "cluster.peer_listen",
            "cluster.shards",
            "cluster.ownership_ttl",
            "cluster.drift_margin",
            "cluster.peer_secret_file",
            "cluster.fence_command",
        ],
    );
    let missing = format!("{GOOD}\n[cluster]\nshards = 64\nbogus = 1\n");
    let errs2 = errors_at(&missing, &["cluster"]);
    assert!(
        errs2.iter().any(|e| e.message.contains("bogus")),
        "an unknown key is named: {errs2:?} (and {errs:?})"
    );
    // An empty key names its path all the same (found by the `config` fuzz target).
    let errs3 = errors_at(&format!("\"\" = 1\n{GOOD}"), &["\"\""]);
    assert!(errs3.iter().all(|e| !e.path.is_empty()), "{errs3:?}");
    let no_name = format!("{GOOD}\n[cluster]\nshards = 64\n");
    errors_at(&no_name, &["cluster.name", "cluster.etcd_endpoints"]);
}

#[test]
fn collects_every_error_with_its_path() {
    let bad = r#"
bogus = 1
[fencing]
settle = "soon"
[[upstream]]
name = "u"
url = "ftp://x"
[[route]]
name = "a"
path = "/a/{x}"
scope = "a/{y}"
upstream = "nope"
equal = "maybe"
[[route]]
name = "b"
path = "/b"
scope = "b"
upstream = "u"
colour = "red"
"#;
    let errs = errors_at(
        bad,
        &[
            "bogus",
            "store",
            "fencing.settle",
            "upstream[0].url",
            "route[0].scope",
            "route[0].upstream",
            "route[0].equal",
            "route[1]",
        ],
    );
    assert!(errs.iter().any(|e| e.message.contains("colour")));
}

/// A route's host is kept as the router compares it; one it could never match (a
/// port, a path, userinfo) is refused.
#[test]
fn route_hosts_are_bare_host_names() {
    let with = |h: &str| {
        GOOD.replace(
            "name = \"reports\"",
            &format!("name = \"reports\"\nhost = \"{h}\""),
        )
    };
    let c = Config::parse(&with("Files.Internal."), Path::new(".")).unwrap();
    assert_eq!(c.routes[0].host.as_deref(), Some("files.internal"));
    let c = Config::parse(&with("[::1]"), Path::new(".")).unwrap();
    assert_eq!(c.routes[0].host.as_deref(), Some("[::1]"));
    for bad in [
        "",
        "files.internal:8080",
        "files.internal/x",
        "u@files.internal",
        "a b",
    ] {
        errors_at(&with(bad), &["route[0].host"]);
    }
}

/// Values so large that a deadline or a semaphore built from them would panic at run
/// time are refused when the file is loaded (and so by `check-config`).
#[test]
fn durations_and_counts_are_bounded() {
    let huge = GOOD
            .replace(
                "drain_timeout = \"2s\"",
                "drain_timeout = \"2s\"\nsettle = \"18446744073709551615s\"\nmax_waiters_per_scope = 4294967297",
            )
            .replace(
                "listen = \"127.0.0.1:8080\"",
                "listen = \"127.0.0.1:8080\"\nmax_connections = 4611686018427387904\nshutdown_timeout = \"367d\"",
            );
    errors_at(
        &huge,
        &[
            "fencing.settle",
            "fencing.max_waiters_per_scope",
            "server.max_connections",
            "server.shutdown_timeout",
        ],
    );
    let authority = format!("{GOOD}\n[authority]\nmax_ttl = \"400000000000y\"\n");
    errors_at(&authority, &["authority.max_ttl"]);
    let edge = GOOD.replace(
        "drain_timeout = \"2s\"",
        "drain_timeout = \"366d\"\nmax_waiters_per_scope = 4294967296",
    );
    let c = Config::parse(&edge, Path::new(".")).expect("the largest values load");
    assert_eq!(
        c.fencing.drain_timeout,
        Duration::from_secs(366 * 24 * 3600)
    );
    assert_eq!(c.fencing.max_waiters_per_scope, 1 << 32);
}

/// `none` labels the metrics of requests that matched no route: a route of that name
/// would share their row.
#[test]
fn a_route_named_none_is_refused() {
    let errs = errors_at(
        &GOOD.replace("name = \"reports\"", "name = \"none\""),
        &["route[0].name"],
    );
    assert!(
        errs.iter().any(|e| e.message.contains("reserved")),
        "{errs:?}"
    );
    // Other names, quotes and backslashes included, are fine (metrics escape them).
    let odd = GOOD.replace("name = \"reports\"", r#"name = "none \"2\" \\ x""#);
    Config::parse(&odd, Path::new(".")).expect("an odd name loads");
}

#[test]
fn admin_off_loopback_needs_a_token() {
    let text = format!("{GOOD}\n[admin]\nlisten = \"0.0.0.0:9090\"\n");
    let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
    assert!(errs.iter().any(|e| e.path == "admin.listen"), "{errs:?}");
    let dir = tempfile::tempdir().unwrap();
    crate::config::value::write_private(dir.path().join("t"), "secret");
    let text = format!("{GOOD}\n[admin]\nlisten = \"0.0.0.0:9090\"\ntoken_file = \"t\"\n");
    let c = Config::parse(&text, dir.path()).unwrap();
    assert_eq!(c.admin.token.as_deref(), Some("secret"));
}

/// A secret or private key other users could read is refused with its mode, as ssh
/// refuses such a key; a root-owned one may be group-readable (a Kubernetes Secret).
#[cfg(unix)]
#[test]
fn secrets_open_to_others_are_refused_with_their_mode() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t");
    crate::config::value::write_private(&t, "secret");
    let text = format!("{GOOD}\n[admin]\nlisten = \"127.0.0.1:9091\"\ntoken_file = \"t\"\n");
    let root = std::fs::metadata(&t).unwrap().uid() == 0;
    for (mode, refused) in [
        (0o600, false),
        (0o400, false),
        (0o644, true),
        (0o604, true),
        (0o620, true),
        (0o640, !root),
        (0o440, !root),
    ] {
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(mode)).unwrap();
        match Config::parse(&text, dir.path()) {
            Ok(_) => assert!(!refused, "{mode:o} accepted"),
            Err(e) => {
                assert!(refused, "{mode:o} refused: {e:?}");
                assert_eq!(e.0[0].path, "admin.token_file");
                assert!(
                    e.0[0].message.contains(&format!("(mode {mode:04o})")),
                    "{e:?}"
                );
            }
        }
    }
    // Through a symbolic link (a Secret's files are links), the file's own mode counts.
    std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::os::unix::fs::symlink(&t, dir.path().join("link")).unwrap();
    let linked = text.replace("token_file = \"t\"", "token_file = \"link\"");
    assert!(Config::parse(&linked, dir.path()).is_err());
    std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(Config::parse(&linked, dir.path()).is_ok());
}

#[test]
fn the_admin_api_listens_apart_from_the_proxy() {
    for listen in ["127.0.0.1:8080", "0.0.0.0:8080"] {
        let text = format!("{GOOD}\n[admin]\nlisten = \"{listen}\"\ntoken_file = \"t\"\n");
        let dir = tempfile::tempdir().unwrap();
        crate::config::value::write_private(dir.path().join("t"), "secret");
        let errs = Config::parse(&text, dir.path()).unwrap_err().0;
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "admin.listen");
        assert!(errs[0].message.contains("server.listen"), "{errs:?}");
    }
    let other = format!("{GOOD}\n[admin]\nlisten = \"127.0.0.1:8081\"\n");
    Config::parse(&other, Path::new(".")).expect("another port");
}

/// A fenced route must fence something: an empty `methods` list would let every
/// tokenless request through unchecked, an implicit pass-through (SPEC §2).
#[test]
fn a_fenced_route_needs_a_fenced_method() {
    let empty = format!("{GOOD}methods = []\n");
    let errs = errors_at(&empty, &["route[0].methods"]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(errs[0].message.contains("`reports`"), "{errs:?}");
    assert!(errs[0].message.contains("fenced = false"), "{errs:?}");
    // Said explicitly, a pass-through is fine; so is a list naming any method.
    let open = format!("{GOOD}fenced = false\nmethods = []\n");
    Config::parse(&open, Path::new(".")).expect("an explicit pass-through");
    let one = format!("{GOOD}methods = [\"PUT\"]\n");
    let c = Config::parse(&one, Path::new(".")).expect("one fenced method");
    assert!(c.routes[0].fences_method(&Method::PUT));
    assert!(!c.routes[0].fences_method(&Method::POST));
}

#[test]
fn the_authority_listens_apart() {
    for listen in ["127.0.0.1:8080", "127.0.0.1:9090", "0.0.0.0:8080"] {
        let text = format!("{GOOD}\n[authority]\nlisten = \"{listen}\"\n");
        let errs = errors_at(&text, &["authority.listen"]);
        assert!(
            errs.iter().any(|e| e.message.contains("of its own")),
            "{errs:?}"
        );
    }
    // Any free port (0) is no collision; another port is none either.
    let ports = GOOD.replace("127.0.0.1:8080", "127.0.0.1:0")
        + "\n[admin]\nlisten = \"127.0.0.1:0\"\n[authority]\nlisten = \"127.0.0.1:0\"\n";
    Config::parse(&ports, Path::new(".")).expect("port 0 everywhere");
    let other = format!("{GOOD}\n[authority]\nlisten = \"127.0.0.1:7070\"\n");
    Config::parse(&other, Path::new(".")).expect("another port");
}

#[test]
fn an_open_authority_needs_clients_and_their_files() {
    let dir = tempfile::tempdir().expect("dir");
    crate::config::value::write_private(dir.path().join("a.token"), "s");
    crate::config::value::write_private(dir.path().join("empty.token"), " \n");
    let parse = |extra: &str| {
        let text = format!("{GOOD}\n[authority]\nlisten = \"0.0.0.0:7070\"\n{extra}");
        Config::parse(&text, dir.path())
    };
    let errs = parse("").unwrap_err().0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "authority.listen");
    assert!(errs[0].message.contains("[[authority.client]]"), "{errs:?}");
    let client =
        "[[authority.client]]\nname = \"a\"\ntoken_file = \"a.token\"\nscopes = [\"r/*\"]\n";
    let c = parse(client).expect("with a client");
    let clients = &c.authority.as_ref().expect("authority").clients;
    assert_eq!(clients[0].name, "a");
    assert!(clients[0].allows("r/x") && !clients[0].allows("q"));
    assert!(!format!("{:?}", c.authority).contains("secret_digest"));
    let bad = "[[authority.client]]\nname = \"a\"\ntoken_file = \"empty.token\"\nscopes = []\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"x**\", \"a*b\"]\ncolour = 1\n";
    let errs = parse(bad).unwrap_err().0;
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    assert!(paths.contains(&"authority"), "{paths:?}");
    let bad = "signing_key = \"nokey\"\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"empty.token\"\nscopes = []\n\
                   [[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"x**\", \"a*b\"]\n";
    let errs = parse(bad).unwrap_err().0;
    let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
    for p in [
        "authority.signing_key",
        "authority.client[0].token_file",
        "authority.client[0].scopes",
        "authority.client[1].name",
        "authority.client[1].token_file",
        "authority.client[1].scopes[0]",
        "authority.client[1].scopes[1]",
    ] {
        assert!(paths.contains(&p), "{p} in {paths:?}");
    }
}

#[test]
fn required_proofs_need_keys() {
    let dir = tempfile::tempdir().expect("dir");
    let required = format!("{GOOD}proof = \"required\"\n");
    let errs = Config::parse(&required, dir.path()).unwrap_err().0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "route[0].proof");
    assert!(errs[0].message.contains("proof_keys"), "{errs:?}");
    let maybe = format!("{GOOD}proof = \"maybe\"\n");
    assert_eq!(
        Config::parse(&maybe, dir.path()).unwrap_err().0[0].path,
        "route[0].proof"
    );
    crate::proof::keygen(&dir.path().join("k")).expect("keygen");
    let with_keys = required.replace("[fencing]\n", "[fencing]\nproof_keys = [\"k.pub\"]\n");
    let c = Config::parse(&with_keys, dir.path()).expect("keys and a required route");
    assert_eq!(c.routes[0].proof, ProofMode::Required);
    assert!(c.describe().contains("equal=accept · proof required"));
    assert!(!c.fencing.proof_keys.is_empty());
    // A key that cannot be read is its own error, not also the route's.
    let missing = with_keys.replace("k.pub", "gone.pub");
    let errs = Config::parse(&missing, dir.path()).unwrap_err().0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "fencing.proof_keys[0]");
    let secret = with_keys.replace("k.pub", "k.key");
    assert_eq!(
        Config::parse(&secret, dir.path()).unwrap_err().0[0].path,
        "fencing.proof_keys[0]"
    );
}

/// An authority-only file whose [authority] table has an error reports that error,
/// not also a missing route.
#[test]
fn a_bad_authority_table_is_not_also_a_missing_route() {
    let text = "[store]\npath = \"x.redb\"\n[authority]\nbackend = \"zookeeper\"\n";
    let errs = errors_at(text, &["authority.backend"]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    let text = "[store]\npath = \"x.redb\"\n[authority]\ncolour = \"red\"\n";
    let errs = errors_at(text, &["authority"]);
    assert_eq!(errs.len(), 1, "{errs:?}");
    // Without [authority], no routes is an error.
    errors_at("[store]\npath = \"x.redb\"\n", &["route"]);
}

#[test]
fn describe_shows_the_authority() {
    let c = Config::parse(GOOD, Path::new(".")).unwrap();
    assert!(!c.describe().contains("authority"));
    let text = format!(
        "{GOOD}\n[authority]\nlisten = \"127.0.0.1:7070\"\nbackend = \"etcd\"\n\
             etcd_endpoints = [\"http://10.0.0.1:2379\", \"http://10.0.0.2:2379\"]\nlock_delay = \"2s\"\n"
    );
    let c = Config::parse(&text, Path::new(".")).unwrap();
    assert!(
            c.describe().contains(
                "authority 127.0.0.1:7070 · backend etcd (http://10.0.0.1:2379, http://10.0.0.2:2379) · max_ttl 1m · lock_delay 2s\n"
            ),
            "{}",
            c.describe()
        );
    let text = format!("{GOOD}\n[authority]\n");
    let c = Config::parse(&text, Path::new(".")).unwrap();
    assert!(
        c.describe()
            .contains("authority 127.0.0.1:7070 · backend local"),
        "{}",
        c.describe()
    );
}

#[test]
fn shadowed_routes_are_errors() {
    let text = format!(
        "{GOOD}\n[[route]]\nname = \"late\"\npath = \"/reports/july/{{*rest}}\"\nscope = \"x\"\nupstream = \"objects\"\n"
    );
    let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
    assert!(errs[0].message.contains("can never match"), "{errs:?}");
}

/// A file of `GOOD`'s sections with these upstreams and routes.
fn with_upstreams_and_routes(upstreams: &str, routes: &str) -> String {
    let head = GOOD.split("[[upstream]]").next().unwrap_or_default();
    format!("{head}{upstreams}{routes}")
}

const ONE_STORE: &str = r#"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
"#;

/// The errors of one object, one scope (SPEC §2) in `text`, as (place, message).
fn host_chosen(text: &str) -> Vec<(String, String)> {
    match Config::parse(text, Path::new(".")) {
        Ok(_) => Vec::new(),
        Err(errs) => errs
            .0
            .into_iter()
            .filter(|e| e.message.contains("the Host header would choose"))
            .map(|e| (e.path, e.message))
            .collect(),
    }
}

/// Two routes for one upstream, one path each: fenced under `tenant-a/…` for one host and
/// under `report/…` for any other.
const TENANT_THEN_ANY: &str = r#"
[[route]]
name = "tenant-reports"
host = "reports.tenant-a.example.com"
path = "/reports/{report}/{*object}"
scope = "tenant-a/report/{report}"
upstream = "objects"
[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
"#;

/// Where a backend reads one path as one object whatever the Host, routes that take
/// the same path for different hosts must fence it alike: refused, naming both
/// routes, the upstream, a path and the ways out.
#[test]
fn routes_that_let_the_host_choose_the_scope_are_refused() {
    let tenant_then_any = TENANT_THEN_ANY;
    let found = host_chosen(&with_upstreams_and_routes(ONE_STORE, tenant_then_any));
    assert_eq!(found.len(), 1, "{found:#?}");
    let (place, message) = &found[0];
    assert_eq!(place, "route[1]");
    assert_eq!(
        message,
        "routes `tenant-reports` (host reports.tenant-a.example.com, scope \"tenant-a/report/{report}\") \
             and `reports` (any other host, scope \"report/{report}\") send the same paths to upstream \
             `objects`, such as /reports/a/a: the Host header would choose how one object is fenced. \
             Give both the same path and scope templates, send them to separate upstreams (different \
             backends), or, if the backend serves different objects for different host names, set \
             `distinct_hosts = true` on `objects`"
    );

    // Fenced for both hosts, under different scopes.
    let two_scopes = tenant_then_any.replace(
        "name = \"reports\"\n",
        "name = \"reports\"\nhost = \"reports.example.com\"\n",
    );
    let found = host_chosen(&with_upstreams_and_routes(ONE_STORE, &two_scopes));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
        found[0]
            .1
            .contains("and `reports` (host reports.example.com, scope"),
        "{found:#?}"
    );

    // Both fenced, with one scope template over different path templates: the shared
    // path /reports/a/a renders `report/a` under one and `report/reports` under the
    // other.
    let other_shape = r#"
[[route]]
name = "s3"
host = "s3.example.com"
path = "/{bucket}/{report}/{*key}"
scope = "report/{bucket}"
upstream = "objects"
[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
"#;
    let found = host_chosen(&with_upstreams_and_routes(ONE_STORE, other_shape));
    assert_eq!(found.len(), 1, "{found:#?}");
}

/// A path fenced for one host and passed through for another is refused too: the Host
/// would choose whether it is fenced at all.
#[test]
fn routes_that_let_the_host_choose_whether_to_fence_are_refused() {
    // Fenced for one host, passed through for the others: the Host picks no fence.
    let fenced_then_open = r#"
[[route]]
name = "s3"
host = "s3.example.com"
api = "plain"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
[[route]]
name = "static"
path = "/static/{*file}"
upstream = "objects"
fenced = false
"#;
    let found = host_chosen(&with_upstreams_and_routes(ONE_STORE, fenced_then_open));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
        found[0]
            .1
            .contains("and `static` (any other host, pass-through)")
            && found[0].1.contains("such as /static/a:"),
        "{found:#?}"
    );

    // Two hosts, one path each way round: passed through for one, fenced for the other.
    let open_then_fenced = r#"
[[route]]
name = "public"
host = "public.example"
path = "/files/{*rest}"
upstream = "objects"
fenced = false
[[route]]
name = "files"
host = "files.example"
path = "/files/{name}"
scope = "file/{name}"
upstream = "objects"
"#;
    let found = host_chosen(&with_upstreams_and_routes(ONE_STORE, open_then_fenced));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
            found[0].1.starts_with(
                "routes `public` (host public.example, pass-through) and `files` (host files.example, scope \"file/{name}\")"
            ) && found[0].1.contains("such as /files/a:"),
            "{found:#?}"
        );
}

/// Upstreams are told apart by URL for the host check: two entries of one URL are one
/// backend, and both must say that it tells hosts apart.
#[test]
fn two_upstreams_of_one_url_are_one_backend_to_the_host_check() {
    let tenant_then_any = TENANT_THEN_ANY;
    // A second [[upstream]] with the same URL is the same backend.
    let twice = r#"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[upstream]]
name = "objects-again"
url = "http://127.0.0.1:9000/"
timeout = "5m"
"#;
    let on_two =
        tenant_then_any.replacen("upstream = \"objects\"", "upstream = \"objects-again\"", 1);
    let found = host_chosen(&with_upstreams_and_routes(twice, &on_two));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
        found[0]
            .1
            .contains("to upstreams `objects-again` and `objects` (one URL)")
            && found[0].1.ends_with("set `distinct_hosts = true` on both"),
        "{found:#?}"
    );
    // Both entries must say the backend tells hosts apart.
    let one_says = twice.replacen(
        "url = \"http://127.0.0.1:9000\"\n",
        "url = \"http://127.0.0.1:9000\"\ndistinct_hosts = true\n",
        1,
    );
    let text = with_upstreams_and_routes(&one_says, &on_two);
    assert_eq!(host_chosen(&text).len(), 1, "{text}");
    let both_say = one_says.replace(
        "timeout = \"5m\"\n",
        "timeout = \"5m\"\ndistinct_hosts = true\n",
    );
    let text = with_upstreams_and_routes(&both_say, &on_two);
    assert!(Config::parse(&text, Path::new(".")).is_ok(), "{text}");
}

/// Two entries that spell one server apart (a name and its address, two loopback
/// addresses on one port) are one backend to the host check too: resolved when a pair of
/// routes would share a path. Two ports are two servers.
#[test]
fn two_upstreams_that_reach_one_server_are_one_backend_to_the_host_check() {
    let on_two = TENANT_THEN_ANY.replacen("upstream = \"objects\"", "upstream = \"twin\"", 1);
    let twins = |url: &str| {
        format!(
            "[[upstream]]\nname = \"objects\"\nurl = \"http://127.0.0.1:9000\"\n\
             [[upstream]]\nname = \"twin\"\nurl = \"{url}\"\n"
        )
    };
    for url in ["http://localhost:9000", "http://127.0.0.2:9000"] {
        let found = host_chosen(&with_upstreams_and_routes(&twins(url), &on_two));
        assert_eq!(found.len(), 1, "{url}: {found:#?}");
        assert!(
            found[0]
                .1
                .contains("to upstreams `twin` and `objects` (one server: both reach 127.0.0.")
                && found[0].1.ends_with("set `distinct_hosts = true` on both"),
            "{url}: {found:#?}"
        );
    }
    // Another port is another server; and a backend that says it tells hosts apart is
    // believed, on both entries.
    accepted(&twins("http://localhost:9001"), &on_two);
    let both_say =
        twins("http://localhost:9000").replace("9000\"\n", "9000\"\ndistinct_hosts = true\n");
    accepted(&both_say, &on_two);
}

/// Panics unless the file with `upstreams` and `routes` parses.
fn accepted(upstreams: &str, routes: &str) {
    let text = with_upstreams_and_routes(upstreams, routes);
    if let Err(e) = Config::parse(&text, Path::new(".")) {
        panic!("refused: {e:?}\n{text}");
    }
}

/// What one object, one scope allows: one fence for a path whatever the host, one host.
#[test]
fn routes_that_fence_each_path_one_way_are_accepted() {
    // The same templates (captures named apart), and pass-through both ways.
    accepted(
        ONE_STORE,
        r#"
[[route]]
name = "tenant-reports"
host = "reports.tenant-a.example.com"
path = "/reports/{r}/{*object}"
scope = "report/{r}"
upstream = "objects"
methods = ["PUT"]
[[route]]
name = "static-cdn"
host = "cdn.example.com"
path = "/static/{*file}"
upstream = "objects"
fenced = false
[[route]]
name = "static"
path = "/static/{*f}"
upstream = "objects"
fenced = false
[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
"#,
    );
    // One host: the file's order decides, not the Host.
    accepted(
        ONE_STORE,
        r#"
[[route]]
name = "tenant-reports"
host = "reports.tenant-a.example.com"
path = "/reports/{report}/{*object}"
scope = "tenant-a/report/{report}"
upstream = "objects"
[[route]]
name = "tenant-objects"
host = "reports.tenant-a.example.com"
api = "plain"
path = "/{bucket}/{*key}"
scope = "tenant-a/object/{bucket}/{key}"
upstream = "objects"
"#,
    );
    // A route for any host first takes its paths from every host: a later route for
    // one host gets none of them.
    accepted(
        ONE_STORE,
        r#"
[[route]]
name = "static"
path = "/static/{*file}"
upstream = "objects"
fenced = false
[[route]]
name = "s3"
host = "s3.example.com"
api = "plain"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
"#,
    );
    // A carve-out for the host takes the shared paths before its general route does:
    // `s3` never gets /reports/..., which `s3-reports` fences as `reports` does.
    accepted(
        ONE_STORE,
        r#"
[[route]]
name = "s3-reports"
host = "s3.example.com"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
errors = "s3"
[[route]]
name = "s3"
host = "s3.example.com"
api = "plain"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
"#,
    );
    // Paths that no request could bring to both: nothing shared.
    accepted(
        ONE_STORE,
        r#"
[[route]]
name = "s3"
host = "s3.example.com"
api = "plain"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
[[route]]
name = "health"
path = "/healthz"
upstream = "objects"
fenced = false
"#,
    );
}

/// Routes that fence one path differently for different hosts are accepted where the
/// hosts reach different objects: a backend per host, or a backend that serves each host
/// its own objects.
#[test]
fn routes_on_backends_that_tell_hosts_apart_are_accepted() {
    let tenant_then_any = r#"
[[route]]
name = "tenant-reports"
host = "reports.tenant-a.example.com"
path = "/reports/{report}/{*object}"
scope = "tenant-a/report/{report}"
upstream = "tenant-a"
[[route]]
name = "reports"
path = "/reports/{report}/{*object}"
scope = "report/{report}"
upstream = "objects"
"#;
    // Separate backends.
    accepted(
        &format!("{ONE_STORE}[[upstream]]\nname = \"tenant-a\"\nurl = \"http://127.0.0.1:9001\"\n"),
        tenant_then_any,
    );
    // One backend that serves each host name its own objects.
    let vhosts = "[[upstream]]\nname = \"objects\"\nurl = \"http://127.0.0.1:9000\"\ndistinct_hosts = true\n";
    let one_upstream = tenant_then_any.replace("\"tenant-a\"", "\"objects\"");
    accepted(vhosts, &one_upstream);
    let c = Config::parse(
        &with_upstreams_and_routes(vhosts, &one_upstream),
        Path::new("."),
    )
    .expect("distinct hosts");
    assert!(c.upstreams[0].distinct_hosts);
    assert!(
        c.describe().contains(" · distinct hosts\n"),
        "{}",
        c.describe()
    );
    let c = Config::parse(GOOD, Path::new(".")).expect("good");
    assert!(!c.upstreams[0].distinct_hosts, "off unless declared");
}

/// Parsing reads no file: a text whose only faults are in the files it names parses
/// clean; loading reads them and reports each error where the file is named, among the
/// text's own, in the order of the text.
#[test]
fn parsing_reads_no_file_and_loading_reports_each_in_its_place() {
    let dir = tempfile::tempdir().expect("dir");
    let text = |server: &str, fencing: &str, upstream_tls: &str, client: &str, route: &str| {
        format!(
            r#"
[server]
listen = "127.0.0.1:0"
{server}tls = {{ cert = "gone.crt", key = "gone.key" }}
[admin]
listen = "127.0.0.1:0"
token_file = "gone.token"
[store]
path = "x.redb"
[fencing]
{fencing}proof_keys = ["gone.pub"]
[[upstream]]
name = "u"
url = "https://127.0.0.1:1"
tls = {{ ca = "gone.ca"{upstream_tls} }}
[authority]
listen = "127.0.0.1:0"
signing_key = "gone.signing"
[[authority.client]]
name = "a"
token_file = "gone.secret"
scopes = [{client}]
[[route]]
name = "r"
path = "/r/{{k}}"
scope = "r/{{k}}"
upstream = "u"
{route}"#
        )
    };
    let files_only = text("", "", "", "\"r/*\"", "");
    let draft = Draft::parse(&files_only, dir.path()).expect("TOML");
    assert!(!draft.has_errors(), "{draft:?}");
    let paths =
        |errs: ConfigErrors| -> Vec<String> { errs.0.into_iter().map(|e| e.path).collect() };
    assert_eq!(
        paths(draft.load().unwrap_err()),
        [
            "server.tls.cert",
            "server.tls.key",
            "admin.token_file",
            "fencing.proof_keys[0]",
            "upstream[0].tls.ca",
            "authority.client[0].token_file",
            "authority.signing_key",
        ]
    );
    let mixed = text(
        "max_headers = 0\n",
        "settle = \"soon\"\n",
        ", server_name = \"not a name\"",
        "",
        "equal = \"maybe\"\n",
    );
    let draft = Draft::parse(&mixed, dir.path()).expect("TOML");
    assert!(draft.has_errors());
    assert_eq!(
        paths(draft.load().unwrap_err()),
        [
            "server.max_headers",
            "server.tls.cert",
            "server.tls.key",
            "admin.token_file",
            "fencing.settle",
            "fencing.proof_keys[0]",
            "upstream[0].tls.ca",
            "upstream[0].tls.server_name",
            "authority.client[0].scopes",
            "authority.client[0].token_file",
            "authority.signing_key",
            "route[0].equal",
        ]
    );
    // Config::parse is the two steps.
    assert_eq!(
        paths(Config::parse(&mixed, dir.path()).unwrap_err()).len(),
        12
    );
}

/// Reload tells a changed section by comparing values: the secrets read from files
/// count (a new client secret or admin token is a change), and are never printed.
#[test]
fn sections_compare_by_value_secrets_included() {
    let dir = tempfile::tempdir().expect("dir");
    let write =
        |name: &str, text: &str| crate::config::value::write_private(dir.path().join(name), text);
    write("a.token", "first-secret");
    write("admin.token", "first-token");
    let text = format!(
        "{GOOD}\n[admin]\nlisten = \"127.0.0.1:9091\"\ntoken_file = \"admin.token\"\n\
             [authority]\n[[authority.client]]\nname = \"a\"\ntoken_file = \"a.token\"\nscopes = [\"r/*\"]\n"
    );
    let load = || Config::parse(&text, dir.path()).expect("config");
    let first = load();
    let again = load();
    assert!(first.server == again.server && first.admin == again.admin);
    assert!(first.fencing == again.fencing && first.idempotency == again.idempotency);
    assert!(first.authority == again.authority && first.log == again.log);
    write("a.token", "other-secret");
    let secret = load();
    assert!(secret.authority != first.authority);
    assert_eq!(
        format!("{:?}", secret.authority),
        format!("{:?}", first.authority),
        "the secret is in no Debug text"
    );
    assert!(secret.admin == first.admin);
    write("admin.token", "other-token");
    let token = load();
    assert!(token.admin != first.admin);
    assert!(!format!("{:?}", token.admin).contains("other-token"));
}

/// Every message, key path and place in the list, as `check-config` prints them, for
/// files with errors in the text and in the files it names (checked against the
/// messages of the single-step parser this replaced).
#[test]
fn every_error_keeps_its_message_path_and_place() {
    let dir = tempfile::tempdir().expect("dir");
    crate::config::value::write_private(dir.path().join("empty.token"), " \n");
    std::fs::write(
        dir.path().join("bad.pem"),
        "-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n",
    )
    .expect("pem");
    // Private: it is also named as a key, whose mode is checked first.
    crate::config::value::write_private(dir.path().join("nocert.pem"), "hello\n");
    let texts = [
        "bogus = 1\n[fencing]\nsettle = \"soon\"\nproof_keys = [\"nocert.pem\", \"gone\"]\n[[upstream]]\nname = \"u\"\nurl = \"ftp://x\"\n[[upstream]]\nname = \"u\"\nurl = \"https://h:1/x\"\ntls = { ca = \"bad.pem\", cert = \"nocert.pem\" }\n[[upstream]]\nname = \"v\"\nurl = \"https://h:1\"\ntls = { key = \"k\", server_name = \"a b\" }\n[[upstream]]\nname = \"w\"\nurl = \"http://h:1\"\ntls = { ca = \"x\" }\n[[route]]\nname = \"a\"\npath = \"/a/{x}\"\nscope = \"a/{y}\"\nupstream = \"nope\"\nequal = \"maybe\"\nproof = \"required\"\n[[route]]\nname = \"b\"\npath = \"/b\"\nscope = \"b\"\nupstream = \"u\"\ncolour = \"red\"\n",
        "[server]\nlisten = \"0.0.0.0:8080\"\ntls = { cert = \"bad.pem\", key = \"nocert.pem\", client_ca = \"gone\" }\n[admin]\nlisten = \"0.0.0.0:8080\"\ntoken_file = \"empty.token\"\ntls = { cert = \"x\", key = \"y\", colour = 1 }\n[store]\npath = \"\"\n[authority]\nlisten = \"0.0.0.0:8080\"\nsigning_key = \"nocert.pem\"\ntls = { cert = \"bad.pem\", key = \"k\" }\n[[authority.client]]\nname = \"a\"\ntoken_file = \"empty.token\"\nscopes = []\n[[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"x**\", \"a*b\"]\n[log]\naccess = \"\"\n",
        "[store]\npath = \"x\"\n[authority]\ntls = 3\nlisten = \"nope\"\n[[authority.client]]\nname = \"\"\ntoken_file = \"gone\"\nscopes = [\"r\"]\n",
        "[store]\npath = \"x\"\n[admin]\nlisten=\"0.0.0.0:1\"\n[authority]\nbackend = \"etcd\"\nlisten = \"0.0.0.0:7070\"\n[[authority.client]]\nname = \"a\"\ntoken_file = \"gone\"\nscopes = [\"r\"]\n",
    ];
    let mut all = String::new();
    for t in texts {
        match Config::parse(t, dir.path()) {
            Ok(_) => all.push_str("OK\n"),
            Err(e) => all.push_str(&format!("{e}\n----\n")),
        }
    }
    let all = all.replace(&dir.path().display().to_string(), "DIR");
    assert_eq!(all, GOLDEN, "{all}");
}

const GOLDEN: &str = r##"bogus: unknown section
store: missing: [store] path = "..." is required
fencing.settle: `soon` is not a duration (e.g. 500ms, 30s): expected number at 0
fencing.proof_keys[0]: DIR/nocert.pem: not a "fencegate-verification-key v1" file
fencing.proof_keys[1]: DIR/gone: cannot read: No such file or directory (os error 2)
upstream[0].url: `ftp://x` is not an http:// or https://host:port URL
upstream[1].url: give scheme and authority only; the request path is forwarded as received
upstream[1].tls.ca: DIR/bad.pem: not a usable CA certificate: invalid peer certificate: BadEncoding
upstream[1].tls.key: missing: a client certificate needs its key
upstream[2].tls.server_name: `a b` is not a DNS name or IP address
upstream[2].tls.cert: missing: a client key needs its certificate
upstream[3].tls: TLS settings need an https:// url
upstream[1].name: `u` is defined twice
route[0].scope: `{y}` is not a capture of the path template
route[0].upstream: no upstream named `nope`
route[0].equal: `maybe`: expected "accept" or "reject"
route[1]: unknown field `colour`, expected one of `name`, `path`, `scope`, `upstream`, `host`, `fenced`, `methods`, `equal`, `idempotency`, `idempotency_unknown`, `max_body`, `proof`, `sequence`, `errors`, `api`, `virtual_host_domain`, `bucket_scope`, `keys`
----
admin: unknown field `colour`, expected one of `cert`, `key`, `client_ca`, `resumption`
log.access: must be "off", "stdout" or a file path, not empty
server.tls.key: no PEM private key in DIR/nocert.pem
server.tls.client_ca: cannot read DIR/gone: No such file or directory (os error 2)
store.path: must not be empty
authority.tls.key: cannot read DIR/k: No such file or directory (os error 2)
authority.client[0].scopes: empty: the client could take no scope
authority.client[0].token_file: DIR/empty.token is empty
authority.client[1].name: `a` is defined twice
authority.client[1].scopes[0]: `x**`: an exact scope, or a prefix ending in one `*`
authority.client[1].scopes[1]: `a*b`: `*` only at the end
authority.client[1].token_file: cannot read DIR/gone: No such file or directory (os error 2)
authority.listen: 0.0.0.0:8080 is not loopback: add [[authority.client]] entries so that every call needs a bearer secret
authority.signing_key: DIR/nocert.pem: not a "fencegate-signing-key v1" file
authority.listen: 0.0.0.0:8080 is also server.listen (0.0.0.0:8080): the authority needs a listener of its own
----
authority.tls: invalid type: integer `3`, expected struct RawListenerTls
authority.listen: `nope` is not an IP:port address
authority.client[0].name: must be 1 to 1024 characters, none a control
authority.client[0].token_file: cannot read DIR/gone: No such file or directory (os error 2)
----
admin.listen: 0.0.0.0:1 is not loopback: set admin.token_file so the admin API needs a bearer token
authority.etcd_endpoints: backend = "etcd" needs at least one endpoint
authority.client[0].token_file: cannot read DIR/gone: No such file or directory (os error 2)
authority.listen: 0.0.0.0:7070 is not loopback: add [[authority.client]] entries so that every call needs a bearer secret
----
"##;

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Arbitrary text never panics the loader.
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
            let _ = Config::parse(&text, Path::new("."));
        }

        /// A good file with a random splice (the shape fuzzers find bugs with) either
        /// loads or reports errors with paths; it never panics.
        #[test]
        fn spliced_config_never_panics(at in 0usize..GOOD.len(), insert in "[\\[\\]{}=\"a-z0-9_./*:, \n]{0,24}") {
            let mut text = GOOD.to_string();
            let at = (0..=at).rev().find(|i| text.is_char_boundary(*i)).unwrap_or(0);
            text.insert_str(at, &insert);
            if let Err(errors) = Config::parse(&text, Path::new(".")) {
                prop_assert!(!errors.0.is_empty());
            }
        }

        /// Random path and scope templates never panic, and an accepted scope template
        /// only names captures of its path.
        #[test]
        fn random_templates(path in "/[a-z{}*/]{0,20}", scope in "[a-z{}/]{0,12}") {
            if let Ok(p) = PathTemplate::parse(&path)
                && let Ok(st) = ScopeTemplate::parse(&scope, &p)
            {
                let _ = st.is_constant();
            }
        }
    }
}
