"""boto3 against fencegate in front of a SigV4-checking S3 server (tests/it/s3.rs runs it).

    python s3_sdk.py ENDPOINT ACCESS_KEY SECRET_KEY

Each fenced request carries its token in a `Fencing-Token` header added in botocore's
`before-sign` event, so the header is signed with the rest (SigV4 signs every header but
a few such as User-Agent and Expect); one put adds it in `before-send`, after signing, to
show an unsigned token header verifies too. Prints one line per step; any failure is an
exception and a non-zero exit.
"""

import socket
import sys

# The endpoint is http://s3.test:PORT (the S3 route's host): s3.test resolves to
# 127.0.0.1 in this process only.
_getaddrinfo = socket.getaddrinfo


def loopback(host, *args, **kwargs):
    if isinstance(host, str) and (host == "s3.test" or host.endswith(".s3.test")):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = loopback

import boto3  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

endpoint, access_key, secret_key = sys.argv[1:4]

s3 = boto3.client(
    "s3",
    endpoint_url=endpoint,
    aws_access_key_id=access_key,
    aws_secret_access_key=secret_key,
    region_name="us-east-1",
    config=Config(
        s3={"addressing_style": "path"},
        # A refusal is final for this test: no retry hides how many requests were made.
        retries={"mode": "standard", "max_attempts": 1},
        # s3s-fs 0.14.1 keeps a PutObject's checksum on the object when a multipart upload
        # completes over it, so the GET below would fail botocore's response checksum
        # check (as it does straight against s3s-fs, without fencegate). Requests still
        # carry their checksums, which s3s-fs verifies.
        response_checksum_validation="when_required",
    ),
)

# The token of the next request(s), or None for none.
token = {"signed": None, "unsigned": None}


def add_signed(request, **_):
    if token["signed"] is not None:
        request.headers["Fencing-Token"] = token["signed"]


def add_unsigned(request, **_):
    # Here the request is signed already: note whether the token header is covered.
    auth = request.headers.get("Authorization", b"")
    auth = auth.decode() if isinstance(auth, bytes) else auth
    signed["last"] = "fencing-token" in auth.split("SignedHeaders=")[-1].split(",")[0].split(";")
    if token["unsigned"] is not None:
        request.headers["Fencing-Token"] = token["unsigned"]


signed = {"last": None}


s3.meta.events.register("before-sign.s3.*", add_signed)
s3.meta.events.register("before-send.s3.*", add_unsigned)


def with_token(t, unsigned=False):
    token["signed"] = None if unsigned else t
    token["unsigned"] = t if unsigned else None


def refused(what, call, **kwargs):
    """`call` must raise ClientError with code StaleFence; prints what boto3 surfaced."""
    try:
        call(**kwargs)
    except ClientError as e:
        err = e.response["Error"]
        meta = e.response["ResponseMetadata"]
        print(
            f"{what}: refused code={err.get('Code')} status={meta['HTTPStatusCode']} "
            f"result={meta['HTTPHeaders'].get('fencing-result')} "
            f"scope={err.get('Scope')} presented={err.get('Presented')} "
            f"highest={err.get('HighestAccepted')} message={err.get('Message')}"
        )
        assert err.get("Code") == "StaleFence", e.response
        assert meta["HTTPStatusCode"] == 409, e.response
        return
    raise AssertionError(f"{what}: not refused")


bucket, key = "reports", "2026/july.csv"

# A request on the bucket itself: fenced on the route's bucket_scope.
with_token("1")
s3.create_bucket(Bucket=bucket)
print("create_bucket: ok")

with_token("5")
s3.put_object(Bucket=bucket, Key=key, Body=b"token 5\n")
assert signed["last"] is True, "the token header added in before-sign is signed"
print("put token 5: ok")

with_token("6")
up = s3.create_multipart_upload(Bucket=bucket, Key=key)
part1 = b"token 6 part 1 " + b"x" * (5 * 1024 * 1024)
part2 = b"token 6 part 2\n"
parts = []
for n, body in ((1, part1), (2, part2)):
    r = s3.upload_part(
        Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=body
    )
    parts.append({"ETag": r["ETag"], "PartNumber": n})
s3.complete_multipart_upload(
    Bucket=bucket,
    Key=key,
    UploadId=up["UploadId"],
    MultipartUpload={"Parts": parts},
)
print("multipart token 6: ok")

with_token("4")
refused("put token 4", s3.put_object, Bucket=bucket, Key=key, Body=b"token 4\n")
refused("delete token 4", s3.delete_object, Bucket=bucket, Key=key)

with_token(None)
got = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
assert got == part1 + part2, got[:64]
print(f"get: token 6 content ({len(got)} bytes)")

# The token header added after signing (not in SignedHeaders) verifies as well; on
# another key, so the object above stays as it is.
with_token("7", unsigned=True)
s3.put_object(Bucket=bucket, Key="unsigned-token", Body=b"token 7\n")
assert signed["last"] is False, "the token header added in before-send is not signed"
with_token("3", unsigned=True)
refused("unsigned put token 3", s3.put_object, Bucket=bucket, Key="unsigned-token", Body=b"3")
print("unsigned token header: ok")

# The server does check signatures: a wrong secret is refused by it, through fencegate.
bad = boto3.client(
    "s3",
    endpoint_url=endpoint,
    aws_access_key_id=access_key,
    aws_secret_access_key=secret_key + "x",
    region_name="us-east-1",
    config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
)
try:
    bad.get_object(Bucket=bucket, Key=key)
    raise AssertionError("a wrong secret was accepted")
except ClientError as e:
    code = e.response["Error"].get("Code")
    print(f"wrong secret: refused by the server code={code}")
    assert code == "SignatureDoesNotMatch", e.response
print("s3 sdk: all ok")
