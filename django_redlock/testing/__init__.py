"""Real Redis servers for tests and the demo: see :class:`RedisServer`."""

from .server import (
    CLUSTER_ARGS,
    RedisServer,
    SentinelServer,
    bundled_redis_server,
    create_cluster,
    find_redis_server,
    free_port,
    redis_server_version,
)

__all__ = [
    "CLUSTER_ARGS",
    "RedisServer",
    "SentinelServer",
    "bundled_redis_server",
    "create_cluster",
    "find_redis_server",
    "free_port",
    "redis_server_version",
]
