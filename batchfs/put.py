"""``batchfs put``: load a local directory tree into a bucket with parallel PUTs.

Design:
- Two walks of the tree: the first only counts files and bytes (for the progress bar's
  total), the second feeds uploads. Nothing holds the list of files, so a tree of millions
  of files costs memory for ``jobs`` uploads in flight plus a bounded backlog, not per file.
- A thread pool of ``jobs`` workers shares one httpx client (connection pool of the same
  size); at most ``2 × jobs`` uploads are submitted ahead, so walking never outruns uploading.
- Each file is streamed from disk (httpx sends a file object with its Content-Length), and
  re-opened for each retry. 429, 5xx and connection errors are retried with exponential
  backoff and jitter; any other 4xx is final (the server said the request itself is wrong).
- Against a cluster (a gateway whose map names two or more targets) each PUT goes straight to
  the object's owner by AIStore's HRW, as the SDK's ``direct=True`` does: one request and one
  send of the body instead of the gateway's 307 and a second send. The map is read once per
  run; a placed PUT that cannot connect is retried through the gateway, which knows the
  current map (a target that joined or died meanwhile).
- Object names are the paths relative to LOCAL_DIR with ``/`` separators, under PREFIX.
  Symlinks and special files (FIFOs, sockets, devices) are skipped with a warning: following
  links could upload files outside the tree, or the same file twice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from batchfs.wire import hrw
from batchfs.wire.retry import backoff_seconds, retryable
from batchfs.wire.units import SECONDS
from batchfs.wire.urls import MAX_REDIRECTS, bucket_path, object_path



@dataclasses.dataclass(frozen=True)
class PutConfig:
    jobs: int = 8  # uploads in flight
    retries: int = 5  # further attempts after a retryable failure
    backoff_seconds: float = 0.5 * SECONDS  # the first retry waits up to this; doubles each attempt (full jitter)
    backoff_max_seconds: float = 30 * SECONDS
    timeout_seconds: float = 120 * SECONDS  # per request, connect and each read/write
    progress: bool = True
    # Sent as ``Authorization: Bearer`` with every request (batchfs.engine.config.auth_token finds it).
    token: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class Destination:
    base_url: str  # http://HOST:PORT
    bucket: str
    prefix: str  # "" or ending in "/"

    def object_url(self, name: str) -> str:
        return self.base_url + object_path(self.bucket, name)


@dataclasses.dataclass
class PutResult:
    files: int = 0
    bytes: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, reason)


class PutError(Exception):
    """The upload cannot start (bad target, unreachable server, bucket refused)."""


def parse_target(url: str) -> Destination:
    """``http://HOST:PORT/BUCKET[/PREFIX]`` into its parts."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PutError(f"target must be http://HOST:PORT/BUCKET[/PREFIX], got {url!r}")
    if parts.query or parts.fragment:
        raise PutError(f"target {url!r} must not have a query or fragment")
    bucket, _, prefix = parts.path.lstrip("/").partition("/")
    if not bucket:
        raise PutError(f"target {url!r} names no bucket")
    prefix = prefix.strip("/")
    return Destination(f"{parts.scheme}://{parts.netloc}", bucket, prefix + "/" if prefix else "")


