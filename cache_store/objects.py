"""An S3-compatible bucket as the store sees it: named objects of bytes with metadata, and
the conditional requests (If-Match, If-None-Match) the writer leases and manifests need.
boto3 underneath (AWS S3, Ceph RGW, MinIO, SeaweedFS); credentials the standard AWS way
(environment, shared files, instance roles).

Every failure becomes one of three things: absent (None), `Conflict` (a conditional request
that lost) or `ObjectStoreDown` (unreachable, timed out, refused, or an answer that makes no
sense), so the tier above never sees botocore. An object store that refuses If-Match on
DELETE gets the ETag checked just before a plain delete instead.

A request waits at most ATTEMPTS x (connect + read timeout) for a bucket that does not answer.
Once one got no answer, the bucket counts as down until one does: meanwhile one request at a
time tries it, at most every BREAK_SECONDS, and every other fails at once, so a hung endpoint
holds no RPC thread of the store that could be served from its local tier.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from botocore.exceptions import NoCredentialsError, ParamValidationError, PartialCredentialsError

from agentkv.errors import Unavailable
from cache_store.metrics import StoreMetrics

_ABSENT = {"404", "NoSuchKey", "NotFound"}  # NoSuchBucket is not: a misconfigured store
BINARY = "application/octet-stream"  # a payload file (a safetensors length never starts "{")
ATTEMPTS = 2  # tries of one request (botocore's max_attempts would count retries)
BREAK_SECONDS = 2.0  # after a request got no answer, others fail at once this long
_LOST_RACE = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
# What an object store answers a condition it lacks (If-Match on DELETE: 501 from AWS S3
# before it had it, 400 from others).
_REFUSED = {"501", "NotImplemented", "400", "InvalidArgument", "InvalidRequest", "BadRequest"}
# An object store that answered, and refused this store: its credentials or permissions.
_DENIED = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}
# botocore's own refusals, before any request went out: not a bucket that did not answer.
_NO_CREDENTIALS = (NoCredentialsError, PartialCredentialsError)
_NOT_SENT = (*_NO_CREDENTIALS, ParamValidationError)
# A bucket name botocore sends (its own check); S3's names for new buckets are narrower
# (3 to 63 lowercase letters, digits, dots and hyphens), but older ones and other servers'
# may be uppercase or underscored.
_BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_NEW_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

log = logging.getLogger("agentkv.store")


class ObjectStoreDown(Unavailable):
    """The object store did not answer, or answered with an error that is not ours."""


class Refused(ObjectStoreDown):
    """The object store answered and refused this store (its credentials or permissions)."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message} (check the store's S3 credentials, AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or its AWS profile, and that they may read and write the "
            "bucket)"
        )


def failure(exc: ObjectStoreDown) -> str:
    """How a log line names why the bucket cannot be used: refused (its credentials or
    permissions: the operator's to fix) or unreachable (it may come back)."""
    return "refused" if isinstance(exc, Refused) else "unreachable"


class ConditionRefused(ObjectStoreDown):
    """The object store refused a conditional request for its condition (501 or 400)."""


class Conflict(Exception):
    """A conditional request found the object changed or gone (If-Match) or present
    (If-None-Match)."""


