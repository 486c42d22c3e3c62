"""Store URLs: what each names, and the ones refused with what to write instead."""
from __future__ import annotations

import pytest

from store.errors import ConfigError
from store.tiers.urls import check_store_url, file_root, s3_location


@pytest.mark.parametrize("url, root", [
    ("file:///var/cache/kvwarm", "/var/cache/kvwarm"),
    ("file://~/.cache/kvwarm", "~/.cache/kvwarm"),  # the default: the home directory is not relative
    ("file:///", "/"),
])
def test_file_urls_name_absolute_directories(url: str, root: str) -> None:
    assert file_root(url) == root


@pytest.mark.parametrize("url, words", [
    ("file://relative", ["relative path 'relative'", "file:///absolute/path"]),
    ("file://./.kvwarm-demo", ["relative path './.kvwarm-demo'", "file://~/path"]),
    ("file://", ["names no directory"]),
    ("file:///tmp/a\x00b", ["control character"]),
    ("s3://bucket", ["not a file:// URL"]),
])
def test_bad_file_urls(url: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        file_root(url)
    assert str(err.value).startswith("store.url: ")
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("url, where", [
    ("s3://bucket", ("bucket", "")),
    ("s3://bucket/", ("bucket", "")),
    ("s3://my-bucket.example/kv/prod/", ("my-bucket.example", "kv/prod")),
    ("s3://kvwarm-tests/t-0a1b", ("kvwarm-tests", "t-0a1b")),
    ("s3://abc/date=2026-01-01/x_y", ("abc", "date=2026-01-01/x_y")),
])
def test_s3_urls_name_a_bucket_and_a_prefix(url: str, where: tuple[str, str]) -> None:
    assert s3_location(url) == where


@pytest.mark.parametrize("url, words", [
    ("s3://bucket/../x", ["a '..' segment", "e.g. s3://bucket/x"]),
    ("s3://bucket/a/./b", ["a '.' segment", "e.g. s3://bucket/a/b"]),
    ("s3://bucket/a//b", ["an empty segment ('//')", "e.g. s3://bucket/a/b"]),
    ("s3://bucket/..", ["a '..' segment", "e.g. s3://bucket/kv"]),
    ("s3://bucket/a\nb", ["control character"]),
    ("s3://bucket/a\x7fb", ["control character"]),
    ("s3://ab/prefix", ["'ab'", "at least 3 characters"]),
    ("s3://" + "a" * 64, ["at most 63"]),
    ("s3://My_Bucket/x", ["'My_Bucket'", "not a valid S3 bucket name", "a-z 0-9 . -"]),
    ("s3://-bucket/x", ["starting and ending with a letter or digit"]),
    ("s3://bucket-/x", ["starting and ending with a letter or digit"]),
    ("s3://my..bucket/x", ["no two dots in a row"]),
    ("s3://192.168.5.4/x", ["IP address", "store.s3.endpoint_url"]),
    ("s3://xn--bucket/x", ["reserves"]),
    ("s3://bucket-s3alias/x", ["reserves"]),
    ("s3://bucket?versionId=1", ["not a valid S3 bucket name"]),
    ("s3://", ["not an S3 URL"]),
])
def test_bad_s3_urls(url: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        s3_location(url)
    assert str(err.value).startswith("store.url: ")
    for w in words:
        assert w in str(err.value)


def test_a_store_url_is_checked_tier_by_tier_and_other_schemes_are_the_registry_s() -> None:
    assert check_store_url("file:///var/kv, s3://bucket/kv") == "file:///var/kv, s3://bucket/kv"
    assert check_store_url("mem://a,gs://b") == "mem://a,gs://b"
    with pytest.raises(ConfigError, match="relative path 'var/kv'"):
        check_store_url("s3://bucket/kv,file://var/kv")
