"""Real Redis servers for tests and the demo (:class:`RedisServer`); a real PostgreSQL for
fenced transactions (:class:`PostgresServer`)."""

from .clock import FakeClock, faketime_server
from .postgres import PostgresServer, find_postgres_bin
from .server import (
    CLUSTER_ARGS,
    RedisServer,
    SentinelServer,
    TLSFiles,
    bundled_redis_server,
    bundled_valkey_server,
    create_cluster,
    find_redis_server,
    free_port,
    make_tls_files,
    redis_server_version,
)

__all__ = [
    "CLUSTER_ARGS",
    "FakeClock",
    "PostgresServer",
    "RedisServer",
    "SentinelServer",
    "TLSFiles",
    "bundled_redis_server",
    "bundled_valkey_server",
    "create_cluster",
    "faketime_server",
    "find_postgres_bin",
    "find_redis_server",
    "free_port",
    "make_tls_files",
    "redis_server_version",
]
