"""G4 on an S3-compatible object store (`s3://bucket/prefix`), through boto3.

Layout: `<prefix>/<key hex>.kvc`, flat. Object stores have no directories to
keep small, and uniformly random hex names already spread requests over the
store's partitions.

Where settings come from: the agent config first (`endpointUrl`, `region`,
`addressingStyle`, `credentialsFile` — a mounted Secret in the AWS shared
credentials format), then the standard AWS chain (`AWS_ENDPOINT_URL`,
`AWS_REGION`, `AWS_ACCESS_KEY_ID`, `~/.aws/...`, IRSA/pod identity).

Two clients share the session: one with the standard retry mode for GET, PUT,
DELETE and LIST (they run in worker threads, where a retry is cheap), and one
with a single attempt for the presence checks of LOOKUP and the health probe,
where a retry would only outlive the caller's budget.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import boto3
import botocore.session
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    ReadTimeoutError,
)

from . import base
from .base import ChunkRecord
from .shared import LOOKUP_THREADS, ObjectInfo, SharedChunkTier, key_of, object_name

if TYPE_CHECKING:
    from ..config import SharedTier
    from ..metrics import AgentMetrics

RETRY_ATTEMPTS = 3
MIN_PART_BYTES = 5 << 20
"""S3's smallest part (except the last)."""
MAX_PART_BYTES = 64 << 20
_ABSENT = {"404", "NoSuchKey", "NotFound"}
# Errors after which no request can succeed until someone fixes the store or
# the credentials: the tier turns unhealthy and the probe watches for the fix.
_OUTAGE_CODES = {
    "AccessDenied": "access denied",
    "InvalidAccessKeyId": "invalid access key",
    "SignatureDoesNotMatch": "bad credentials",
    "ExpiredToken": "expired credentials",
    "InvalidToken": "invalid credentials",
    "NoSuchBucket": "bucket missing",
    "403": "access denied",
}


def bucket_and_prefix(url: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b/"); no prefix -> ("bucket", "")."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def _session(cfg: SharedTier) -> boto3.Session:
    if cfg.credentials_file is None:
        return boto3.Session()
    core = botocore.session.Session()
    # Same as AWS_SHARED_CREDENTIALS_FILE, but only for this tier.
    core.set_config_variable("credentials_file", str(cfg.credentials_file))
    return boto3.Session(botocore_session=core)


def _client_config(cfg: SharedTier, attempts: int) -> Config:
    timeout = float(cfg.request_timeout)
    return Config(
        region_name=cfg.region,
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"mode": "standard", "max_attempts": attempts},
        # Uploads and presence checks run concurrently; each needs a connection.
        max_pool_connections=cfg.write_concurrency + LOOKUP_THREADS,
        s3={"addressing_style": cfg.addressing_style},
        # The blob carries its own xxh3 checksum, verified on every read; the
        # SDK's default CRC headers break some S3-compatible stores.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


class S3SharedTier(SharedChunkTier):
    scheme = "s3"

    def __init__(self, cfg: SharedTier, metrics: AgentMetrics | None = None) -> None:
        super().__init__(cfg, metrics)
        self.bucket, self.prefix = bucket_and_prefix(cfg.url)
        session = _session(cfg)
        self._s3: Any = session.client("s3", endpoint_url=cfg.endpoint_url,
                                       config=_client_config(cfg, RETRY_ATTEMPTS))
        self._fast: Any = session.client("s3", endpoint_url=cfg.endpoint_url,
                                         config=_client_config(cfg, 1))
        self.multipart_threshold = int(cfg.multipart_threshold)
        part = min(max(self.multipart_threshold, MIN_PART_BYTES), MAX_PART_BYTES)
        # Parts go up one after the other in the calling worker thread: the
        # write-behind queue already runs `writeConcurrency` uploads at once.
        self._transfer = TransferConfig(multipart_threshold=self.multipart_threshold,
                                        multipart_chunksize=part, use_threads=False)

    def object_key(self, key: bytes) -> str:
        return f"{self.prefix}{object_name(key)}"

    # -- store primitives

    def _store_head(self, key: bytes) -> bool:
        try:
            self._fast.head_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as e:
            if _code(e) in _ABSENT:
                return False
            raise
        return True

    def _store_get(self, key: bytes) -> bytes | None:
        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as e:
            if _code(e) in _ABSENT:
                return None
            raise
        body = resp["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def _store_put(self, rec: ChunkRecord) -> None:
        blob = b"".join(base.encode(rec))
        name = self.object_key(rec.key)
        if len(blob) >= self.multipart_threshold:
            self._s3.upload_fileobj(io.BytesIO(blob), self.bucket, name, Config=self._transfer)
        else:
            self._s3.put_object(Bucket=self.bucket, Key=name, Body=blob)

    def _store_delete(self, key: bytes) -> bool:
        # S3 answers 204 whether or not the object existed; asking first would
        # double the requests for an answer nobody needs.
        self._s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        return True

    def _store_list(self) -> Iterator[ObjectInfo]:
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                name: str = obj["Key"]
                rest = name[len(self.prefix):]
                key = key_of(rest) if "/" not in rest else None
                if key is None:
                    continue  # not ours: never listed, so gc never deletes it
                yield ObjectInfo(name, key, int(obj["Size"]), obj["LastModified"].timestamp())
        yield from self._unfinished_uploads()

    def _unfinished_uploads(self) -> Iterator[ObjectInfo]:
        """Multipart uploads an agent started and never finished (it crashed mid-way).

        Their parts are billed storage that no listing of objects shows.
        """
        pages = self._s3.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for up in page.get("Uploads", []):
                rest = up["Key"][len(self.prefix):]
                if "/" in rest or key_of(rest) is None:
                    continue
                yield ObjectInfo(up["Key"], None, 0, up["Initiated"].timestamp(),
                                 upload_id=up["UploadId"])

    def _store_remove(self, objs: Sequence[ObjectInfo]) -> int:
        failed = 0
        for up in (o for o in objs if o.upload_id):
            try:
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=up.name,
                                                UploadId=up.upload_id)
            except ClientError as e:
                if _code(e) != "NoSuchUpload":  # finished or aborted meanwhile: fine
                    failed += 1
        objs = [o for o in objs if not o.upload_id]
        for i in range(0, len(objs), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": o.name} for o in objs[i : i + 1000]]
            resp = self._s3.delete_objects(Bucket=self.bucket,
                                           Delete={"Objects": batch, "Quiet": True})
            failed += len(resp.get("Errors", []))
        return failed

    def _store_probe(self) -> None:
        self._fast.head_bucket(Bucket=self.bucket)

    # -- failure classification

    def _outage(self, exc: BaseException) -> str | None:
        if isinstance(exc, ClientError):
            code = _code(exc)
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code in _OUTAGE_CODES:
                return f"s3 {_OUTAGE_CODES[code]}: {exc}"
            if status >= 500:
                return f"s3 server error: {exc}"
            return None
        if isinstance(exc, BotoCoreError):
            # Connection refused or reset, timeouts, no credentials, bad endpoint.
            return f"s3 unreachable: {exc}"
        return None

    def _is_timeout(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectTimeoutError | ReadTimeoutError)

    def close(self) -> None:
        super().close()
        self._s3.close()
        self._fast.close()


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
