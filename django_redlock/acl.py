"""What a Redis user (an ACL) needs to run this app, and what an ACL's refusal means.

Every key this app writes, and every channel it uses, starts with the backend's KEY_PREFIX,
so a user limited to ``~<prefix>* &<prefix>*`` and the commands below runs every lock kind.
A refusal becomes a :class:`~.exceptions.MissingPermission` naming what to add. At startup
the user's permissions are checked without running anything (``redis.acl_check_cmd`` in a
script, Redis 7+): see :func:`check`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from .exceptions import MissingPermission
from .scripts import all_scripts, script

README = "README's 'Redis users, ACLs and TLS'"

# Placeholders in the probe's example arguments.
KEY, CHANNEL, SHARD_CHANNEL, SHA = "<key>", "<channel>", "<shard-channel>", "<sha>"

#: Every command a backend on one Redis sends (name as ACL spells it -> example arguments):
#: what the app sends itself, then what its Lua scripts run (Redis checks those too).
COMMANDS: dict[str, tuple[str, ...]] = {
    "evalsha": ("EVALSHA", SHA, "1", KEY),
    "script|load": ("SCRIPT", "LOAD", "return 1"),
    "scan": ("SCAN", "0"),  # the admin, `redlock list|purge|top`: never KEYS
    "subscribe": ("SUBSCRIBE", CHANNEL),  # waiters' wake-ups
    "unsubscribe": ("UNSUBSCRIBE", CHANNEL),
    "ping": ("PING",),  # health
    "select": ("SELECT", "0"),  # a URL's /db other than 0
    "exists": ("EXISTS", KEY),
    "pttl": ("PTTL", KEY),
    "get": ("GET", KEY),
    "set": ("SET", KEY, "v"),
    # Run inside the scripts:
    "time": ("TIME",),
    "type": ("TYPE", KEY),
    "del": ("DEL", KEY),
    "pexpire": ("PEXPIRE", KEY, "1"),
    "hget": ("HGET", KEY, "f"),
    "hset": ("HSET", KEY, "f", "v"),
    "hdel": ("HDEL", KEY, "f"),
    "hgetall": ("HGETALL", KEY),
    "lindex": ("LINDEX", KEY, "0"),
    "lpop": ("LPOP", KEY),
    "rpush": ("RPUSH", KEY, "v"),
    "lrem": ("LREM", KEY, "0", "v"),
    "llen": ("LLEN", KEY),
    "zadd": ("ZADD", KEY, "1", "m"),
    "zrem": ("ZREM", KEY, "m"),
    "zrange": ("ZRANGE", KEY, "0", "0"),
    "zrangebyscore": ("ZRANGEBYSCORE", KEY, "0", "1"),
    "zcard": ("ZCARD", KEY),
    "zcount": ("ZCOUNT", KEY, "0", "1"),
    "zscore": ("ZSCORE", KEY, "m"),
    "zremrangebyscore": ("ZREMRANGEBYSCORE", KEY, "0", "1"),
    "publish": ("PUBLISH", CHANNEL, "m"),
}
#: Sentinel's master: ``min_replicas`` waits for the replicas in the acquire's round trip.
SENTINEL_COMMANDS: dict[str, tuple[str, ...]] = {"wait": ("WAIT", "0", "0")}
#: Redis Cluster: redis-py's discovery of the slots and of the commands' keys, and sharded
#: pub/sub (Redis 7+) for the wake-ups.
CLUSTER_COMMANDS: dict[str, tuple[str, ...]] = {
    "cluster|slots": ("CLUSTER", "SLOTS"),
    "asking": ("ASKING",),  # a slot on the move answers ASK: redis-py then sends ASKING
    "command": ("COMMAND",),
    "spublish": ("SPUBLISH", SHARD_CHANNEL, "m"),
    "ssubscribe": ("SSUBSCRIBE", SHARD_CHANNEL),
    "sunsubscribe": ("SUNSUBSCRIBE", SHARD_CHANNEL),
}
#: The commands whose refusal may be of their channel, not of the command.
CHANNEL_COMMANDS = {"subscribe", "publish", "ssubscribe", "spublish"}
#: What the app asks the sentinels themselves (their own users, in ``sentinel_kwargs``),
#: and the channels of theirs it listens to: the switches they announce.
SENTINEL_OWN_COMMANDS = (
    "sentinel|masters", "sentinel|get-master-addr-by-name", "ping", "subscribe",
)  # fmt: skip
SENTINEL_CHANNELS = ("+promoted-slave", "+switch-master")
#: Their user's rules (``ACL SETUSER sentinel-locks reset resetchannels on >PASSWORD ...``).
SENTINEL_OWN_RULES = (
    *(f"+{command}" for command in SENTINEL_OWN_COMMANDS),
    *(f"&{channel}" for channel in SENTINEL_CHANNELS),
)


class RedisUser(Protocol):
    """What this module reads of a backend on Redis (``backends.redis.RedisBackend`` and its
    subclasses, which sit a layer above and import this module, never the reverse)."""

    @property
    def acl_commands(self) -> Mapping[str, tuple[str, ...]]:
        """The commands it sends, with example arguments: :data:`COMMANDS`, with a
        Sentinel's :data:`SENTINEL_COMMANDS` or a Cluster's :data:`CLUSTER_COMMANDS` added
        by its class."""

    @property
    def key_prefix(self) -> str: ...

    @property
    def inbox_prefix(self) -> str: ...

    @property
    def client(self) -> Any: ...

    def key(self, name: str) -> str: ...

    def inbox_for(self, name: str) -> str: ...

    def describe(self) -> str: ...

    def execute(self, op: Any) -> Any: ...

    def op_probe(self) -> Any: ...


def commands(backend: RedisUser) -> dict[str, tuple[str, ...]]:
    """The commands ``backend`` sends, with example arguments."""
    return dict(backend.acl_commands)


def prefix_pattern(backend: RedisUser) -> str:
    return f"{backend.key_prefix}*"


def rule(backend: RedisUser) -> str:
    """What ``backend``'s Redis user needs, as ``ACL SETUSER <user>`` takes it (added to what
    the user has: on a django-redis cache's user, the cache keeps its own keys)."""
    pattern = prefix_pattern(backend)
    return f"~{pattern} &{pattern} " + " ".join(f"+{name}" for name in commands(backend))