@dataclass(frozen=True, slots=True)
class Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> Location:
        """'s3://bucket/some/prefix' -> Location('bucket', 'some/prefix/')."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"--object-store must be s3://BUCKET[/PREFIX], got {url!r}")
        if not _BUCKET_NAME.fullmatch(parsed.netloc):
            raise ValueError(
                f"--object-store {url}: {parsed.netloc!r} is no bucket name: one is up to 255 "
                "letters, digits, dots, hyphens and underscores"
            )
        prefix = parsed.path.strip("/")
        if parsed.query or parsed.fragment or parsed.params or ";" in url:
            raise ValueError(f"--object-store {url}: a query or fragment is not taken")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError(f"--object-store {url}: the prefix has an empty, '.' or '..' part")
        return cls(parsed.netloc, f"{prefix}/" if prefix else "")

    @staticmethod
    def check_endpoint(url: str) -> None:
        """ValueError naming --s3-endpoint unless it is http(s)://HOST[:PORT]: botocore
        raised a traceback for one that is no URL, and took another scheme, then failed
        every call (the store said only "unreachable"), or read a path's first part as the
        bucket."""
        parsed = urlparse(url)
        try:
            parsed.port  # noqa: B018 (a port that is no number, or past 65535, raises)
        except ValueError as exc:
            raise ValueError(f"--s3-endpoint {url}: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"--s3-endpoint must be http(s)://HOST[:PORT], got {url!r}")
        if parsed.path.strip("/") or parsed.query or parsed.fragment or parsed.params:
            raise ValueError(
                f"--s3-endpoint {url}: no path or query (the bucket and prefix go in "
                "--object-store)"
            )

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True, slots=True)
class Got:
    body: bytes
    metadata: dict[str, str]
    etag: str


class Bucket:
    """One bucket and key prefix. Thread-safe (boto3 clients are); each call is timed and
    counted per operation in `metrics`."""

    def __init__(
        self,
        location: Location,
        endpoint: str,
        metrics: StoreMetrics,
        timeout_seconds: float = 10.0,
    ) -> None:
        import boto3  # only a store with an object store pays for importing it
        from botocore.config import Config

        self.location, self.metrics = location, metrics
        self.moved: collections.Counter[str] = collections.Counter()  # payload bytes by op
        self.down = False  # a request got no answer, and none has since
        self.on_down: Callable[[str], None] = lambda reason: None  # when one first gets none
        self.conditional_deletes = True  # until the object store refuses one
        self._retry_at = 0.0  # time.monotonic(): while down, calls before it fail untried
        self._health = threading.Lock()
        connect_seconds = min(timeout_seconds, 3.0)
        self._longest = ATTEMPTS * (connect_seconds + timeout_seconds)  # a request unanswered
        config = Config(
            connect_timeout=connect_seconds,
            read_timeout=timeout_seconds,
            retries={"total_max_attempts": ATTEMPTS, "mode": "standard"},
            max_pool_connections=16,
            s3={"addressing_style": "path"} if endpoint else {},
        )
        if not _NEW_BUCKET_NAME.fullmatch(location.bucket):  # said once, at the store's start
            log.warning(
                "the object store's bucket name is not one S3 takes for a new bucket (3 to 63 "
                "lowercase letters, digits, dots and hyphens): an older bucket's, or another "
                "server's, may be",
                extra={"bucket": location.bucket},
            )
        session = boto3.session.Session()
        self._client = session.client(
            "s3",
            endpoint_url=endpoint or None,
            region_name=session.region_name or "us-east-1",
            config=config,
        )

    def name(self, key: str) -> str:
        return self.location.prefix + key

    def ensure_bucket(self) -> None:
        """Creates the bucket if it does not exist (a test server, a fresh MinIO)."""
        with self._call("head_bucket"):
            try:
                self._client.head_bucket(Bucket=self.location.bucket)
                return
            except Exception as exc:
                if _code(exc) not in _ABSENT:
                    raise
        with self._call("create_bucket"):
            try:
                self._client.create_bucket(Bucket=self.location.bucket)
            except Exception as exc:
                if _code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def put(
        self,
        key: str,
        body: bytes,
        metadata: dict[str, str],
        if_none_match: bool = False,
        if_match: str = "",
    ) -> str:
        """Stores `body` under `key`; returns its ETag. Conflict when a condition fails."""
        args = {"Bucket": self.location.bucket, "Key": self.name(key), "Body": body}
        args["Metadata"] = metadata
        args["ContentType"] = "application/json" if body[:1] == b"{" else BINARY
        if if_none_match:
            args["IfNoneMatch"] = "*"
        if if_match:
            args["IfMatch"] = if_match
        with self._call("put", len(body), conditional=bool(if_none_match or if_match)):
            reply = self._client.put_object(**args)
        return reply["ETag"]

    def get(self, key: str) -> Got | None:
        """The object's bytes and metadata, None when there is none."""
        with self._call("get", absent_ok=True) as call:
            reply = self._client.get_object(Bucket=self.location.bucket, Key=self.name(key))
            body = reply["Body"].read()
            call.num_bytes = len(body)
            return Got(body, dict(reply.get("Metadata", {})), reply["ETag"])
        return None

    def head(self, key: str) -> Got | None:
        """The object's metadata and ETag (no body), None when there is none."""
        with self._call("head", absent_ok=True):
            reply = self._client.head_object(Bucket=self.location.bucket, Key=self.name(key))
            return Got(b"", dict(reply.get("Metadata", {})), reply["ETag"])
        return None

    def delete(self, key: str, if_match: str = "") -> None:
        """Deletes the object; with `if_match`, only while its ETag is that one (Conflict if
        it is not, or is gone: S3 and SeaweedFS answer 412 to both). Where the object store
        refuses If-Match on DELETE, the ETag is read just before an unconditional delete
        (the writer lease keeps other stores from writing the object in between)."""
        if if_match and self.conditional_deletes:
            try:
                self._delete(key, if_match)
                return
            except ConditionRefused as exc:
                self._refused_conditional_delete(exc)
        if if_match:
            there = self.head(key)
            if there is None or there.etag != if_match:
                raise Conflict("412: checked before deleting")
        self._delete(key)

    def _delete(self, key: str, if_match: str = "") -> None:
        args = {"Bucket": self.location.bucket, "Key": self.name(key)}
        if if_match:
            args["IfMatch"] = if_match
        with self._call("delete", conditional=bool(if_match)):
            self._client.delete_object(**args)

    def _refused_conditional_delete(self, exc: ConditionRefused) -> None:
        if self.conditional_deletes:  # said once
            self.conditional_deletes = False
            log.warning(
                "object store refuses conditional deletes: each deletion reads the object's "
                "ETag first, then deletes it unconditionally",
                extra={"object_store": str(self.location), "reason": exc.message},
            )

    def list(self, prefix: str, start_after: str = "", limit: int = 1000) -> Iterator[str]:
        """Keys (without the location's prefix) under `prefix`, in order, after `start_after`."""
        paginator = self._client.get_paginator("list_objects_v2")
        args = {"Bucket": self.location.bucket, "Prefix": self.name(prefix)}
        if start_after:
            args["StartAfter"] = self.name(start_after)
        count = 0
        with self._call("list"):
            for page in paginator.paginate(**args, PaginationConfig={"PageSize": min(limit, 1000)}):
                for item in page.get("Contents", []):
                    yield item["Key"][len(self.location.prefix) :]
                    count += 1
                    if count >= limit:
                        return

    def _call(
        self, op: str, num_bytes: int = 0, conditional: bool = False, absent_ok: bool = False
    ) -> _Call:
        return _Call(self, op, num_bytes, conditional, absent_ok)

    def _admit(self) -> None:
        """Lets a request try the bucket: always while it is up; while it is down, one at a
        time, BREAK_SECONDS after the last one got no answer (ObjectStoreDown for others)."""
        with self._health:
            if not self.down:
                return
            now = time.monotonic()
            if now < self._retry_at:
                raise ObjectStoreDown(
                    f"object store {self.location}: unreachable (a request got no answer; "
                    "not tried again yet)"
                )
            self._retry_at = now + self._longest  # the others fail while this one tries

    def _unsent(self) -> None:
        """A request botocore refused to send: while the bucket is down, the next may try
        after BREAK_SECONDS, as after one that got no answer."""
        with self._health:
            if self.down:
                self._retry_at = time.monotonic() + BREAK_SECONDS

    def _answered(self, answered: bool, reason: str = "") -> None:
        """Whether a request got an answer; `reason`, why not (said to on_down)."""
        with self._health:
            went_down = not answered and not self.down
            if answered:
                self.down = False
            else:
                self.down, self._retry_at = True, time.monotonic() + BREAK_SECONDS
        if went_down:
            self.on_down(reason)


