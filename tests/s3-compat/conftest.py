"""Runs the vendored s3-tests against one endpoint: s3s-fs directly, or fencegate's
`api = "s3"` route in front of it (tests/it/s3_compat.rs starts both and runs pytest here).

Set by the caller, in the environment:

    S3COMPAT_PORT          the endpoint, http://s3.test:PORT
    S3COMPAT_BACKEND_PORT  s3s-fs itself, http://s3.test:PORT (the fixtures' cleanup)
    S3COMPAT_ACCESS_KEY    the one user s3s-fs knows (the suite's main, alt and tenant)
    S3COMPAT_SECRET_KEY
    S3COMPAT_ADDRESSING    boto3's addressing style, "path" (its default for an
                           endpoint like this one) or "virtual" (bucket.s3.test:PORT)
    S3COMPAT_TOKENS        "1": every mutation (a request other than GET, HEAD and
                           OPTIONS) carries a Fencing-Token, a counter's next value,
                           so each is newer than all before it when it is signed
    S3COMPAT_RESULTS       where to write one line per test, tab-separated: its name,
                           outcome (passed, failed, skipped), fencegate's refusals in
                           its answers (Fencing-Result values other than "accepted",
                           or "-") and why it failed

s3.test and its subdomains resolve to 127.0.0.1 in this process only, so both addressing
styles reach the endpoint on loopback.
"""

import atexit
import itertools
import os
import shutil
import signal
import socket
import tempfile

import pytest

_getaddrinfo = socket.getaddrinfo


def _loopback(host, *args, **kwargs):
    if isinstance(host, str) and (host == "s3.test" or host.endswith(".s3.test")):
        host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _loopback

import boto3  # noqa: E402
import requests  # noqa: E402
from botocore.config import Config  # noqa: E402

PORT = os.environ["S3COMPAT_PORT"]
BACKEND_PORT = os.environ["S3COMPAT_BACKEND_PORT"]
ACCESS_KEY = os.environ["S3COMPAT_ACCESS_KEY"]
SECRET_KEY = os.environ["S3COMPAT_SECRET_KEY"]
ADDRESSING = os.environ.get("S3COMPAT_ADDRESSING", "path")
TOKENS = os.environ.get("S3COMPAT_TOKENS") == "1"
RESULTS = os.environ.get("S3COMPAT_RESULTS")
# Over this a test is failed (a hung request would otherwise hold up the whole run).
TEST_BOUND_SECONDS = 30

# The suite's config file: every user is s3s-fs's one user.
_conf_dir = tempfile.mkdtemp(prefix="s3compat-")
atexit.register(shutil.rmtree, _conf_dir, True)
_users = "".join(
    f"""
[{section}]
display_name = {section}
user_id = {section.replace(' ', '-')}
email = {section.replace(' ', '-')}@example.com
access_key = {ACCESS_KEY}
secret_key = {SECRET_KEY}
"""
    for section in ["s3 main", "s3 alt", "iam", "iam root", "iam alt root"]
)
with open(os.path.join(_conf_dir, "s3tests.conf"), "w") as f:
    f.write(
        f"""[DEFAULT]
host = s3.test
port = {PORT}
is_secure = False
ssl_verify = False
[fixtures]
bucket prefix = compat-{{random}}-
{_users}
[s3 tenant]
display_name = tenant
user_id = tenant
email = tenant@example.com
access_key = {ACCESS_KEY}
secret_key = {SECRET_KEY}
tenant = tenant
"""
    )
os.environ["S3TEST_CONF"] = os.path.join(_conf_dir, "s3tests.conf")

# The token of each mutation: a counter, so each is newer than every one before it.
# Reads go without one, as a lock holder's reads would: a read with a token is fenced
# too, and would make stale a write signed before it and sent after it.
_tokens = itertools.count(1)
_READS = ("GET", "HEAD", "OPTIONS")


def _add_token(request, signature_version=None, **_):
    # A presigned URL or form would sign the header, and whoever uses it would not
    # send it: those get theirs where they are sent (requests, below).
    if isinstance(signature_version, str) and (
        signature_version.endswith("-query") or "presign" in signature_version
    ):
        return
    if request.method not in _READS:
        request.headers["Fencing-Token"] = str(next(_tokens))


# fencegate's refusals (its Fencing-Result other than "accepted") seen in the current
# test's answers, written with its outcome.
_refusals = []


def _note(headers):
    result = headers.get("fencing-result")
    if result and result != "accepted" and result not in _refusals:
        _refusals.append(result)


def _after_call(http_response=None, **_):
    if http_response is not None:
        _note(http_response.headers)


_send = requests.Session.request


def _send_noting(self, method, url, *args, headers=None, **kwargs):
    if TOKENS and method.upper() not in _READS:
        headers = dict(headers or {})
        headers["Fencing-Token"] = str(next(_tokens))
    response = _send(self, method, url, *args, headers=headers, **kwargs)
    _note(response.headers)
    return response


# Every boto3 client and resource is made from the default session, and a client copies
# its session's handlers when it is made; the form uploads are sent with requests.
boto3.setup_default_session()
# Merged under the config each client is made with (the suite's sets no style).
boto3.DEFAULT_SESSION._session.set_default_client_config(
    Config(s3={"addressing_style": ADDRESSING})
)
boto3.DEFAULT_SESSION.events.register("after-call.s3", _after_call)
if TOKENS:
    boto3.DEFAULT_SESSION.events.register("before-sign.s3", _add_token)
requests.Session.request = _send_noting

import s3tests.functional as suite  # noqa: E402


_backend = []


def _cleanup():
    """Deletes the run's buckets straight on s3s-fs, whose DeleteBucket removes a bucket
    with all it holds: the upstream cleanup lists object versions, which s3s-fs does not
    serve, and deletes a thousand keys per request, which one lock cannot cover; and
    fencegate refuses to delete a bucket whose objects it has fenced."""
    if not _backend:
        _backend.append(
            boto3.session.Session().client(
                "s3",
                endpoint_url=f"http://s3.test:{BACKEND_PORT}",
                aws_access_key_id=ACCESS_KEY,
                aws_secret_access_key=SECRET_KEY,
                region_name="us-east-1",
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
            )
        )
    prefix = suite.get_prefix()
    for bucket in _backend[0].list_buckets().get("Buckets", []):
        if bucket["Name"].startswith(prefix):
            _backend[0].delete_bucket(Bucket=bucket["Name"])


suite.setup = _cleanup
suite.teardown = _cleanup


class _Overrun(Exception):
    pass


def _overrun(*_):
    raise _Overrun(f"over {TEST_BOUND_SECONDS} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _refusals.clear()
    previous = signal.signal(signal.SIGALRM, _overrun)
    signal.alarm(TEST_BOUND_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# Per test: its outcome and, if it failed, why (the first phase that failed); then the
# refusals its answers carried.
_outcomes = {}


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    outcome = _outcomes.setdefault(name, ["passed", "", "-"])
    if report.failed and outcome[0] != "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else str(report.longrepr)
        outcome[0] = "failed"
        outcome[1] = f"{report.when}: {' '.join(reason.split())[:300]}"
    elif report.skipped and outcome[0] == "passed":
        outcome[0] = "skipped"
    if report.when == "teardown":
        outcome[2] = ",".join(_refusals) or "-"


def pytest_sessionfinish(session, exitstatus):
    if RESULTS:
        with open(RESULTS, "w") as f:
            for name, (outcome, reason, refusals) in sorted(_outcomes.items()):
                f.write(f"{name}\t{outcome}\t{refusals}\t{reason}\n")
