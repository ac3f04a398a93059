//! Tests of the route and upstream tables' parsing and validation.

use std::path::Path;

use crate::proxy::problem::Dialect;
use crate::settings::Config;

const ROUTES: &str = r#"
[store]
path = "x.redb"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[route]]
name = "plain"
path = "/plain/{*rest}"
scope = "plain"
upstream = "objects"
[[route]]
name = "s3"
api = "plain"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
"#;

#[test]
fn errors_dialect_per_route() {
    let c = Config::parse(ROUTES, Path::new(".")).expect("parses");
    assert_eq!(c.routes[0].errors, Dialect::Problem);
    assert_eq!(c.routes[1].errors, Dialect::Problem);
    assert!(!c.describe().contains("errors s3"));
    let s3 = format!("{ROUTES}errors = \"s3\"\n");
    let c = Config::parse(&s3, Path::new(".")).expect("parses");
    assert_eq!(c.routes[0].errors, Dialect::Problem);
    assert_eq!(c.routes[1].errors, Dialect::S3);
    let described = c.describe();
    let line = described
        .lines()
        .find(|l| l.starts_with("route s3"))
        .expect("the s3 route is described");
    assert!(line.ends_with(" · errors s3"), "{line}");
    let explicit = format!("{ROUTES}errors = \"problem\"\n");
    let c = Config::parse(&explicit, Path::new(".")).expect("parses");
    assert_eq!(c.routes[1].errors, Dialect::Problem);
}

/// `sequence` is optional by default, "required" on fenced routes only, and any
/// other value is refused at its key.
#[test]
fn sequence_mode_per_route() {
    use super::SequenceMode;
    let c = Config::parse(ROUTES, Path::new(".")).expect("parses");
    assert_eq!(c.routes[1].sequence, SequenceMode::Optional);
    let required = format!("{ROUTES}sequence = \"required\"\n");
    let c = Config::parse(&required, Path::new(".")).expect("parses");
    assert_eq!(c.routes[1].sequence, SequenceMode::Required);
    assert!(c.describe().contains(" · sequence required"));
    let explicit = format!("{ROUTES}sequence = \"optional\"\n");
    let c = Config::parse(&explicit, Path::new(".")).expect("parses");
    assert_eq!(c.routes[1].sequence, SequenceMode::Optional);
    let bad = format!("{ROUTES}sequence = \"always\"\n");
    let errs = Config::parse(&bad, Path::new(".")).unwrap_err().0;
    assert_eq!(errs[0].path, "route[1].sequence");
    assert_eq!(
        errs[0].message,
        "`always`: expected \"optional\" or \"required\""
    );
    let unfenced = format!("{ROUTES}fenced = false\nsequence = \"required\"\n");
    let errs = Config::parse(&unfenced, Path::new(".")).unwrap_err().0;
    assert_eq!(errs[0].path, "route[1].sequence", "{errs:?}");
}

#[test]
fn unknown_errors_dialect_is_refused_at_its_key() {
    let bad = format!("{ROUTES}errors = \"xml\"\n");
    let errs = Config::parse(&bad, Path::new(".")).unwrap_err().0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "route[1].errors");
    assert_eq!(errs[0].message, "`xml`: expected \"problem\" or \"s3\"");
    let typed = format!("{ROUTES}errors = 3\n");
    let errs = Config::parse(&typed, Path::new(".")).unwrap_err().0;
    assert_eq!(errs[0].path, "route[1]", "{errs:?}");
}

