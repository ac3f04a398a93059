#!/usr/bin/env python3
"""Writes the committed seed corpora (fuzz/corpus/<target>/) from the cases below: the
smuggling and framing cases of the test suite, and those of published desync research
(request smuggling: CL.TE, TE.CL, TE.TE obfuscations, chunk-size and line-ending tricks).
Run from fuzz/: python3 seeds/make.py. Each file's name is its case's."""
import hashlib
import os

H = "Host: a\r\n"
T = "Fencing-Token: 7\r\n"


def req(line, *headers, body=""):
    return (line + "\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n" + body).encode("latin-1")


# Request streams a client could send (head_scan: a byte of how to cut it, then bytes).
streams = {
    "plain_get": req("GET /a HTTP/1.1", "Host: a"),
    "pipelined": req("GET /a HTTP/1.1", "Host: a") + req("PUT /b HTTP/1.1", "Host: a", "Content-Length: 3", body="abc") + req("DELETE /c HTTP/1.1", "Host: a"),
    "fake_head_in_body": req("PUT /a HTTP/1.1", "Host: a", "Content-Length: 31", body="GET /x#y HTTP/1.1\r\nHost: a\r\n\r\n"),
    "fake_head_in_chunk": req("PUT /b HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="1f;ext=1\r\nGET /x#y HTTP/1.1\r\nHost: a\r\n\r\n\r\n0\r\nX-T: 1\r\n\r\n") + req("GET /c HTTP/1.1", "Host: a"),
    "fragment": req("DELETE /dav/c/#m HTTP/1.1", "Host: a"),
    "cl_te": req("POST / HTTP/1.1", "Host: a", "Content-Length: 6", "Transfer-Encoding: chunked", body="0\r\n\r\nG") + req("GET /x HTTP/1.1", "Host: a"),
    "te_cl": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Content-Length: 3", body="8\r\nSMUGGLED\r\n0\r\n\r\n"),
    "te_te_xchunked": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: xchunked", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_space_before_colon": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding : chunked", body="0\r\n\r\n"),
    "te_tab": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding:\tchunked", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_vtab": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding:\x0bchunked", body="0\r\n\r\n"),
    "te_twice": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Transfer-encoding: x", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_list": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: gzip, chunked", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_chunked_gzip": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked, gzip", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_obs_fold": req("POST / HTTP/1.1", "Host: a", "X: y", " Transfer-Encoding: chunked", body="0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "te_folded_value": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding:", " chunked", body="0\r\n\r\n"),
    "te_newline_before_colon": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding\n: chunked", body="0\r\n\r\n"),
    "te_http10": req("POST / HTTP/1.0", "Host: a", "Connection: keep-alive", "Transfer-Encoding: chunked", body="3\r\nabc\r\n0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_twice_differ": req("POST / HTTP/1.1", "Host: a", "Content-Length: 4", "Content-Length: 5", body="abcde") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_twice_same": req("POST / HTTP/1.1", "Host: a", "Content-Length: 4", "Content-Length: 4", body="abcd") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_list": req("POST / HTTP/1.1", "Host: a", "Content-Length: 4, 4", body="abcd") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_plus": req("POST / HTTP/1.1", "Host: a", "Content-Length: +4", body="abcd") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_hex": req("POST / HTTP/1.1", "Host: a", "Content-Length: 0x4", body="abcd"),
    "cl_leading_zeros": req("PUT / HTTP/1.1", "Content-Length: 000000000000000000001", body="x") + req("DELETE /dav/c/#x HTTP/1.1", "Host: a"),
    "cl_overflow": req("PUT / HTTP/1.1", "Host: a", "Content-Length: 99999999999999999999999") + req("GET /x HTTP/1.1", "Host: a"),
    "cl_space_in": req("POST / HTTP/1.1", "Host: a", "Content-Length: 1 0", body="0123456789"),
    "cl_trailing_ws": req("POST / HTTP/1.1", "Host: a", "Content-Length: 4 \t", body="abcd") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_leading_zeros": req("PUT / HTTP/1.1", "Transfer-Encoding: chunked", body="00000000000000000001\r\ny\r\n0\r\n\r\n") + req("DELETE /dav/c/#x HTTP/1.1", "Host: a"),
    "chunk_size_overflow": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="10000000000000000\r\nx\r\n0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_ext_lf": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="2;a\nb\r\nxx\r\n0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_ext_quoted": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="2;a=\"\r\n0\r\n\r\nGET /y HTTP/1.1\"\r\nxx\r\n0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_bare_lf": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="2\nxx\n0\n\n") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_data_no_crlf": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="2\r\nxxyy0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "chunk_space_size": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="2 \r\nxx\r\n0\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "trailers": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="1\r\nx\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n") + req("GET /x HTTP/1.1", "Host: a"),
    "trailer_bare_lf": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="0\r\nX: 1\n\n") + req("GET /x HTTP/1.1", "Host: a"),
    "lf_only_head": b"GET /a HTTP/1.1\nHost: a\n\nGET /b#f HTTP/1.1\nHost: a\n\n",
    "cr_only": b"GET /a HTTP/1.1\rHost: a\r\r\n\r\n",
    "leading_empty_lines": b"\r\n\r\nGET /a HTTP/1.1\r\nHost: a\r\n\r\n",
    "two_spaces": req("GET  /a HTTP/1.1", "Host: a") + req("GET /b HTTP/1.1", "Host: a"),
    "tab_in_line": req("GET\t/a HTTP/1.1", "Host: a") + req("GET /b HTTP/1.1", "Host: a"),
    "absolute_form": req("PUT http://b/a#x HTTP/1.1", "Host: a", "Content-Length: 0"),
    "absolute_form_plain": req("PUT http://a/reports/s/x HTTP/1.1", "Host: a", T, "Content-Length: 1", body="x"),
    "asterisk": req("OPTIONS * HTTP/1.1", "Host: a"),
    "connect": req("CONNECT a:443 HTTP/1.1", "Host: a") + req("GET /x#y HTTP/1.1", "Host: a"),
    "upgrade": req("GET / HTTP/1.1", "Host: a", "Upgrade: websocket", "Connection: Upgrade") + req("GET /x#y HTTP/1.1", "Host: a"),
    "expect": req("PUT /a HTTP/1.1", "Host: a", "Expect: 100-continue", "Content-Length: 2", body="ab") + req("GET /x HTTP/1.1", "Host: a"),
    "header_no_colon": req("GET /a HTTP/1.1", "Host: a", "Transfer-Encoding chunked") + req("GET /x HTTP/1.1", "Host: a"),
    "header_name_space": req("GET /a HTTP/1.1", "Host: a", "Content Length: 5", body="hello"),
    "nul_in_value": req("GET /a HTTP/1.1", "Host: a", "X: a\x00b"),
    "high_bytes_target": req("PUT /reports/\xff/x HTTP/1.1", "Host: a", "Fencing-Token: 9", "Content-Length: 0"),
    "obs_fold_token": req("PUT /reports/s/x HTTP/1.1", "Host: a", "Fencing-Token: 1", " 2", "Content-Length: 0"),
    "token_twice": req("PUT /reports/s/x HTTP/1.1", "Host: a", "Fencing-Token: 1", "Fencing-Token: 2", "Content-Length: 0"),
    "http09": b"GET /\r\n\r\n",
    "http2_version": req("GET / HTTP/2.0", "Host: a"),
    "http12_version": req("GET / HTTP/1.2", "Host: a"),
    "content_length_te_identity": req("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: identity", "Content-Length: 3", body="abc"),
    "long_header_name_case": req("POST / HTTP/1.1", "Host: a", "TRANSFER-ENCODING: CHUNKED", body="0\r\n\r\n") + req("GET /x#y HTTP/1.1", "Host: a"),
    # Found by this target: a 17-byte name whose ninth byte is not `-` was read as
    # Transfer-Encoding, and the fragment of the next head went unseen.
    "te_lookalike_name": req("POST / HTTP/1.1", "Host: a", "Transfer%Encoding: chunked", body="abcDELETE /dav/c/#x HTTP/1.1\r\nHost: a\r\n\r\n"),
    # Found by this target: a bare LF in a trailer line is no line end to hyper.
    "trailer_lf_lf_then_head": req("PUT / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", body="0\r\nX: 1\n\nGET /a HTTP/1.1\r\n\r\nDELETE /dav/c/#x HTTP/1.1\r\nHost: a\r\n\r\n"),
    "content_length_cr_name": req("POST / HTTP/1.1", "Host: a", "Content-Length\r: 3", body="abc"),
}

