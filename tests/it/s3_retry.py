"""boto3's own retry of a keyed PutObject whose answer was lost (tests/it/s3.rs runs it).

    python s3_retry.py FENCEGATE_PORT ACCESS_KEY SECRET_KEY

boto3 talks to a lossy hop in this process (a load balancer, say), which forwards every
request to fencegate as it came: the endpoint is fencegate's (http://s3.test:PORT, the
Host its S3 route takes), and s3.test resolves to the hop. The first keyed PutObject reaches fencegate, which
forwards and records it; the hop then drops that answer and says 503 instead. botocore
retries: it builds and signs the request anew (a later X-Amz-Date, hence another
Authorization, and `amz-sdk-request: attempt=2`). fencegate must take it for the same
request and replay the stored answer (`duplicate`), not answer it `key_reused`, and the
backend must see one PutObject. The same key with another `x-amz-meta-*` or
`Content-Type` is another request: 422 `key_reused`. Prints one line per step; any
failure is an exception and a non-zero exit.
"""

import http.client
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The endpoint is http://s3.test:PORT (the S3 route's host, fencegate's port): in this
# process only, s3.test resolves to the hop, on loopback at a port of its own.
_getaddrinfo = socket.getaddrinfo
hop_port = []


def loopback(host, port, *args, **kwargs):
    if isinstance(host, str) and (host == "s3.test" or host.endswith(".s3.test")):
        host, port = "127.0.0.1", hop_port[0]
    return _getaddrinfo(host, port, *args, **kwargs)


socket.getaddrinfo = loopback

import boto3  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

fencegate_port, access_key, secret_key = sys.argv[1:4]
fencegate_port = int(fencegate_port)

# What fencegate answered each attempt the hop forwarded: (status, Fencing-Result).
answers = []
# Idempotency keys whose first answer the hop is to lose.
lose_first = set()
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class Hop(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_):
        pass

    def relay(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        conn = http.client.HTTPConnection("127.0.0.1", fencegate_port, timeout=30)
        # The head as it came (Host included, which SigV4 signs), in its order.
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in HOP_BY_HOP:
                conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        answers.append((resp.status, resp.getheader("fencing-result")))
        key = self.headers.get("Idempotency-Key")
        if key in lose_first:
            lose_first.discard(key)
            # Lost on the way back. A new second of SigV4 time before the client hears
            # of it, so that its retry is signed with another X-Amz-Date.
            time.sleep(1.1)
            lost = b"<Error><Code>ServiceUnavailable</Code><Message>lost</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(lost)))
            self.end_headers()
            self.wfile.write(lost)
            return
        self.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay


hop = ThreadingHTTPServer(("127.0.0.1", 0), Hop)
hop_port.append(hop.server_address[1])
threading.Thread(target=hop.serve_forever, daemon=True).start()

s3 = boto3.client(
    "s3",
    endpoint_url=f"http://s3.test:{fencegate_port}",
    aws_access_key_id=access_key,
    aws_secret_access_key=secret_key,
    region_name="us-east-1",
    config=Config(
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "max_attempts": 3},
    ),
)

# The token and Idempotency-Key of the next call, signed with the rest of the request.
call = {"token": None, "key": None}
# The headers of each attempt as botocore sent it (after signing).
sent = []


def add_fencing(request, **_):
    request.headers["Fencing-Token"] = call["token"]
    request.headers["Idempotency-Key"] = f'"{call["key"]}"'
    # The backend is fencegate's test double: this asks it for S3's answer to a
    # PutObject, a 200 with no body (botocore takes a 200 with a body that is not XML
    # for a broken S3 error).
    request.headers["X-Test-Status"] = "200"


def note_attempt(request, **_):
    headers = {}
    for name, value in request.headers.items():
        headers[name.lower()] = value.decode() if isinstance(value, bytes) else value
    sent.append(headers)


s3.meta.events.register("before-sign.s3.PutObject", add_fencing)
s3.meta.events.register("before-send.s3.PutObject", note_attempt)

bucket, key = "bkt", "reports/july.csv"
call.update(token="5", key="put-1")
lose_first.add('"put-1"')
r = s3.put_object(Bucket=bucket, Key=key, Body=b"rows\n", Metadata={"owner": "a"})
assert r["ResponseMetadata"]["HTTPStatusCode"] == 200, r
results = ",".join(f"{status} {result}" for status, result in answers)
print(f"retry after 503: ok attempts={len(sent)} fencegate={results}")
assert len(sent) == 2, sent
assert answers == [(200, "accepted"), (200, "duplicate")], answers
first, retry = sent
changed = sorted(
    name
    for name in ("x-amz-date", "authorization", "amz-sdk-request")
    if first.get(name) != retry.get(name)
)
print(f"retry re-signed: {' '.join(changed)} changed")
attempt = [p.strip() for p in retry.get("amz-sdk-request", "").split(";") if "attempt=" in p]
print(f"retry attempt header: {' '.join(attempt)}")

# The same key for another request: refused by fencegate, which botocore does not retry.
for what, extra in (
    ("other metadata", {"Metadata": {"owner": "b"}}),
    ("other content type", {"Metadata": {"owner": "a"}, "ContentType": "text/csv"}),
):
    answers.clear()
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=b"rows\n", **extra)
        raise AssertionError(f"{what}: answered as a duplicate")
    except ClientError as e:
        meta = e.response["ResponseMetadata"]
        result = meta["HTTPHeaders"].get("fencing-result")
        print(f"{what}, same key: refused status={meta['HTTPStatusCode']} result={result}")
        assert (meta["HTTPStatusCode"], result) == (422, "key_reused"), e.response

hop.shutdown()
print("s3 retry: all ok")
