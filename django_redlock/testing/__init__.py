"""Real Redis servers for tests and the demo: see :class:`RedisServer`."""

from .server import RedisServer, find_redis_server, free_port

__all__ = ["RedisServer", "find_redis_server", "free_port"]
