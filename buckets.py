"""Buckets as the store's backend: S3 and every other fsspec filesystem that is not local.

A create is `pipe_file(mode="create")`, which s3fs sends as a PUT with
`If-None-Match: *`: a second create of a key gets 412, raised as `FileExistsError`.
Every call runs in gevent's thread pool, because s3fs's synchronous calls fail on a
gevent-patched thread (their event loop runs in a thread of their own). An object is
durable once the PUT is acknowledged. There are no directories to watch, so readers
poll (waits.py), and each look is a request. A bucket that does not exist is storage
that is not there (StorageUnavailable, a 503), not an object that is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import fsspec

from objectstore import ObjectStore, StorageUnavailable, run_in_threadpool

T = TypeVar("T")

# Fail over to a 503 within seconds when the endpoint is down, instead of botocore's
# default minute of retries; explicit s3fs options (FSSPEC_S3_*) still take precedence.
S3_RETRIES = 2
S3_DEFAULTS: dict[str, object] = {
    "config_kwargs": {
        "connect_timeout": 2,
        "read_timeout": 15,
        "retries": {"max_attempts": 2, "mode": "standard"},
    },
}


class Bucket(ObjectStore):
    """Objects in a bucket (or any remote fsspec filesystem), under one prefix."""

    is_local = False

    def __init__(self, url: str) -> None:
        super().__init__(run_in_threadpool)
        options = {}
        if url.startswith(("s3://", "s3a://")):
            options = {**S3_DEFAULTS, **fsspec.config.conf.get("s3", {})}
        filesystem, root = fsspec.core.url_to_fs(url, **options)
        if options:
            filesystem.retries = S3_RETRIES  # s3fs's own retry loop, on top of botocore's
        self.filesystem = filesystem
        self.root = root.rstrip("/")

    def _guarded(self, function: Callable[..., T], *args: object, **kwargs: object) -> T:
        """As every backend's, but a missing bucket is storage that is not there, not a
        missing object: s3fs raises FileNotFoundError for both."""
        try:
            return super()._guarded(function, *args, **kwargs)
        except FileNotFoundError as error:
            if _bucket_is_missing(error):
                raise StorageUnavailable(f"the bucket does not exist: {error}") from error
            raise

    def create(self, key: str, data: bytes, *, verified_on_load: bool = False) -> None:
        self._guarded(self.filesystem.pipe_file, self.path(key), data, mode="create")

    def delete(self, key: str) -> None:
        self._guarded(self.filesystem.rm_file, self.path(key))

    def delete_many(self, keys: list[str]) -> None:
        """One batched request on S3."""
        try:
            self._guarded(self.filesystem.rm, [self.path(key) for key in keys])
        except FileNotFoundError:
            pass

    def _remove_tree(self, path: str) -> None:
        self.filesystem.rm(path, recursive=True)

    def touch(self, key: str) -> None:
        self._guarded(self.filesystem.pipe_file, self.path(key), b"")

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self._guarded(_read, self.filesystem, self.path(key), start, end)

    def modified(self, key: str) -> float | None:
        head = self._head(key)
        modified = head and (head.get("LastModified") or head.get("mtime"))
        return modified.timestamp() if hasattr(modified, "timestamp") else modified

    def identity(self, key: str) -> object | None:
        head = self._head(key)
        return head and (head.get("ETag") or head.get("mtime"))

    def _head(self, key: str) -> dict[str, object] | None:
        """One HEAD on S3 (s3fs's info() adds a LIST when the object is missing)."""
        filesystem = self.filesystem
        try:
            if hasattr(filesystem, "call_s3"):
                bucket, path, _ = filesystem.split_path(self.path(key))
                return self._guarded(filesystem.call_s3, "head_object", Bucket=bucket, Key=path)
            return self._guarded(filesystem.info, self.path(key), refresh=True)
        except FileNotFoundError:
            return None

    def may_exist(self, key: str) -> bool:
        """Always: the read that follows is the check, one request either way."""
        return True

    def make_durable(self, key: str) -> None:
        """Nothing: an object is durable once it exists."""

    def make_directory(self, prefix: str) -> None:
        """Nothing: buckets have no directories."""

    def list(self, prefix: str) -> list[str]:
        try:
            entries = self._guarded(
                self.filesystem.ls, self.path(prefix), detail=False, refresh=True
            )
        except FileNotFoundError:
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def list_tree(self, prefix: str) -> list[str]:
        """One listing without a delimiter (a page per 1,000 keys)."""
        top = self.path(prefix)
        try:
            found = self._guarded(self.filesystem.find, top)
        except FileNotFoundError:
            return []
        return [path[len(top) :].lstrip("/") for path in found]

    def list_after(self, prefix: str, after: str) -> list[str]:
        """On S3 the listing starts there (StartAfter): its cost does not grow with the
        names before it."""
        filesystem = self.filesystem
        if not hasattr(filesystem, "call_s3"):
            return super().list_after(prefix, after)
        bucket, folder, _ = filesystem.split_path(self.path(prefix))
        request = {"Bucket": bucket, "Prefix": f"{folder}/", "StartAfter": f"{folder}/{after}"}
        names: list[str] = []
        while True:
            page = self._guarded(filesystem.call_s3, "list_objects_v2", Delimiter="/", **request)
            names += [entry["Key"].rsplit("/", 1)[-1] for entry in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return names
            request["ContinuationToken"] = page["NextContinuationToken"]


def _read(filesystem: fsspec.AbstractFileSystem, path: str, start: int, end: int | None) -> bytes:
    """A ranged GET; a range past the end (416 on some S3s) reads what there is."""
    try:
        return filesystem.cat_file(path, start=start, end=end)
    except OSError as error:
        if "range" not in str(error).lower():
            raise
        return filesystem.cat_file(path)[start:end]


def _bucket_is_missing(error: FileNotFoundError) -> bool:
    """Whether S3 said NoSuchBucket. A HEAD's answer has no body, so a HEAD of an object
    in a missing bucket stays a missing object."""
    cause = error.__cause__ or error.__context__
    response = getattr(cause, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket"