const S3: &str = r#"
[store]
path = "x.redb"
[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
[[route]]
name = "s3"
api = "s3"
host = "s3.example.com"
path = "/{bucket}/{*key}"
scope = "object/{bucket}/{key}"
upstream = "objects"
"#;

/// A route whose scope ends with its `{*name}` capture says what its backend's API is,
/// and an `api = "webdav"` route is one whose collections can be checked (SPEC §16).
#[test]
fn webdav_routes_and_trees_that_say_their_api() {
    let base = |route: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:8080\"\n[store]\npath = \"m.redb\"\n\
             [[upstream]]\nname = \"dav\"\nurl = \"http://127.0.0.1:9000\"\n\
             [[route]]\nname = \"files\"\nupstream = \"dav\"\n{route}"
        )
    };
    let parse = |route: &str| Config::parse(&base(route), Path::new("."));
    let refused = |route: &str, path: &str, says: &str| {
        let errs = parse(route).unwrap_err().0;
        assert!(
            errs.iter()
                .any(|e| e.path == path && e.message.contains(says)),
            "{route}: {says}: {errs:?}"
        );
    };
    let per_file = "path = \"/files/{*p}\"\nscope = \"file/{p}\"\n";
    refused(per_file, "route[0].api", "say what the backend's API is");
    for api in ["plain", "s3\"\nhost = \"s3.test"] {
        let route = format!("{per_file}api = \"{api}\"\n");
        if api == "plain" {
            let c = parse(&route).expect("plain");
            assert!(!c.routes[0].fences_trees());
        } else {
            // Says its API; what S3 needs besides is checked by `s3_routes`.
            assert!(parse(&route).is_err_and(|e| e.0.iter().all(|e| e.path != "route[0].api")));
        }
    }
    let dav = format!("{per_file}api = \"webdav\"\n");
    let c = parse(&dav).expect("webdav");
    assert!(c.routes[0].fences_trees());
    assert!(c.describe().contains("api webdav"), "{}", c.describe());
    // One scope for a whole tree: no API needed, and a WebDAV route has nothing to check.
    let tree = "path = \"/t/{top}/{*p}\"\nscope = \"tree/{top}\"\n";
    parse(tree).expect("one scope per tree");
    let c = parse(&format!("{tree}api = \"webdav\"\n")).expect("webdav tree");
    assert!(!c.routes[0].fences_trees());
    refused(
        &format!("{dav}fenced = false\n"),
        "route[0].fenced",
        "is fenced",
    );
    refused(
        &format!("{dav}methods = [\"PUT\", \"DELETE\", \"COPY\"]\n"),
        "route[0].methods",
        "leaves out MOVE",
    );
    parse(&format!(
        "{dav}methods = [\"PUT\", \"DELETE\", \"COPY\", \"MOVE\"]\n"
    ))
    .expect("a list with the collection methods");
    refused(
        "path = \"/files/{*p}\"\nscope = \"file/{p}/v\"\napi = \"webdav\"\n",
        "route[0].scope",
        "ends with the `{*name}` capture",
    );
    // A pass-through route needs no API.
    parse("path = \"/files/{*p}\"\nfenced = false\n").expect("pass-through");
    // A WebDAV route and another route that share paths do not fence them alike.
    let twin = base(&format!(
        "{dav}host = \"a.test\"\n[[route]]\nname = \"twin\"\nupstream = \"dav\"\nhost = \"b.test\"\n{per_file}api = \"plain\"\n"
    ));
    assert!(Config::parse(&twin, Path::new(".")).is_err(), "{twin}");
}

/// What an `api = "s3"` route needs (SPEC §15), each refusal at its key.
#[test]
fn s3_routes() {
    let c = Config::parse(S3, Path::new(".")).expect("parses");
    let s3 = c.routes[0].s3().expect("an S3 route");
    assert_eq!(s3.bucket_scope, None);
    assert_eq!(c.routes[0].errors, Dialect::S3, "S3's dialect by default");
    let full = S3.replace(
        "upstream = \"objects\"\n",
        "upstream = \"objects\"\nbucket_scope = \"bucket/{bucket}\"\nvirtual_host_domain = \"S3.Example.com:9000\"\nerrors = \"problem\"\n",
    );
    let c = Config::parse(&full, Path::new(".")).expect("parses");
    let s3 = c.routes[0].s3().expect("an S3 route");
    assert_eq!(
        s3.virtual_host_domain.as_deref(),
        Some("s3.example.com:9000")
    );
    assert_eq!(s3.endpoint, "s3.example.com");
    assert_eq!(
        s3.bucket_scope.as_ref().map(|t| t.to_string()).as_deref(),
        Some("bucket/{bucket}")
    );
    assert_eq!(c.routes[0].errors, Dialect::Problem);
    let with_port = S3.replace(
        "host = \"s3.example.com\"",
        "host = \"S3.example.com:9000\"",
    );
    let c = Config::parse(&with_port, Path::new(".")).expect("an S3 endpoint may carry a port");
    assert_eq!(c.routes[0].host.as_deref(), Some("s3.example.com"));
    assert_eq!(
        c.routes[0].s3().map(|s| s.endpoint.as_str()),
        Some("s3.example.com:9000")
    );
}

/// The keys of an `api = "s3"` route that are refused, each at its key.
#[test]
fn s3_route_keys_are_refused_at_their_key() {
    refused(
        S3.replace("host = \"s3.example.com\"\n", ""),
        "route[0].host",
        "names the endpoint",
    );
    refused(
        S3.replace(
            "path = \"/{bucket}/{*key}\"",
            "path = \"/s3/{bucket}/{*key}\"",
        ),
        "route[0].path",
        "/{bucket}/{*key}",
    );
    refused(
        format!("{S3}methods = [\"PUT\"]\n"),
        "route[0].methods",
        "no methods list",
    );
    refused(
        format!("{S3}fenced = false\n"),
        "route[0].fenced",
        "is fenced",
    );
    refused(
        format!("{S3}bucket_scope = \"b/{{key}}\"\n"),
        "route[0].bucket_scope",
        "only the bucket capture",
    );
    refused(
        format!("{S3}virtual_host_domain = \"http://x\"\n"),
        "route[0].virtual_host_domain",
        "host name",
    );
    refused(
        format!("{S3}virtual_host_domain = \"s3.example.com.\"\n"),
        "route[0].virtual_host_domain",
        "no trailing dot",
    );
    refused(
        S3.replace("api = \"s3\"", "api = \"ftp\""),
        "route[0].api",
        "expected",
    );
    refused(
        S3.replace("api = \"s3\"\n", "").replace(
            "upstream = \"objects\"\n",
            "upstream = \"objects\"\nbucket_scope = \"b\"\n",
        ),
        "route[0].bucket_scope",
        "only for an api",
    );
}

