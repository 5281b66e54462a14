"""`kvpool gc` as a user runs it, against a real S3-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpool.agent.tiers.shared import object_name

from .conftest import make_chunk, s3_client


def kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.agent", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_gc_all_with_path_style_addressing_empties_the_pool_prefix(
        moto_endpoint: str, bucket: str) -> None:
    s3 = s3_client(moto_endpoint)
    for i in range(3):
        chunk = make_chunk(i)
        s3.put_object(Bucket=bucket, Key=f"pools/a/{object_name(chunk.key)}", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"pools/b/{object_name(make_chunk(9).key)}", Body=b"x")
    run = kvpool("gc", "--shared", f"s3://{bucket}/pools/a", "--all", "--json",
                 "--endpoint-url", moto_endpoint, "--addressing-style", "path")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["deleted"] == 3
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == [f"pools/b/{object_name(make_chunk(9).key)}"]  # another pool's prefix stays


def test_gc_names_a_bad_addressing_style() -> None:
    run = kvpool("gc", "--shared", "s3://bucket/p", "--all", "--addressing-style", "sideways")
    assert run.returncode == 2
    assert "--addressing-style" in run.stderr and "'sideways'" in run.stderr


def test_gc_all_with_tenants_empties_each_tenants_prefix_and_no_other(
        moto_endpoint: str, bucket: str) -> None:
    s3 = s3_client(moto_endpoint)
    names = {i: object_name(make_chunk(i).key) for i in range(4)}
    s3.put_object(Bucket=bucket, Key=f"pools/a/{names[0]}", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"pools/a/tenants/chat/{names[1]}", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"pools/a/tenants/code/{names[2]}", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"pools/a/tenants/other/{names[3]}", Body=b"x")
    run = kvpool("gc", "--shared", f"s3://{bucket}/pools/a", "--all", "--json",
                 "--tenant", "chat", "--tenant", "code",
                 "--endpoint-url", moto_endpoint, "--addressing-style", "path")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["deleted"] == 3
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == [f"pools/a/tenants/other/{names[3]}"]  # a tenant not named stays


def test_gc_init_store_is_for_a_file_store_only_and_gc_needs_something_to_do() -> None:
    run = kvpool("gc", "--shared", "s3://bucket/p", "--init-store")
    assert run.returncode == 2
    assert "--init-store" in run.stderr and "only a file:// store has one" in run.stderr
    run = kvpool("gc", "--shared", "s3://bucket/p")
    assert run.returncode == 2 and "--ttl DURATION or --all" in run.stderr
