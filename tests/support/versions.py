"""The versions a test run resolved, printed at the top of `make test` and in pytest's header:
what users get from the ranges setup.cfg declares changes under us (redis-py 8.2 did)."""

from __future__ import annotations

from importlib import metadata

from django_redlock.testing import find_redis_server, redis_server_version

PACKAGES = ("redis", "hiredis", "Django", "celery", "django-redis")


def line() -> str:
    found = []
    for package in PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} (not installed)")
    try:
        path = find_redis_server()
        found.append(f"redis-server {redis_server_version(path)} ({path})")
    except RuntimeError as exc:
        found.append(f"redis-server: {exc}")
    return "versions: " + ", ".join(found)


if __name__ == "__main__":
    print(line())