class _Call:
    """Times one request, counts its bytes, and turns botocore's errors into ours."""

    def __init__(
        self, bucket: Bucket, op: str, num_bytes: int, conditional: bool, absent_ok: bool
    ) -> None:
        self.bucket, self.metrics, self.op, self.num_bytes = bucket, bucket.metrics, op, num_bytes
        self.conditional, self.absent_ok = conditional, absent_ok

    def __enter__(self) -> _Call:
        self.start = time.perf_counter()
        self.bucket._admit()  # a hung or blackholed endpoint costs seconds
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self.metrics.object_seconds.labels(self.op).observe(time.perf_counter() - self.start)
        code = _code(exc) if exc is not None else ""
        closed = isinstance(exc, GeneratorExit)  # a listing left early, after a page came
        if isinstance(exc, _NOT_SENT):  # botocore sent nothing: no word on the bucket
            self.bucket._unsent()
        else:
            answered = exc is None or closed or bool(code)  # no code: no answer
            self.bucket._answered(answered, "" if answered else f"{self.op}: {exc}")
        if closed:
            return False
        if exc is None:
            if self.num_bytes:
                self.metrics.object_bytes.labels(self.op).inc(self.num_bytes)
                self.bucket.moved[self.op] += self.num_bytes
            return False
        if self.absent_ok and code in _ABSENT:
            return True  # the caller's `return None` after the block runs
        if self.conditional and (code in _LOST_RACE or code in _ABSENT):  # changed, or gone
            raise Conflict(code) from exc
        self.metrics.object_errors.labels(self.op).inc()
        what = code or type(exc).__name__
        error = ConditionRefused if self.conditional and code in _REFUSED else ObjectStoreDown
        if code in _DENIED or isinstance(exc, _NO_CREDENTIALS):
            error = Refused
        raise error(
            f"object store {self.bucket.location}: {self.op} failed: {what}: {exc}"
        ) from exc


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    error = response.get("Error", {})
    return str(error.get("Code", "")) or str(
        response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    )