def user(backend: RedisUser) -> str:
    """The name of the backend's Redis user (``default`` when the URL names none)."""
    try:
        kwargs = backend.client.connection_pool.connection_kwargs
    except Exception:  # a cluster: no single pool
        kwargs = getattr(getattr(backend.client, "nodes_manager", None), "connection_kwargs", {})
    return str(kwargs.get("username") or "default")


# -- what a refusal says -------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """What an ACL refused: a ``command`` (by name, or "" when a script's command was refused
    without its name), or access to a ``key`` or a ``channel``; ``script`` ran it, if any."""

    what: str  # "command", "key" or "channel"
    command: str = ""
    script: str = ""


_COMMAND = re.compile(r"no permissions to run the '([^']+)' command")
_KEY = re.compile(r"permissions to access one of the keys|can't access at least one of the keys")
_CHANNEL = re.compile(r"access one of the channels|publish to the channel|channels? mentioned")
_IN_SCRIPT = re.compile(r"can't run this command or subcommand")
_SHA = re.compile(r"(?:script: |f_)([0-9a-f]{40})")


def refusal(error: BaseException) -> Refusal | None:
    """What a Redis error says the user may not do; None for any other error."""
    from redis.exceptions import NoPermissionError, ResponseError

    if not isinstance(error, ResponseError):
        return None
    message = str(error)
    sha = _SHA.search(message)
    script = _script_name(sha.group(1)) if sha else ""
    found = _COMMAND.search(message)
    if found:
        return Refusal("command", found.group(1).lower(), script)
    if _KEY.search(message):
        return Refusal("key", "", script)
    if _CHANNEL.search(message):
        return Refusal("channel", "", script)
    if _IN_SCRIPT.search(message) or isinstance(error, NoPermissionError):
        return Refusal("command", "", script)
    return None


def _script_name(sha: str) -> str:
    return next((s.name for s in all_scripts() if s.sha == sha), "")


def first_refused(replies: Any) -> BaseException | None:
    """The first reply of a pipeline that is an ACL's refusal."""
    for reply in replies if isinstance(replies, list) else ():
        if isinstance(reply, BaseException) and refusal(reply) is not None:
            return reply
    return None