# Request heads and bodies for the forwarded target (flag byte: bit 0 trusted).
forwarded = {
    "plain_put": req("PUT /reports/s/x?v=1 HTTP/1.1", "Host: a", T, "Content-Length: 3", body="abc"),
    "connection_lists": req("PUT /a HTTP/1.1", "Host: a", T, "Connection: keep-alive, x-a, fencing-token, host, content-length", "X-A: 1", body="abc"),
    "hop_by_hop": req("PUT /a HTTP/1.1", "Host: a", T, "TE: trailers", "Trailer: X", "Upgrade: h2c", "Keep-Alive: 5", "Proxy-Connection: x", "Transfer-Encoding: chunked", body="abc"),
    "forwarding_headers": req("PUT /a HTTP/1.1", "Host: a", T, "X-Forwarded-For: 1.2.3.4", "X-Forwarded-Proto: https", "Forwarded: for=1", "X-Real-IP: 1", body=""),
    "expect": req("PUT /a HTTP/1.1", "Host: a", T, "Expect: 100-continue", body="xy"),
    "absolute_form": req("PUT http://a:80/a/b?c HTTP/1.1", T, body="x"),
    "no_host_http10": req("PUT /a HTTP/1.0", T, body="x"),
    "empty_value": req("DELETE /a HTTP/1.1", "Host: a", T, "X-E:", "Content-Length: 0"),
    "peer_header": req("PUT /a HTTP/1.1", "Host: a", T, "Fencegate-Peer: k", body="x"),
    "cookie_twice": req("PUT /a HTTP/1.1", "Host: a", T, "Cookie: a=1", "Cookie: b=2", body="x"),
    "body_looks_like_request": req("PUT /a HTTP/1.1", "Host: a", T, body="\r\n\r\nGET /admin HTTP/1.1\r\nHost: a\r\n\r\n"),
}