/// An S3 route among others: one per backend, first on its host, and no later route on
/// its host or its backend that would take its objects unread as S3.
#[test]
fn s3_routes_among_others() {
    // A second S3 route on one backend, and a route under an S3 route's virtual hosts.
    let second = format!(
        "{S3}[[route]]\nname = \"other\"\napi = \"s3\"\nhost = \"other.test\"\npath = \"/{{b}}/{{*k}}\"\nscope = \"object/{{b}}/{{k}}\"\nupstream = \"objects\"\n"
    );
    refused(second, "route[1]", "share an upstream");
    let vhosted = S3.replace(
        "upstream = \"objects\"\n",
        "upstream = \"objects\"\nvirtual_host_domain = \"s3.example.com\"\n[[upstream]]\nname = \"web\"\nurl = \"http://127.0.0.1:9001\"\n[[route]]\nname = \"late\"\nhost = \"x.s3.example.com\"\npath = \"/x\"\nupstream = \"web\"\nfenced = false\n",
    );
    refused(vhosted, "route[1]", "can never match");
    // A route before it that takes some of its paths on its host; one after it on its
    // host that it always wins over.
    let before = S3.replace(
        "[[route]]\nname = \"s3\"",
        "[[route]]\nname = \"open\"\npath = \"/{b}\"\nupstream = \"objects\"\nfenced = false\n[[route]]\nname = \"s3\"",
    );
    refused(before, "route[1]", "comes before S3 route `s3`");
    let after = format!(
        "{S3}[[route]]\nname = \"late\"\nhost = \"s3.example.com\"\npath = \"/x\"\nupstream = \"objects\"\nfenced = false\n"
    );
    refused(after, "route[1]", "can never match");
    let elsewhere = format!(
        "{S3}[[upstream]]\nname = \"web\"\nurl = \"http://127.0.0.1:9001\"\n[[route]]\nname = \"late\"\npath = \"/x\"\nupstream = \"web\"\nfenced = false\n"
    );
    Config::parse(&elsewhere, Path::new("."))
        .expect("a host-less route after it takes other hosts");
    // The same on the S3 route's own backend: another host would reach its objects
    // unread as S3 (one object, one scope).
    let same_backend = format!(
        "{S3}[[route]]\nname = \"late\"\npath = \"/x\"\nupstream = \"objects\"\nfenced = false\n"
    );
    refused(same_backend, "route[1]", "the Host header would choose");
}

/// Asserts that `text` is refused with an error at `path` whose message says `says`.
fn refused(text: String, path: &str, says: &str) {
    let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
    assert!(
        errs.iter()
            .any(|e| e.path == path && e.message.contains(says)),
        "{path}: {says}: {errs:?}"
    );
}

/// Credentials in an upstream URL are refused by name, and never echoed.
#[test]
fn upstream_credentials_are_refused_unshown() {
    for url in [
        "http://admin:PASS@127.0.0.1:9",
        "https://PASS@h:1",
        "http://a:PASS@h",
    ] {
        let text = ROUTES.replace("http://127.0.0.1:9000", url);
        let errs = Config::parse(&text, Path::new(".")).unwrap_err().0;
        let e = errs
            .iter()
            .find(|e| e.path == "upstream[0].url")
            .expect("refused");
        assert!(e.message.contains("credentials"), "{e:?}");
        assert!(!format!("{errs:?}").contains("PASS"), "{errs:?}");
    }
}

/// SPEC §9: two routes that can render one scope must agree on what decides it.
#[test]
fn one_scope_one_policy() {
    let routes = |a: &str, b: &str| {
        format!(
            "[store]\npath = \"x.redb\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9000\"\n\
             [[route]]\nname = \"raw\"\npath = \"/raw/{{d}}\"\nscope = \"doc/{{d}}\"\nupstream = \"u\"\n{a}\
             [[route]]\nname = \"docs\"\npath = \"/docs/{{d}}\"\nscope = \"doc/{{d}}\"\nupstream = \"u\"\n{b}"
        )
    };
    for (a, b, setting) in [
        ("", "equal = \"reject\"\n", "equal"),
        ("sequence = \"required\"\n", "", "sequence"),
    ] {
        let errs = Config::parse(&routes(a, b), Path::new(".")).unwrap_err().0;
        assert!(
            errs.iter().any(|e| e.path == "route[1]"
                && e.message.contains("can render the same scope")
                && e.message.contains(&format!("`{setting}`"))),
            "{errs:?}"
        );
    }
    Config::parse(&routes("", ""), Path::new(".")).expect("one policy");
    let apart = routes("", "equal = \"reject\"\n").replace(
        "scope = \"doc/{d}\"\nupstream = \"u\"\nequal",
        "scope = \"doc/{d}/v\"\nupstream = \"u\"\nequal",
    );
    Config::parse(&apart, Path::new(".")).expect("scopes that cannot meet");
}
