//! A client that takes none of its answer (`server.send_timeout`): over HTTP/1.1 it stops
//! reading the socket; over HTTP/2 it reads the socket and answers pings but grants no
//! flow-control window. Either way its connection is closed, and the upstream connection
//! its answer came from is let go, instead of both being held for as long as the client
//! likes (one HTTP/2 connection could hold 256 upstream connections so).

use crate::support;

use std::net::SocketAddr;

use support::BOUND;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;

/// Far more than the socket buffers on either side of the proxy hold.
const BIG: usize = 64 << 20;

/// An upstream that answers one request with a `BIG` body, writing until the proxy lets
/// the connection go; says how many bytes it wrote then.
async fn big_upstream() -> (SocketAddr, oneshot::Receiver<usize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "request cut short");
            head.extend_from_slice(&buf[..n]);
        }
        let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n");
        conn.write_all(answer.as_bytes()).await.unwrap();
        let chunk = vec![b'x'; 64 << 10];
        let mut sent = 0;
        // Bounded: the whole body at most.
        while sent < BIG {
            match conn.write(&chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => sent += n,
            }
        }
        let _ = tx.send(sent);
    });
    (addr, rx)
}

async fn proxy_for(upstream: SocketAddr, dir: &std::path::Path) -> fencegate::app::Running {
    let text = support::config_text(upstream, "10s", "0s", "30s").replace(
        "shutdown_timeout = \"10s\"",
        "shutdown_timeout = \"10s\"\nsend_timeout = \"1s\"",
    );
    let config = fencegate::settings::Config::parse(&text, dir).expect("config");
    support::start(config).await
}

#[tokio::test]
async fn an_http1_client_that_stops_reading_is_let_go() {
    let (upstream, released) = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(upstream, dir.path()).await;
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut client = socket.connect(proxy.proxy_addr).await.unwrap();
    client
        .write_all(b"GET /public/big HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    // Nothing is read. The upstream connection is let go once the proxy's writes to the
    // client have made no progress for send_timeout.
    let sent = tokio::time::timeout(BOUND, released)
        .await
        .expect("the upstream connection is let go within bound")
        .unwrap();
    assert!(sent < BIG, "the whole body went out: {sent}");
    // And the client's connection was closed: what it can still read ends short.
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(BOUND, client.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got += n,
            Err(_) => panic!("the connection stayed open"),
        }
    }
    assert!(got < BIG, "{got}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_http2_stream_that_gets_no_window_is_let_go() {
    let (upstream, released) = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(upstream, dir.path()).await;
    let tcp = tokio::net::TcpStream::connect(proxy.proxy_addr)
        .await
        .unwrap();
    // The socket is read (and pings answered) all along; the stream gets no window.
    let (h2, conn) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let req = http::Request::get(format!("http://{}/public/big", proxy.proxy_addr))
        .body(())
        .unwrap();
    let (resp, _) = h2.send_request(req, true).unwrap();
    let resp = tokio::time::timeout(BOUND, resp).await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    let sent = tokio::time::timeout(BOUND, released)
        .await
        .expect("the upstream connection is let go within bound")
        .unwrap();
    assert!(sent < BIG, "the whole body went out: {sent}");
    // The connection was closed by the proxy.
    let ended = tokio::time::timeout(BOUND, conn).await;
    assert!(ended.is_ok(), "the HTTP/2 connection stayed open");
    drop(resp);
    proxy.shutdown().await;
}