# Upstream answers (response: flag byte: bit 0 HEAD, the rest how to cut).
responses = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\n\r\nok",
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;e=1\r\nok\r\n0\r\nX-T: 1\r\n\r\n",
    "close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    "interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n",
    "switching": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    "cl_te": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    "cl_twice": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
    "cl_list": b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nab",
    "te_gzip_chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "te_chunked_twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "no_content_with_length": b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
    "not_modified": b"HTTP/1.1 304 Not Modified\r\nContent-Length: x\r\n\r\n",
    "http10": b"HTTP/1.0 200 OK\r\n\r\nbody",
    "obs_fold": b"HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\nContent-Length: 0\r\n\r\n",
    "lf_only": b"HTTP/1.1 200 OK\nContent-Length: 1\n\nx",
    "chunk_bare_lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\nx\r\n0\r\n\r\n",
    "chunk_overflow": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000000\r\nx\r\n0\r\n\r\n",
    "status_999": b"HTTP/1.1 999 X\r\nContent-Length: 0\r\n\r\n",
    "no_reason": b"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
    # Found by this target: a malformed trailer line, which hyper's client refuses.
    "trailer_malformed": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;e=1\r\nok\r\n0\r\nX-T+# 1\r\n\r\n",
    # Found by this target: chunked framing in an HTTP/1.0 response.
    "http10_chunked": b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    # Found by this target: a trailer line with a bare LF inside (two fields to httparse).
    "trailer_bare_lf_inside": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nA: 1\nB: 2\r\n\r\n",
    # Found by this target: `chunked,` is no chunked framing to hyper's client.
    "te_chunked_empty_element": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked,\r\n\r\n0\r\n\r\n",
    "space_before_colon": b"HTTP/1.1 200 OK\r\nContent-Length : 1\r\n\r\nx",
}

