"""The bucket backend against moto_server: a missing bucket is storage that is not
there (StorageUnavailable, a 503 to clients), never a missing object (a 404)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import fsspec
import pytest
from conftest import create_bucket, s3_environment

from buckets import Bucket
from objectstore import StorageUnavailable


@pytest.fixture
def bucket_at(moto_s3: str, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Bucket]:
    for name, value in s3_environment(moto_s3).items():
        monkeypatch.setenv(name, value)
    fsspec.AbstractFileSystem.clear_instance_cache()
    for implementation in fsspec.registry.values():
        implementation.clear_instance_cache()
    return lambda name: Bucket(f"s3://{name}/picomq")


def test_a_missing_object_in_a_bucket_is_not_found(
    moto_s3: str, bucket_at: Callable[[str], Bucket]
) -> None:
    objects = bucket_at(create_bucket(moto_s3))
    with pytest.raises(FileNotFoundError):
        objects.read("streams/nothing/meta.json")
    assert objects.list("streams/nothing") == []
    assert objects.identity("streams/nothing/meta.json") is None


@pytest.mark.parametrize(
    "call",
    [
        lambda objects: objects.create("log/m/000000000001", b"x"),
        lambda objects: objects.touch("cluster/members/m"),
        lambda objects: objects.read("streams/s/meta.json"),
        lambda objects: objects.list("cluster/partitions"),
        lambda objects: objects.list_after("streams/s/1/seg", "0"),
        lambda objects: objects.delete_many(["log/m/000000000001"]),
    ],
    ids=["create", "touch", "read", "list", "list_after", "delete_many"],
)
def test_a_missing_bucket_is_storage_unavailable(
    bucket_at: Callable[[str], Bucket], call: Callable[[Bucket], object]
) -> None:
    objects = bucket_at(f"never-created-{uuid.uuid4().hex[:12]}")
    with pytest.raises(StorageUnavailable, match="bucket"):
        call(objects)
