"""Real Redis servers for tests and the demo: see :class:`RedisServer`."""

from .server import (
    CLUSTER_ARGS,
    RedisServer,
    SentinelServer,
    TLSFiles,
    bundled_redis_server,
    create_cluster,
    find_redis_server,
    free_port,
    make_tls_files,
    redis_server_version,
)

__all__ = [
    "CLUSTER_ARGS",
    "RedisServer",
    "SentinelServer",
    "TLSFiles",
    "bundled_redis_server",
    "create_cluster",
    "find_redis_server",
    "free_port",
    "make_tls_files",
    "redis_server_version",
]
