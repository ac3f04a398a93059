//! The example configurations in `config/` stay valid, and `check-config` shows an
//! operator every error of a broken file at once, each with its key path.
//!
//! These run the real binary, the way an operator does.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn check_config(file: &Path, cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["check-config", "--config"])
        .arg(file)
        .current_dir(cwd)
        .output()
        .expect("running fencegate check-config")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Every `*.toml` in `config/`, sorted.
fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("reading config/").path())
        .filter(|p| p.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_example_config_is_valid_and_lists_its_routes() {
    let files = examples();
    let names: Vec<String> = files
        .iter()
        .filter_map(|f| f.file_name()?.to_str().map(str::to_string))
        .collect();
    for want in ["edge.toml", "sidecar.toml"] {
        assert!(names.iter().any(|n| n == want), "config/{want} is missing");
    }

    // Run from elsewhere: relative paths in a config must not depend on the working dir.
    let cwd = tempfile::tempdir().expect("tempdir");
    for file in &files {
        let out = check_config(file, cwd.path());
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(
            out.status.success(),
            "{} was refused ({:?}):\n{stderr}",
            file.display(),
            out.status.code()
        );

        let raw: toml::Table = std::fs::read_to_string(file)
            .expect("reading example")
            .parse()
            .expect("example is TOML");
        let routes = raw
            .get("route")
            .and_then(|r| r.as_array())
            .unwrap_or_else(|| panic!("{} has no [[route]]", file.display()));
        assert!(!routes.is_empty());
        for route in routes {
            let name = route
                .get("name")
                .and_then(|n| n.as_str())
                .expect("route name");
            let listed = stdout.lines().any(|line| {
                let mut words = line.split_whitespace();
                words.next() == Some("route") && words.next() == Some(name)
            });
            assert!(
                listed,
                "{}: route `{name}` not listed in:\n{stdout}",
                file.display()
            );
        }

        // A relative store path resolves against the config file's directory.
        let store = raw["store"]["path"].as_str().expect("store.path");
        let expected = file.parent().expect("config dir").join(store);
        assert!(
            stdout.contains(&format!("store {}", expected.display())),
            "{}: store path {store:?} should resolve to {}:\n{stdout}",
            file.display(),
            expected.display()
        );
    }
}

const BROKEN: &str = r#"
[server]
listen = "127.0.0.1:8080"
colour = "blue"                 # unknown key

[store]
path = "marks.redb"

[fencing]
drain_timeout = "30s"
settle = "soon"                 # not a duration

[[upstream]]
name = "objects"
url = "http://127.0.0.1:9000"
timeout = "10 fortnights"       # not a duration

[[route]]
name = "files"
path = "/files/{*rest}"
scope = "files"
upstream = "objects"

[[route]]
name = "orphan"
path = "/other/{item}"
scope = "other/{item}"
upstream = "nowhere"            # no such upstream

[[route]]
name = "late"
path = "/files/archive/{item}"  # /files/{*rest} above always wins
scope = "archive/{item}"
upstream = "objects"

[[route]]
name = "typo"
path = "/typo/{item}"
scop = "typo/{item}"            # unknown key
upstream = "objects"
"#;

#[test]
fn broken_config_reports_every_error_with_its_key_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("broken.toml");
    std::fs::write(&file, BROKEN).expect("writing broken.toml");

    let out = check_config(&file, dir.path());
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(1),
        "a broken config must exit 1\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        !stdout.contains("OK"),
        "a broken config must not be reported OK:\n{stdout}"
    );

    // (key path, a word the message must contain)
    let expected = [
        ("server", "colour"),
        ("fencing.settle", "soon"),
        ("upstream[0].timeout", "fortnights"),
        ("route[1].upstream", "nowhere"),
        ("route[2]", "never match"),
        ("route[3]", "scop"),
    ];
    let lines: Vec<&str> = stderr.lines().map(str::trim).collect();
    for (path, word) in expected {
        let prefix = format!("{path}: ");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&prefix) && l.contains(word)),
            "no `{path}: ...{word}...` error on stderr:\n{stderr}"
        );
    }
    // Nothing but the errors: no line blames a route that is fine.
    assert!(
        !lines.iter().any(|l| l.starts_with("route[0]")),
        "route[0] is valid but was blamed:\n{stderr}"
    );
}
