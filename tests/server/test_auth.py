"""Ways in (issue 9, point 5): every route that reads or changes data wants credentials when
they are configured, against real server processes, real clients and real mounts.

- Every route registered on the app (enumerated from ``app.router``, so a route added later
  is covered without editing this file) × {no credentials, wrong ones, right ones}: refused
  (401/403, in the API's error shape) unless it is one of the documented open routes.
- A refused PUT, DELETE, bucket destroy, bucket create or GetBatch changes nothing on disk,
  not even a temporary file; a refused ``Expect: 100-continue`` PUT is not told to continue.
- The aistore SDK with a token (argument and ``AIS_AUTHN_TOKEN``), boto3 with and without
  keys, ``batchfs put`` and ``batchfs mount`` with ``--token-file``, and the refusals.
- Token files: refused when other users can read them; what the server keeps is only digests.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import urllib.parse
from pathlib import Path

import boto3
import botocore
import httpx
import pytest
from aistore.sdk import Client
from aistore.sdk.errors import AISError
from aistore.sdk.retry_config import RetryConfig
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from tenacity import Retrying, stop_after_attempt
from urllib3 import Retry

from batchfs.errors import BackendError, errno_for
from server.api.app import build_app
from server.config import ServerConfig
from tests.support.processes import BIN, ServerProcess

TOKEN = "batchfs-test-token-0123456789abcdef"
OTHER_TOKEN = "second-token-for-rotation-0123456789"
ACCESS, SECRET = "AKIDAUTHTEST", "auth-test-secret-key"
# The only routes anyone may use whatever is configured (docs/security.md); /metrics is
# governed by --metrics-auth (default: token).
DOCUMENTED_OPEN = {"/v1/health"}
BUCKET, OBJ = "authb", "dir/obj.bin"


def token_file(path: Path, *tokens: str, mode: int = 0o600) -> Path:
    path.write_text("# bearer tokens, one a line\n\n" + "".join(t + "\n" for t in tokens))
    path.chmod(mode)
    return path


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def start(tmp: Path, *args: str) -> ServerProcess:
    return ServerProcess([tmp / "d"], *args).start()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Token and S3 keys: native wants the token, S3 wants SigV4."""
    tmp = tmp_path_factory.mktemp("full")
    srv = ServerProcess([tmp / "d"], "--auth-token-file", str(token_file(tmp / "tokens", TOKEN, OTHER_TOKEN)),
                        "--s3-access-key", ACCESS, "--s3-secret-key", SECRET)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def token_only(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenonly")
    srv = ServerProcess([tmp / "d"], "--auth-token-file", str(token_file(tmp / "tokens", TOKEN)))
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def keys_only(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keysonly")
    srv = ServerProcess([tmp / "d"], "--s3-access-key", ACCESS, "--s3-secret-key", SECRET)
    try:
        yield srv.start()
    finally:
        srv.stop()


# -- the routes ------------------------------------------------------------------------------------
def registered_routes(tmp: Path) -> list[tuple[str, str]]:
    """(method, concrete path) for every route on the app the server builds."""
    app = build_app(ServerConfig(data_dirs=(tmp,)))
    values = {"bucket": BUCKET, "obj": OBJ, "key": OBJ, "rest": "x"}
    out = set()
    for route in app.router.routes():
        canonical = route.resource.canonical
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", lambda m: values[m.group(1)], canonical)
        methods = ["GET", "POST", "PUT", "DELETE", "HEAD"] if route.method == "*" else [route.method]
        out.update((m, path) for m in methods)
    assert len(out) > 30, out  # native, GetBatch, both S3 namespaces, metrics, health
    return sorted(out)


def is_native(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def sigv4_headers(url: str, method: str, body: bytes, secret: str = SECRET) -> dict:
    req = AWSRequest(method=method, url=url, data=body,
                     headers={"X-Amz-Content-SHA256": hashlib.sha256(body).hexdigest()})
    S3SigV4Auth(Credentials(ACCESS, secret), "s3", "us-east-1").add_auth(req)
    return dict(req.headers.items())


def send(srv: ServerProcess, method: str, path: str, creds: str) -> httpx.Response:
    """One request with no / wrong / right credentials of the kind the route wants."""
    url = srv.url + urllib.parse.quote(path)
    body = b"" if method in ("GET", "HEAD", "DELETE") else b"x"
    if path.startswith("/v1/buckets/") and method in ("POST", "GET"):
        body = json.dumps({"action": "create-bck" if method == "POST" else "list"}).encode()
    headers: dict = {}
    if is_native(path) or path == "/metrics":
        headers = {"none": {}, "wrong": bearer("not-the-token-0123456789"), "right": bearer(TOKEN)}[creds]
    elif creds != "none":
        headers = sigv4_headers(url, method, body, SECRET if creds == "right" else "wrong-secret")
    return httpx.request(method, url, content=body, headers=headers, timeout=30)


def ensure_object(srv: ServerProcess) -> None:
    httpx.post(f"{srv.url}/v1/buckets/{BUCKET}", json={"action": "create-bck"}, headers=bearer(TOKEN))
    r = httpx.put(f"{srv.url}/v1/objects/{BUCKET}/{OBJ}", content=b"the original", headers=bearer(TOKEN))
    assert r.status_code == 200, r.text


def assert_refused(r: httpx.Response, method: str, path: str, native: bool) -> None:
    what = f"{method} {path}"
    assert r.status_code in (401, 403), (what, r.status_code, r.text)
    if native:
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), what
        if method != "HEAD":  # AIStore's JSON error shape
            assert r.json()["status"] == 401 and r.json()["message"], what
    else:
        assert r.status_code == 403, what
        if method != "HEAD":
            assert re.search(rb"<Code>(AccessDenied|SignatureDoesNotMatch)</Code>", r.content), (what, r.text)


def test_every_route_wants_credentials(full, tmp_path):
    routes = registered_routes(tmp_path / "enum")
    for method, path in routes:
        if path in DOCUMENTED_OPEN:
            for creds in ("none", "wrong", "right"):
                assert send(full, method, path, creds).status_code == 200, (method, path, creds)
            continue
        native = is_native(path) or path == "/metrics"
        for creds in ("none", "wrong"):
            assert_refused(send(full, method, path, creds), method, path, native)
        ensure_object(full)
        r = send(full, method, path, "right")
        assert r.status_code not in (401, 403), (method, path, r.status_code, r.text)
    # and the refusals were counted, without a bucket name in any label
    text = httpx.get(f"{full.url}/metrics", headers=bearer(TOKEN)).text
    assert re.search(r'batchfs_requests_total\{op="denied",status="401"\} [1-9]', text)


def test_second_token_in_the_file_works_too(full):
    r = httpx.get(f"{full.url}/v1/buckets", headers=bearer(OTHER_TOKEN))
    assert r.status_code == 200
    for bad in ("Bearer", "Basic " + TOKEN, TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        r = httpx.get(f"{full.url}/v1/buckets", headers={"Authorization": bad})
        assert r.status_code == 401, bad


def test_token_only_refuses_s3_whatever_the_signature(token_only):
    ensure_object(token_only)
    for creds in ("none", "right"):
        for method, path in (("GET", "/"), ("GET", f"/{BUCKET}/{OBJ}"), ("PUT", f"/s3/{BUCKET}/new"),
                             ("DELETE", f"/{BUCKET}/{OBJ}")):
            r = send(token_only, method, path, creds)
            assert r.status_code == 403 and b"<Code>AccessDenied</Code>" in r.content, (method, path, r.text)
            assert b"S3 API is disabled" in r.content
    # the bearer token is not a way in on S3 either, nor a path that decodes to /v1/... but
    # is routed to S3 (%2F stays encoded for aiohttp's router)
    r = httpx.get(f"{token_only.url}/{BUCKET}/{OBJ}", headers=bearer(TOKEN))
    assert r.status_code == 403
    r = httpx.put(f"{token_only.url}/v1%2Fobjects/{BUCKET}/x", content=b"x", headers=bearer(TOKEN))
    assert r.status_code == 403 and b"<Code>AccessDenied</Code>" in r.content, r.text
    s3 = boto3.client("s3", endpoint_url=token_only.url, aws_access_key_id="x", aws_secret_access_key="y",
                      region_name="us-east-1")
    with pytest.raises(ClientError) as info:
        s3.put_object(Bucket=BUCKET, Key=OBJ, Body=b"evil")
    assert info.value.response["Error"]["Code"] == "AccessDenied"
    assert httpx.get(f"{token_only.url}/v1/objects/{BUCKET}/{OBJ}", headers=bearer(TOKEN)).content == b"the original"


def test_keys_only_refuses_the_native_api(keys_only):
    """The reported hole: S3 keys set, and a native PUT/DELETE went through unauthenticated."""
    s3 = boto3.client("s3", endpoint_url=keys_only.url, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                      region_name="us-east-1")
    s3.create_bucket(Bucket="k")
    s3.put_object(Bucket="k", Key="a", Body=b"keep")
    for method, path, body in (("PUT", "/v1/objects/k/a", b"overwritten"), ("DELETE", "/v1/buckets/k", b""),
                               ("GET", "/v1/objects/k/a", b""), ("GET", "/v1/buckets/k", b""),
                               ("GET", "/v1/ml/moss/k", b'{"in": [{"objname": "a"}]}'), ("GET", "/v1/buckets", b"")):
        for headers in ({}, bearer(TOKEN)):
            r = httpx.request(method, keys_only.url + path, content=body, headers=headers)
            assert r.status_code == 403 and "native API is disabled" in r.json()["message"], (method, path)
    assert s3.get_object(Bucket="k", Key="a")["Body"].read() == b"keep"
    assert httpx.get(f"{keys_only.url}/v1/health").status_code == 200
    assert httpx.get(f"{keys_only.url}/metrics").status_code == 200  # no token to ask for


# -- refused requests change nothing --------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_refused_writes_change_nothing(tmp_path):
    srv = start(tmp_path, "--auth-token-file", str(token_file(tmp_path / "t", TOKEN)),
                "--s3-access-key", ACCESS, "--s3-secret-key", SECRET, "--chunk-size", "1MiB")
    try:
        ensure_object(srv)
        big = os.urandom(3 * 1024 * 1024 + 5)  # streamed in pieces, past the inline PUT
        before = snapshot(tmp_path / "d")
        u = srv.url
        for headers in ({}, bearer("wrong-token-0123456789abcdef")):
            attempts = [
                httpx.put(f"{u}/v1/objects/{BUCKET}/{OBJ}", content=b"small overwrite", headers=headers),
                httpx.put(f"{u}/v1/objects/{BUCKET}/{OBJ}", content=big, headers=headers),
                httpx.put(f"{u}/v1/objects/{BUCKET}/new", content=iter([big[:65536]] * 4), headers=headers),
                httpx.delete(f"{u}/v1/objects/{BUCKET}/{OBJ}", headers=headers),
                httpx.delete(f"{u}/v1/buckets/{BUCKET}", headers=headers),
                httpx.post(f"{u}/v1/buckets/newbucket", json={"action": "create-bck"}, headers=headers),
                httpx.request("GET", f"{u}/v1/ml/moss/{BUCKET}", headers=headers,
                              json={"in": [{"objname": OBJ}], "mime": ".tar"}),
                httpx.request("DELETE", f"{u}/v1/buckets/{BUCKET}", headers=headers,
                              json={"action": "delete-listrange", "value": {"objnames": [OBJ]}}),
                httpx.put(f"{u}/{BUCKET}/{OBJ}", content=b"s3 overwrite", headers=headers),
                httpx.delete(f"{u}/s3/{BUCKET}/{OBJ}", headers=headers),
                httpx.put(f"{u}/{BUCKET}/{OBJ}", content=b"bad sig",
                          headers=sigv4_headers(f"{u}/{BUCKET}/{OBJ}", "PUT", b"bad sig", "nope")),
            ]
            for r in attempts:  # (an S3 route given a Bearer header: 400 AuthorizationHeaderMalformed)
                assert r.status_code in (400, 401, 403), (r.request.method, r.request.url, r.status_code)
                assert r.status_code != 400 or b"AuthorizationHeaderMalformed" in r.content, r.text
        assert snapshot(tmp_path / "d") == before  # no temp file, no catalog change
        r = httpx.get(f"{u}/v1/objects/{BUCKET}/{OBJ}", headers=bearer(TOKEN))
        assert r.content == b"the original"
        assert httpx.head(f"{u}/v1/buckets/newbucket", headers=bearer(TOKEN)).status_code == 404
    finally:
        srv.stop()


def test_refused_put_is_not_told_to_continue(full):
    """``Expect: 100-continue`` without a token: the final 401 comes at once, never a 100."""
    host, port = urllib.parse.urlsplit(full.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"PUT /v1/objects/{BUCKET}/expect HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1048576\r\n"
                  "Expect: 100-continue\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    # with the token it is told to continue
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"PUT /v1/objects/{BUCKET}/expect HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n"
                  f"Authorization: Bearer {TOKEN}\r\nExpect: 100-continue\r\n\r\n".encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 100")


# -- SigV4 gaps -----------------------------------------------------------------------------------
def test_sigv4_body_is_always_covered(full):
    ensure_object(full)
    url = f"{full.url}/{BUCKET}/sig"

    class NoPayloadHeader(S3SigV4Auth):  # signs as a bodiless request: no x-amz-content-sha256
        def payload(self, request):
            return hashlib.sha256(b"").hexdigest()

        def headers_to_sign(self, request):
            headers = super().headers_to_sign(request)
            del headers["x-amz-content-sha256"]
            return headers

    req = AWSRequest(method="PUT", url=url)
    NoPayloadHeader(Credentials(ACCESS, SECRET), "s3", "us-east-1").add_auth(req)
    assert "x-amz-content-sha256" not in req.headers["Authorization"]
    headers = {"Authorization": req.headers["Authorization"], "X-Amz-Date": req.headers["X-Amz-Date"]}
    r = httpx.put(url, content=iter([b"smuggled body"]), headers=headers)  # chunked: no Content-Length
    assert r.status_code == 400 and b"x-amz-content-sha256" in r.content, r.text
    assert httpx.put(url, content=b"", headers=headers).status_code == 200  # the signature itself is good
    # an aws-chunked body with a plain SHA-256 declared: the hash would go unchecked
    body = b"d\r\nsmuggled body\r\n0\r\n\r\n"
    h = sigv4_headers(url, "PUT", b"innocent")
    h["Content-Encoding"] = "aws-chunked"
    r = httpx.put(url, content=body, headers=h)
    assert r.status_code in (400, 403) and b"smuggled" not in httpx.get(
        f"{full.url}/v1/objects/{BUCKET}/sig", headers=bearer(TOKEN)).content
    assert r.status_code == 400 and b"aws-chunked" in r.content, r.text


def test_boto3_with_and_without_keys(full):
    good = boto3.client("s3", endpoint_url=full.url, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                        region_name="us-east-1")
    with contextlib.suppress(ClientError):
        good.create_bucket(Bucket="boto")
    good.put_object(Bucket="boto", Key="k", Body=b"signed")
    assert good.get_object(Bucket="boto", Key="k")["Body"].read() == b"signed"
    unsigned = boto3.client("s3", endpoint_url=full.url, region_name="us-east-1",
                            config=botocore.config.Config(signature_version=botocore.UNSIGNED))
    for call, kw in ((unsigned.get_object, {"Bucket": "boto", "Key": "k"}),
                     (unsigned.put_object, {"Bucket": "boto", "Key": "k", "Body": b"evil"}),
                     (unsigned.delete_object, {"Bucket": "boto", "Key": "k"}),
                     (unsigned.list_objects_v2, {"Bucket": "boto"}), (unsigned.list_buckets, {})):
        with pytest.raises(ClientError) as info:
            call(**kw)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    url = unsigned.generate_presigned_url("put_object", Params={"Bucket": "boto", "Key": "k"})
    assert httpx.put(url, content=b"evil").status_code == 403
    assert good.get_object(Bucket="boto", Key="k")["Body"].read() == b"signed"


# -- the aistore SDK -------------------------------------------------------------------------------
def sdk(url: str, **kw) -> Client:
    retry = RetryConfig(http_retry=Retry(total=0), network_retry=Retrying(stop=stop_after_attempt(1), reraise=True))
    return Client(url, timeout=(5, 60), retry_config=retry, **kw)


def test_sdk_with_token_end_to_end(full, monkeypatch):
    c = sdk(full.url, token=TOKEN)
    b = c.bucket("sdkauth")
    b.create(exist_ok=True)
    b.object("a").get_writer().put_content(b"alpha")
    b.object("b").get_writer().put_content(b"beta")
    assert b.object("a").get_reader().read_all() == b"alpha"
    assert sorted(e.name for e in b.list_objects().entries) == ["a", "b"]
    batch = c.batch(bucket=b)
    batch.add("a")
    batch.add("b")
    assert [data for _, data in batch.get()] == [b"alpha", b"beta"]
    monkeypatch.setenv("AIS_AUTHN_TOKEN", TOKEN)  # the SDK's environment variable
    assert sdk(full.url).bucket("sdkauth").object("b").get_reader().read_all() == b"beta"
    monkeypatch.delenv("AIS_AUTHN_TOKEN")
    for client in (sdk(full.url), sdk(full.url, token="wrong-token-0123456789")):
        with pytest.raises(AISError) as info:
            client.bucket("sdkauth").object("a").get_writer().put_content(b"evil")
        assert info.value.status_code == 401
        with pytest.raises(AISError):
            client.bucket("sdkauth").object("a").get_reader().read_all()
    assert b.object("a").get_reader().read_all() == b"alpha"


# -- configuration ------------------------------------------------------------------------------------
def run_server(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfs-server"), "--listen", "127.0.0.1:0", "--data", str(tmp / "d"), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content,mode,message", [
    (TOKEN + "\n", 0o644, "accessible by other users"),
    (TOKEN + "\n", 0o604, "chmod 600"),
    ("short\n", 0o600, "shorter than 16"),
    ("# only a comment\n\n", 0o600, "no token"),
    ("two words-0123456789abcdef\n", 0o600, "no spaces"),
])
def test_server_refuses_bad_token_files(tmp_path, content, mode, message):
    f = tmp_path / "tokens"
    f.write_text(content)
    f.chmod(mode)
    r = run_server(tmp_path, "--auth-token-file", str(f))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "listening" not in r.stdout
    r = run_server(tmp_path, "--auth-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "No such file" in r.stderr


def test_token_file_from_the_config_file_and_metrics_auth(tmp_path):
    f = token_file(tmp_path / "tokens", TOKEN)
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'auth_token_file = "{f}"\nmetrics_auth = "none"\n')
    srv = start(tmp_path, "--config", str(cfg))
    try:
        assert httpx.get(f"{srv.url}/v1/buckets").status_code == 401
        assert httpx.get(f"{srv.url}/metrics").status_code == 200  # opened on purpose
        assert httpx.get(f"{srv.url}/v1/health").status_code == 200
    finally:
        srv.stop()
    (tmp_path / "bad.toml").write_text('auth_token_digests = ["x"]\n')
    r = run_server(tmp_path, "--config", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and "unknown option" in r.stderr
    r = run_server(tmp_path, "--metrics-auth", "open")
    assert r.returncode == 2 and "token or none" in r.stderr
    # no option takes a token on the command line (the cluster commands' usage lines name their
    # own --token-file: a client's file with the token to send)
    assert "--token" not in run_server(tmp_path, "--help").stdout.replace("--auth-token-file", "").replace(
        "[--token-file FILE]", "")


def test_metrics_never_name_buckets_or_objects(full):
    """Why /metrics may be opened with --metrics-auth none: its labels are operations and
    status codes only. A bucket or object name in a label would make this fail."""
    name = "secretbucketname42"
    c = sdk(full.url, token=TOKEN)
    c.bucket(name).create(exist_ok=True)
    c.bucket(name).object("secretobjectname42").get_writer().put_content(b"x")
    c.bucket(name).object("secretobjectname42").get_reader().read_all()
    httpx.get(f"{full.url}/v1/objects/{name}/missing-secretobjectname42", headers=bearer(TOKEN))
    text = httpx.get(f"{full.url}/metrics", headers=bearer(TOKEN)).text
    assert "op=\"put\"" in text and "secret" not in text


def test_server_keeps_only_digests(tmp_path):
    config = ServerConfig(data_dirs=(tmp_path,), auth_token_file=token_file(tmp_path / "t", TOKEN))
    assert config.auth_token_digests == (hashlib.sha256(TOKEN.encode()).digest(),)
    assert TOKEN not in repr(config)


# -- clients ----------------------------------------------------------------------------------------
def test_backend_errors_401_403_are_eacces():
    from batchfs.objclient.getbatch import BatchFetchError

    assert errno_for(BackendError("x", 401)) == errno.EACCES
    assert errno_for(BackendError("x", 403)) == errno.EACCES
    assert errno_for(BackendError("x", 500)) == errno.EIO
    assert errno_for(BatchFetchError(3, "GetBatch answered HTTP 401: invalid token", 401)) == errno.EACCES
    assert errno_for(BatchFetchError(3, "connection reset")) == errno.EIO


def test_fstab_helper_takes_token_file(tmp_path):
    helper = BIN / "mount.fuse.batchfs"
    if not helper.exists():
        pytest.skip("mount.fuse.batchfs not installed next to batchfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    good, loose = token_file(tmp_path / "good", TOKEN), token_file(tmp_path / "loose", TOKEN, mode=0o644)
    r = subprocess.run([str(helper), "http://127.0.0.1:9/b", str(mnt), "-f", "-o", f"ro,token_file={good}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = subprocess.run([str(helper), "http://127.0.0.1:9/b", str(mnt), "-f", "-o", f"ro,token_file={loose}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "accessible by other users" in r.stderr, r.stderr


def run_batchfs(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "AIS_AUTHN_TOKEN"}
    return subprocess.run([str(BIN / "batchfs"), *args], capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


def test_batchfs_put_with_token(full, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "one.txt").write_bytes(b"one")
    (src / "sub" / "two.bin").write_bytes(os.urandom(300_000))
    target = f"{full.url}/putauth/pre"
    r = run_batchfs("put", "-q", str(src), target)
    assert r.returncode == 1 and "refused the credentials (401" in r.stderr and "--token-file" in r.stderr, r.stderr
    r = run_batchfs("put", "-q", str(src), target, env={"AIS_AUTHN_TOKEN": "wrong-token-0123456789"})
    assert r.returncode == 1 and "refused the credentials (401" in r.stderr, r.stderr
    loose = token_file(tmp_path / "loose", TOKEN, mode=0o644)
    r = run_batchfs("put", "-q", str(src), target, "--token-file", str(loose))
    assert r.returncode == 2 and "accessible by other users" in r.stderr
    assert httpx.head(f"{full.url}/v1/buckets/putauth", headers=bearer(TOKEN)).status_code == 404  # nothing made
    r = run_batchfs("put", "-q", str(src), target, "--token-file", str(token_file(tmp_path / "tok", TOKEN)))
    assert r.returncode == 0, r.stderr
    got = httpx.get(f"{full.url}/v1/objects/putauth/pre/sub/two.bin", headers=bearer(TOKEN)).content
    assert got == (src / "sub" / "two.bin").read_bytes()
    r = run_batchfs("put", "-q", str(src), f"{full.url}/putauth/env", env={"AIS_AUTHN_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr


def _fuse_available() -> bool:
    return os.path.exists("/dev/fuse") and subprocess.run(["which", "fusermount3"], capture_output=True).returncode == 0


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_available(), reason="needs /dev/fuse and fusermount3")
def test_mount_with_token_file(full, tmp_path):
    ensure_object(full)
    c = sdk(full.url, token=TOKEN)
    c.bucket("mountauth").create(exist_ok=True)
    c.bucket("mountauth").object("d/file.bin").get_writer().put_content(b"mounted bytes" * 1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    src = f"{full.url}/mountauth"
    # no token: refused at mount time, with the reason, nothing mounted
    r = run_batchfs("mount", src, str(mnt))
    assert r.returncode == 1 and "HTTP 401" in r.stderr and "--token-file" in r.stderr, r.stderr
    assert not os.path.ismount(mnt)
    r = run_batchfs("mount", src, str(mnt), env={"AIS_AUTHN_TOKEN": "wrong-token-0123456789"})
    assert r.returncode == 1 and "refused our token" in r.stderr, r.stderr
    assert not os.path.ismount(mnt)
    r = run_batchfs("mount", full.url, str(mnt))  # every bucket: the listing probe is refused too
    assert r.returncode == 1 and "HTTP 401" in r.stderr, r.stderr
    loose = token_file(tmp_path / "loose", TOKEN, mode=0o640 | 0o004)
    r = run_batchfs("mount", src, str(mnt), "--token-file", str(loose))
    assert r.returncode == 2 and "accessible by other users" in r.stderr
    tok = token_file(tmp_path / "tok", TOKEN)
    for how in (["--token-file", str(tok)], ["-o", f"token_file={tok},ro"]):
        r = run_batchfs("mount", src, str(mnt), *how)
        assert r.returncode == 0, r.stderr
        try:
            assert os.listdir(mnt) == ["d"]
            assert (mnt / "d" / "file.bin").read_bytes() == b"mounted bytes" * 1000
        finally:
            assert run_batchfs("umount", str(mnt)).returncode == 0
    r = run_batchfs("mount", src, str(mnt), env={"AIS_AUTHN_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr
    try:
        assert (mnt / "d" / "file.bin").stat().st_size == 13000
    finally:
        assert run_batchfs("umount", str(mnt)).returncode == 0


@pytest.mark.fuse
@pytest.mark.skipif(not _fuse_available(), reason="needs /dev/fuse and fusermount3")
def test_mount_reads_fail_with_eacces_once_the_token_is_rotated_out(tmp_path):
    srv = start(tmp_path, "--auth-token-file", str(token_file(tmp_path / "old", TOKEN)))
    try:
        c = sdk(srv.url, token=TOKEN)
        c.bucket("rot").create(exist_ok=True)
        for name in ("read-before", "read-after"):
            c.bucket("rot").object(name).get_writer().put_content(name.encode() * 100)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        r = run_batchfs("mount", f"{srv.url}/rot", str(mnt), "--token-file", str(token_file(tmp_path / "t", TOKEN)))
        assert r.returncode == 0, r.stderr
        try:
            assert (mnt / "read-before").read_bytes() == b"read-before" * 100
            assert (mnt / "read-after").stat().st_size == 1000  # listed while the token was good
            port = urllib.parse.urlsplit(srv.url).port
            srv.stop()  # the same node comes back with only a new token
            srv = start(tmp_path, "--listen", f"127.0.0.1:{port}",
                        "--auth-token-file", str(token_file(tmp_path / "new", OTHER_TOKEN)))
            with pytest.raises(PermissionError):  # EACCES, not EIO
                (mnt / "read-after").read_bytes()
        finally:
            assert run_batchfs("umount", str(mnt)).returncode == 0
    finally:
        srv.stop()