configs = {
    "minimal": b'[server]\nlisten = "127.0.0.1:8080"\n[[upstream]]\nname = "u"\nurl = "http://127.0.0.1:9000"\n[[route]]\npath = "/reports/{id}/{*rest}"\nscope = "reports/{id}"\nupstream = "u"\napi = "plain"\n',
    "s3": b'[[upstream]]\nname = "s"\nurl = "http://127.0.0.1:9000"\n[[route]]\nhost = "s3.local"\npath = "/{bucket}/{*key}"\nscope = "{bucket}/{key}"\nupstream = "s"\napi = "s3"\n',
    "webdav": b'[[upstream]]\nname = "d"\nurl = "http://127.0.0.1:9000"\n[[route]]\npath = "/dav/{*p}"\nscope = "dav/{p}"\nupstream = "d"\napi = "webdav"\n',
    "bad_types": b'[server]\nlisten = 5\nmax_headers = "x"\n[fencing]\nheader = "bad header"\n[[route]]\npath = "x"\n',
    "unknown": b'[nope]\na = 1\n[server]\nzzz = 1\n',
    "tls": b'[server]\nlisten = "127.0.0.1:8443"\n[server.tls]\ncert = "c.pem"\nkey = "k.pem"\n',
    "cluster": b'[cluster]\nname = "a"\n[authority]\nbackend = "etcd"\n',
    "not_toml": b'[[route\npath = ',
    # Found by this target: an empty top-level key had an empty path.
    "empty_key": b'"" = 1\n',
    "idempotency": b'[idempotency]\nttl = "1h"\nmax_records = -1\n',
}

tokens = {
    "plain": b"42\xff/reports/a/b\xff\x00\xff/reports/{id}/{*rest}\xffreports/{id}/{rest}",
    "epoch": b"3:42\xff/a%2Fb/c\xff\x01\xff/{a}/{b}\xff{a}:{b}",
    "escapes": b"0\xff/caf%C3%A9/%7e/x%3Bd\xff\xff\xff/{a}/{*r}\xffs/{a}/{r}",
    "raw_utf8": b"18446744073709551615\xff/caf\xc3\xa9/a b\xff\xaa\xff/{*r}\xff{r}",
    "dots": b"01\xff/a/%2e%2E/b\xff\xff/x/{a}\xff{a}",
    "semicolon": b"1:\xff/a;b/c\xff\xff/{a}\xff{a}",
    "trailing": b":\xff/a/b/\xff\x80\xff/{a}/{b}\xff{b}/{a}",
    "backslash": b"\xff/a%5cb\xff\xff/{a}\xff{a}",
    "root": b"1\xff/\xff\xff/\xffroot",
}


def digest(b):
    return hashlib.sha1(b).hexdigest()[:16]


def write(target, name, data):
    d = os.path.join("corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


for name, data in streams.items():
    write("head_scan", name, b"\x00" + data)
    write("head_scan", name + "_cut7", b"\x07" + data)
    write("head_scan", name + "_cut1", b"\x01" + data)
for name, data in forwarded.items():
    write("forwarded", name, b"\x00" + data)
    write("forwarded", name + "_trusted", b"\x01" + data)
for name, data in responses.items():
    write("response", name, b"\x00" + data)
    write("response", name + "_head", b"\x01" + data)
    write("response", name + "_cut3", b"\x06" + data)
for name, data in configs.items():
    write("config", name, data)
for name, data in tokens.items():
    write("token_path_scope", name, data)
# Journal: even first byte, raw bytes after a header; odd, entries and a bit to flip.
write("journal", "raw_zeros", b"\x00" + bytes(48))
write("journal", "raw_record_header", b"\x00" + (8).to_bytes(4, "little") + bytes(4) + (1).to_bytes(8, "little") + bytes(8) + bytes(8))
write("journal", "entries", b"\x01\x10\x00" + b"\x03abc" + bytes(17) + b"\x05scope" + b"\x01" * 17)
write("journal", "entries_flip_header", b"\x01\x05\x00" + b"\x03abc" + bytes(17))
# Found by this target: a flip in bytes 4..8 of a record's header (not under its check).
write("journal", "entries_flip_record_padding", b"\x01" + (8 * 28 + 3).to_bytes(2, "little") + b"\x03abc" + bytes(17))
write("journal", "entries_flip_last", b"\x01\xff\x01" + b"\x02ab" + b"\x07" * 17)