def needs_probe(error: BaseException) -> bool:
    """Whether the refused command must be found by the probe (the error names none)."""
    found = refusal(error)
    return found is not None and found.what == "command" and not found.command


def missing_permission(
    backend: RedisUser, name: str, error: BaseException, refused: Sequence[str] = ()
) -> MissingPermission:
    """The error to raise for a refusal: what the user may not do, and the rule to add.
    ``refused``: the commands the probe found refused (for a script's unnamed command)."""
    found = refusal(error) or Refusal("command")
    pattern = prefix_pattern(backend)
    where = f" (in the script {found.script}.lua)" if found.script else ""
    if found.what == "key":
        needs, what = f"~{pattern}", f"use the keys {pattern}{where}"
    elif found.what == "channel":
        needs, what = f"&{pattern}", f"use the pub/sub channels {pattern}{where}"
    elif found.command or refused:
        names = [found.command] if found.command else list(refused)
        needs = " ".join(f"+{n}" for n in names)
        what = f"run {', '.join(n.upper() for n in names)}{where}"
    else:  # Redis 6: a script's refused command is not named, and cannot be probed
        needs, what = rule(backend), f"run a command{where}"
    who, lock = user(backend), f"lock {name!r}: " if name else ""
    return MissingPermission(
        f"{lock}backend {backend.describe()}: the Redis user {who!r} may not {what}."
        f" Add it with: ACL SETUSER {who} {needs}. {_everything(backend, who)}"
        f" Redis said: {mask(str(error))}",
        needs=needs,
        rule=rule(backend),
    )


def _everything(backend: RedisUser, who: str) -> str:
    return f"Everything this backend needs: ACL SETUSER {who} {rule(backend)} (see the {README})."


# -- the startup check ---------------------------------------------------------------------


def probe_args(backend: RedisUser) -> tuple[list[str], list[str]]:
    """The probe's command names, and its ARGV: each command's argument count, then its
    example arguments, keys and channels under the backend's prefix."""
    fill = {
        KEY: backend.key("probe"),
        CHANNEL: f"{backend.inbox_prefix}probe",
        SHARD_CHANNEL: f"{backend.inbox_for('probe')}probe",
        SHA: script("probe").sha,
    }
    names, args = [], []
    for name, example in commands(backend).items():
        names.append(name)
        args += [str(len(example)), *(fill.get(a, a) for a in example)]
    return names, args


def refused_commands(names: Sequence[str], reply: Any) -> list[str] | None:
    """probe.lua's reply: the names of the commands refused; None where Redis cannot tell."""
    numbers = [int(n) for n in reply]
    if numbers == [-1]:
        return None
    return [names[n - 1] for n in numbers]


def check(backend: RedisUser) -> MissingPermission | None:
    """Whether ``backend``'s user lacks a permission the app needs (one round trip; nothing
    is run but the probe). BackendUnavailable when the server does not answer."""
    try:
        refused = backend.execute(backend.op_probe())
    except MissingPermission as exc:  # EVALSHA itself, or the probe's key
        return exc
    if not refused:
        return None
    who, needs = user(backend), " ".join(f"+{n}" for n in refused)
    what = f"run {', '.join(n.upper() for n in refused)}"
    if set(refused) <= CHANNEL_COMMANDS:  # each refused for the command, or for the channel
        needs = f"&{prefix_pattern(backend)} {needs}"
        what += f" on the channels {prefix_pattern(backend)}"
    return MissingPermission(
        f"backend {backend.describe()}: the Redis user {who!r} may not {what}, which this app"
        f" needs. Add it with: ACL SETUSER {who} {needs}. {_everything(backend, who)}",
        needs=needs,
        rule=rule(backend),
    )


# -- secrets in URLs -----------------------------------------------------------------------

# Up to the last '@' before the host: a password may hold an '@' (unquoted).
_CREDENTIALS = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/@\s:'\"]*:)[^/\s'\"]*@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s'\"]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """A Redis URL as it may be shown: the password (if any) as ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return mask(url)  # a password in the query string, if any
    except ValueError:
        return mask(url)
    user_part = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return mask(urlunsplit(parts._replace(netloc=f"{user_part}:***@{host}")))


def mask(text: str) -> str:
    """``text`` with the password of every URL in it as ``***`` (for messages and logs)."""
    return _QUERY_PASSWORD.sub(r"\1***", _CREDENTIALS.sub(r"\1***@", text))
