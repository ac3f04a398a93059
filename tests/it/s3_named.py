"""boto3 against fencegate's api = "s3" route in front of s3s-fs (tests/it/s3.rs runs it):
the ways S3 names an object outside the path, each refused with a stale token and with
none, the object intact; and each passing with the current token.

    python s3_named.py PORT ACCESS_KEY SECRET_KEY

The endpoint is http://s3.test:PORT; s3.test and its subdomains resolve to 127.0.0.1 in
this process only, so virtual-hosted requests (Host: bkt.s3.test:PORT) reach fencegate
on loopback. Prints one line per step; any failure is an exception and a non-zero exit.
"""

import socket
import sys

_getaddrinfo = socket.getaddrinfo


def loopback(host, *args, **kwargs):
    if isinstance(host, str) and (host == "s3.test" or host.endswith(".s3.test")):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = loopback

import boto3  # noqa: E402
import urllib3  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

port, access_key, secret_key = sys.argv[1:4]
endpoint = f"http://s3.test:{port}"
token = {"value": None}


def client(style):
    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": style},
            retries={"mode": "standard", "max_attempts": 1},
            response_checksum_validation="when_required",
        ),
    )

    def add(request, **_):
        if token["value"] is not None:
            request.headers["Fencing-Token"] = token["value"]

    c.meta.events.register("before-sign.s3.*", add)
    return c


path = client("path")
virtual = client("virtual")


def with_token(t):
    token["value"] = t


def refused(what, code, status, call, **kwargs):
    """`call` must raise ClientError with `code` and `status`."""
    try:
        call(**kwargs)
    except ClientError as e:
        err = e.response["Error"]
        meta = e.response["ResponseMetadata"]
        print(
            f"{what}: refused code={err.get('Code')} status={meta['HTTPStatusCode']} "
            f"result={meta['HTTPHeaders'].get('fencing-result')} scope={err.get('Scope')}"
        )
        assert err.get("Code") == code, e.response
        assert meta["HTTPStatusCode"] == status, e.response
        return
    raise AssertionError(f"{what}: not refused")


def content(key):
    with_token(None)
    return path.get_object(Bucket=bucket, Key=key)["Body"].read()


def form_upload(key, data, fencing_token):
    """A browser-form upload (POST /bucket, multipart/form-data), as boto3 presigns it."""
    post = path.generate_presigned_post(bucket, key)
    fields = list(post["fields"].items()) + [("file", ("upload.csv", data))]
    headers = {} if fencing_token is None else {"Fencing-Token": fencing_token}
    return urllib3.request("POST", post["url"], fields=fields, headers=headers)


bucket, key, other = "bkt", "reports/july.csv", "reports/august.csv"

with_token("1")
path.create_bucket(Bucket=bucket)
print("create_bucket token 1 (bucket scope): ok")
with_token("6")
path.put_object(Bucket=bucket, Key=key, Body=b"six")
path.put_object(Bucket=bucket, Key=other, Body=b"six")
print("put token 6: ok")

# DeleteObjects names its keys in the XML body.
delete_one = {"Objects": [{"Key": key}]}
with_token("5")
refused("delete_objects token 5", "StaleFence", 409, path.delete_objects, Bucket=bucket, Delete=delete_one)
with_token(None)
refused("delete_objects no token", "MissingFencingToken", 428, path.delete_objects, Bucket=bucket, Delete=delete_one)
with_token("7")
both = {"Objects": [{"Key": key}, {"Key": other}]}
refused("delete_objects two scopes", "MultiScope", 400, path.delete_objects, Bucket=bucket, Delete=both)
assert content(key) == b"six" and content(other) == b"six"
print("delete_objects: object intact")

# A browser-form upload names its key in a form field.
r = form_upload(key, b"five", "5")
print(f"form upload token 5: status={r.status} result={r.headers.get('fencing-result')}")
assert r.status == 409 and b"<Code>StaleFence</Code>" in r.data, r.data
r = form_upload(key, b"none", None)
print(f"form upload no token: status={r.status} result={r.headers.get('fencing-result')}")
assert r.status == 428 and b"<Code>MissingFencingToken</Code>" in r.data, r.data
r = form_upload("reports/${filename}", b"var", "9")
print(f"form upload with ${{filename}}: status={r.status} result={r.headers.get('fencing-result')}")
assert r.status == 400 and b"<Code>MultiScope</Code>" in r.data, r.data
assert content(key) == b"six"
print("form upload: object intact")

# Virtual-hosted addressing names the bucket in the Host.
with_token("5")
refused("virtual put token 5", "StaleFence", 409, virtual.put_object, Bucket=bucket, Key=key, Body=b"five")
refused("virtual delete_objects token 5", "StaleFence", 409, virtual.delete_objects, Bucket=bucket, Delete=delete_one)
assert content(key) == b"six"
with_token("7")
virtual.put_object(Bucket=bucket, Key=key, Body=b"seven")
assert content(key) == b"seven"
with_token("6")
refused("path put token 6 after virtual token 7", "StaleFence", 409, path.put_object, Bucket=bucket, Key=key, Body=b"six")
print("virtual-hosted: one scope with path-style")

# A bucket's own settings are fenced on the bucket's scope.
with_token("0")
refused(
    "bucket tagging token 0",
    "StaleFence",
    409,
    path.put_bucket_tagging,
    Bucket=bucket,
    Tagging={"TagSet": [{"Key": "k", "Value": "v"}]},
)

# A multipart upload belongs to the key it was created for: a part for it under another
# key, with that key's token, is refused; so is an upload id fencegate never recorded.
with_token("7")
up = path.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
with_token("1")
refused(
    "upload_part of another key's upload",
    "MultiScope",
    400,
    path.upload_part,
    Bucket=bucket,
    Key="reports/other.csv",
    UploadId=up,
    PartNumber=1,
    Body=b"intruder",
)
with_token("7")
refused(
    "upload_part of an unknown upload",
    "NoSuchUpload",
    404,
    path.upload_part,
    Bucket=bucket,
    Key=key,
    UploadId=up + "x",
    PartNumber=1,
    Body=b"x",
)
part = path.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"parts")
path.complete_multipart_upload(
    Bucket=bucket,
    Key=key,
    UploadId=up,
    MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
)
assert content(key) == b"parts"
print("multipart: the upload is its key's")

# The current owners pass.
r = form_upload(key, b"eight", "8")
print(f"form upload token 8: status={r.status} result={r.headers.get('fencing-result')}")
assert r.status in (200, 201, 204), (r.status, r.data)
assert content(key) == b"eight"
with_token("8")
deleted = path.delete_objects(Bucket=bucket, Delete=delete_one)
assert [d["Key"] for d in deleted.get("Deleted", [])] == [key], deleted
with_token(None)
try:
    path.get_object(Bucket=bucket, Key=key)
    raise AssertionError("deleted object still there")
except ClientError as e:
    assert e.response["Error"]["Code"] == "NoSuchKey", e.response
print("delete_objects token 8: deleted")
print("s3 named: all ok")