def walk(root: Path, warn: Callable[[str], None]) -> Iterator[tuple[Path, str, int]]:
    """(path, relative name, size) of every regular file under root, in a stable order."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for d in list(dirnames):
            if (base / d).is_symlink():
                warn(f"skipping symlink to a directory: {base / d}")
                dirnames.remove(d)
        for name in sorted(filenames):
            path = base / name
            try:
                st = os.lstat(path)
            except OSError as e:
                warn(f"skipping {path}: {e.strerror}")
                continue
            if stat.S_ISLNK(st.st_mode):
                warn(f"skipping symlink: {path}")
            elif not stat.S_ISREG(st.st_mode):
                warn(f"skipping special file: {path}")
            else:
                yield path, path.relative_to(root).as_posix(), st.st_size


def ensure_bucket(client: httpx.Client, target: Destination) -> None:
    url = target.base_url + bucket_path(target.bucket)
    try:
        r = client.post(url, json={"action": "create-bck", "name": "", "value": None})
    except httpx.HTTPError as e:
        raise PutError(f"cannot reach {target.base_url}: {e}") from None
    if r.status_code in (401, 403):  # before any upload: one clear error, not one per file
        hint = ("check --token-file or AIS_AUTHN_TOKEN" if "Authorization" in client.headers
                else "give a token with --token-file FILE or AIS_AUTHN_TOKEN")
        raise PutError(f"the server refused the credentials ({r.status_code} {_reason(r)}): {hint}")
    if r.status_code not in (200, 409):  # 409: it exists already, which is fine
        raise PutError(f"creating bucket {target.bucket!r} failed: {r.status_code} {_reason(r)}")


def _reason(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))
    except ValueError:
        return r.text[:200]


class Owners:
    """Each object's owner by the cluster map of ``base``, read once: ``{id: (digest, URL)}``,
    empty unless the map names two or more targets (one node is its own endpoint)."""

    def __init__(self, client: httpx.Client, base: str):
        try:
            r = client.get(f"{base}/v1/daemon", params={"what": "smap"})
            targets = hrw.smap_targets(r.json()) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            targets = {}
        self.targets = targets if len(targets) >= 2 else {}
        self.digests = {i: d for i, (d, _) in self.targets.items()}

    def url(self, bucket: str, name: str) -> str | None:
        if not self.targets:
            return None
        owner = hrw.owner(hrw.digest(hrw.uname(bucket, name)), self.digests)
        return self.targets[owner][1] + object_path(bucket, name)


class _Uploader:
    def __init__(self, client: httpx.Client, target: Destination, cfg: PutConfig, on_bytes: Callable[[int], None],
                 owners: Owners):
        self.client, self.target, self.cfg, self.on_bytes, self.owners = client, target, cfg, on_bytes, owners

    def upload(self, path: Path, name: str) -> int:
        """PUT one file, with retries; returns its size. Raises with a reason on failure."""
        endpoint = self.target.object_url(self.target.prefix + name)
        url = self.owners.url(self.target.bucket, self.target.prefix + name) or endpoint
        for attempt in range(self.cfg.retries + 1):
            last = attempt == self.cfg.retries
            try:
                for _ in range(MAX_REDIRECTS + 1):
                    with open(path, "rb") as f:
                        size = os.fstat(f.fileno()).st_size
                        r = self.client.put(url, content=f, headers={"Content-Length": str(size)})
                    location = r.headers.get("Location") if r.status_code in (307, 308) else None
                    if not location:
                        break
                    # a cluster gateway sends the PUT to the target that owns the object: the
                    # body goes again, from the file (a streamed body cannot be replayed)
                    url = str(httpx.URL(url).join(location))
                if r.status_code == 200:
                    self.on_bytes(size)
                    return size
                if not retryable(r.status_code) or last:
                    raise RuntimeError(f"HTTP {r.status_code}: {_reason(r)}")
            except httpx.TransportError as e:
                if last:
                    raise RuntimeError(f"{type(e).__name__}: {e}") from None
                url = endpoint  # the owner by our map did not answer: the gateway knows the current map
            except OSError as e:  # reading the local file: retrying will not help
                raise RuntimeError(f"cannot read: {e.strerror or e}") from None
            time.sleep(backoff_seconds(attempt, self.cfg.backoff_seconds, self.cfg.backoff_max_seconds))
        raise AssertionError("unreachable")


def put_tree(local_dir: Path, target_url: str, cfg: PutConfig = PutConfig(),
             warn: Callable[[str], None] | None = None) -> PutResult:
    """Upload every regular file under ``local_dir``; failures are collected, not raised."""
    from tqdm import tqdm  # imported here: `import batchfs` stays cheap

    root = Path(local_dir)
    if not root.is_dir():
        raise PutError(f"{root} is not a directory")
    target = parse_target(target_url)
    result = PutResult()

    def quiet(_msg: str) -> None:
        pass

    total_files = total_bytes = 0
    for _, _, size in walk(root, quiet):
        total_files += 1
        total_bytes += size

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not cfg.progress,
               desc=f"put {target.bucket}", file=sys.stderr, dynamic_ncols=True)
    lock = threading.Lock()

    def on_bytes(n: int) -> None:
        with lock:
            bar.update(n)

    def report(msg: str) -> None:
        result.skipped.append(msg)
        (warn or (lambda m: bar.write(f"batchfs put: warning: {m}", file=sys.stderr)))(msg)

    timeout = httpx.Timeout(cfg.timeout_seconds)
    limits = httpx.Limits(max_connections=cfg.jobs, max_keepalive_connections=cfg.jobs)
    try:
        headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
        with httpx.Client(timeout=timeout, limits=limits, headers=headers) as client:
            ensure_bucket(client, target)
            uploader = _Uploader(client, target, cfg, on_bytes, Owners(client, target.base_url))
            with concurrent.futures.ThreadPoolExecutor(cfg.jobs, thread_name_prefix="put") as pool:
                pending: dict[concurrent.futures.Future, str] = {}

                def collect(done) -> None:
                    for fut in done:
                        name = pending.pop(fut)
                        try:
                            result.bytes += fut.result()
                            result.files += 1
                        except Exception as e:  # noqa: BLE001 - reported per file
                            result.failed.append((name, str(e)))
                            bar.write(f"batchfs put: failed: {name}: {e}", file=sys.stderr)
                        bar.set_postfix_str(f"files {result.files}/{total_files}", refresh=False)

                for path, name, _ in walk(root, report):
                    while len(pending) >= 2 * cfg.jobs:
                        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                        collect(done)
                    pending[pool.submit(uploader.upload, path, name)] = name
                while pending:
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    collect(done)
    finally:
        bar.close()
    return result
