//! Proves the nginx test harness in `tests/it/support/nginx.rs` works: each
//! flavour starts, answers real HTTP/1.1 over loopback, and dropping it leaves
//! no process, listening socket or directory behind.
//!
//! The HTTP client is deliberately raw `std::net::TcpStream` with
//! `Connection: close`, so these tests depend on nothing but std.

use crate::support::nginx;

use std::fs;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use nginx::Nginx;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// One HTTP/1.1 request on a fresh connection; reads until the server closes.
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;

    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;

    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;

    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad(format!("no header terminator in {raw:?}")))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|e| bad(e.to_string()))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {status_line:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    let mut body = raw[split + 4..].to_vec();
    let response = Response {
        status,
        headers,
        body: Vec::new(),
    };
    if method != "HEAD" {
        if let Some(len) = response.header("content-length") {
            let len: usize = len.parse().map_err(|_| bad("bad content-length"))?;
            if body.len() != len {
                return Err(bad(format!(
                    "content-length {len} but got {} bytes",
                    body.len()
                )));
            }
        }
    } else {
        body.clear();
    }
    Ok(Response { body, ..response })
}

#[test]
fn webdav_put_get_and_silent_overwrite() -> io::Result<()> {
    let dav = Nginx::webdav()?;
    assert_eq!(dav.addr().port(), dav.port());
    assert!(dav.addr().ip().is_loopback());

    // PUT creates the intermediate collections (create_full_put_path).
    let put = request(dav.addr(), "PUT", "/a/b/c.txt", &[], b"first version")?;
    assert_eq!(put.status, 201, "first PUT creates");

    let get = request(dav.addr(), "GET", "/a/b/c.txt", &[], b"")?;
    assert_eq!(get.status, 200);
    assert_eq!(get.body, b"first version");

    let head = request(dav.addr(), "HEAD", "/a/b/c.txt", &[], b"")?;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("13"));

    let on_disk = dav.root().join("a/b/c.txt");
    assert_eq!(fs::read(&on_disk)?, b"first version");

    // No conditional writes: even `If-None-Match: *` (create-only) does not
    // stop nginx from overwriting. This is the gap fencing has to close.
    let put2 = request(
        dav.addr(),
        "PUT",
        "/a/b/c.txt",
        &[("If-None-Match", "*")],
        b"second",
    )?;
    assert_eq!(put2.status, 204, "second PUT overwrites silently");
    assert_eq!(
        request(dav.addr(), "GET", "/a/b/c.txt", &[], b"")?.body,
        b"second"
    );
    assert_eq!(fs::read(&on_disk)?, b"second");

    let missing = request(dav.addr(), "GET", "/nope", &[], b"")?;
    assert_eq!(missing.status, 404);

    let delete = request(dav.addr(), "DELETE", "/a/b/c.txt", &[], b"")?;
    assert_eq!(delete.status, 204);
    assert!(!on_disk.exists());
    Ok(())
}

#[test]
fn null_answers_204_to_everything() -> io::Result<()> {
    let null = Nginx::null()?;
    for (method, path, body) in [
        ("GET", "/", &b""[..]),
        ("PUT", "/x/y", &b"payload"[..]),
        ("POST", "/anything?q=1", &b"{}"[..]),
        ("DELETE", "/gone", &b""[..]),
    ] {
        let response = request(null.addr(), method, path, &[], body)?;
        assert_eq!(response.status, 204, "{method} {path}");
        assert!(response.body.is_empty());
    }
    Ok(())
}

#[test]
fn proxy_pass_in_front_of_null() -> io::Result<()> {
    let null = Nginx::null()?;
    let proxy = Nginx::proxy_pass(null.port(), 2)?;
    assert_ne!(proxy.port(), null.port());
    for _ in 0..3 {
        let response = request(proxy.addr(), "PUT", "/bucket/key", &[], b"body")?;
        assert_eq!(response.status, 204);
    }

    // Proves the 204 came through the upstream: with the upstream gone the
    // proxy must fail (502), not answer 204 itself.
    drop(null);
    let response = request(proxy.addr(), "GET", "/", &[], b"")?;
    assert_eq!(response.status, 502);
    Ok(())
}

#[test]
fn proxy_pass_rejects_zero_workers() {
    let err = Nginx::proxy_pass(1, 0).err().map(|e| e.kind());
    assert_eq!(err, Some(io::ErrorKind::InvalidInput));
}

fn proc_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn worker_pids(master: u32) -> Vec<u32> {
    fs::read_to_string(format!("/proc/{master}/task/{master}/children"))
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn drop_stops_master_workers_and_port() -> io::Result<()> {
    let proxy_null = Nginx::null()?;
    // Two workers so the test also covers worker teardown.
    let nginx = Nginx::proxy_pass(proxy_null.port(), 2)?;
    let addr = nginx.addr();
    let master = nginx.pid();
    let prefix = nginx
        .root()
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| bad("root has no parent"))?;
    // The master forks its workers after it starts listening: wait (bounded) for both.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut workers = worker_pids(master);
    while workers.len() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        workers = worker_pids(master);
    }

    assert!(proc_alive(master));
    assert_eq!(workers.len(), 2, "expected 2 workers, got {workers:?}");
    assert!(TcpStream::connect_timeout(&addr, IO_TIMEOUT).is_ok());
    assert!(prefix.is_dir());

    drop(nginx);

    assert!(!proc_alive(master), "master {master} still running");
    for worker in workers {
        assert!(!proc_alive(worker), "worker {worker} still running");
    }
    let after = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
    assert!(
        matches!(&after, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
        "port {} still reachable after drop: {after:?}",
        addr.port()
    );
    assert!(!prefix.exists(), "prefix {} not removed", prefix.display());
    Ok(())
}

#[test]
fn many_instances_start_in_parallel() -> io::Result<()> {
    let handles: Vec<_> = (0..8).map(|_| std::thread::spawn(Nginx::null)).collect();
    let mut servers = Vec::new();
    for handle in handles {
        let server = handle
            .join()
            .map_err(|_| io::Error::other("starter thread panicked"))??;
        servers.push(server);
    }
    let mut ports: Vec<u16> = servers.iter().map(Nginx::port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), servers.len(), "ports must be distinct");
    for server in &servers {
        assert_eq!(request(server.addr(), "GET", "/", &[], b"")?.status, 204);
    }
    Ok(())
}
