"""Real Redis servers for tests and the demo: see :class:`RedisServer`."""

from .server import (
    CLUSTER_ARGS,
    RedisServer,
    SentinelServer,
    create_cluster,
    find_redis_server,
    free_port,
)

__all__ = [
    "CLUSTER_ARGS",
    "RedisServer",
    "SentinelServer",
    "create_cluster",
    "find_redis_server",
    "free_port",
]
