"""The command that ``manage.py redlock exec`` runs in tests/leader/test_exec.py (plain Python and
redis-py, no Django): ``python tests/support/exec_child.py ACTION URL PREFIX [SECONDS]``.

* ``run``: count itself in ``PREFIX:now`` (``PREFIX:peaks`` gets the count it saw), push its
  ``REDLOCK_FENCE`` to ``PREFIX:fences``, sleep SECONDS (``gate``: until ``PREFIX:go`` is
  set), count itself out.
* ``trap``: exit 40 + N on signal N (SIGINT, SIGTERM, SIGHUP); say its pid and process group
  in ``PREFIX:pids``; sleep until a signal.
* ``stubborn``: ignore SIGINT, SIGTERM and SIGHUP; say its pid and group as ``trap``; sleep
  until killed.
"""

import os
import signal
import sys
import time

import redis

action, url, prefix = sys.argv[1:4]
client = redis.Redis.from_url(url)
if action == "run":
    until = sys.argv[4]
    now = client.incr(f"{prefix}:now")
    client.rpush(f"{prefix}:peaks", now)
    client.rpush(f"{prefix}:fences", os.environ["REDLOCK_FENCE"])
    client.rpush(f"{prefix}:env", f"{os.environ['REDLOCK_NAME']} {os.environ['REDLOCK_BACKEND']}")
    if until == "gate":
        deadline = time.monotonic() + 120
        while not client.exists(f"{prefix}:go") and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        time.sleep(float(until))
    client.decr(f"{prefix}:now")
elif action in ("trap", "stubborn"):
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if action == "trap":
            signal.signal(signum, lambda n, f: os._exit(40 + n))
        else:
            signal.signal(signum, signal.SIG_IGN)
    client.rpush(f"{prefix}:pids", f"{os.getpid()} {os.getpgid(0)}")
    while True:
        time.sleep(1)
