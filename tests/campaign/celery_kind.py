"""The Celery kind (issue #43): real Celery workers (two prefork, one solo: celery_worker.py)
run ``@single_instance`` tasks whose lock server sits behind the campaign's proxy, while the
producer sends calls and the nemesis adds latency (20-150 ms each way, so a duplicate's
"found held" and its next step are a round trip apart) and jolts: Celery's
``SoftTimeLimitExceeded`` at a random microsecond of a call, once or in a burst (the acquire,
right after it, the body).

Properties, from the workers' own logs:

* ``overlap``: no two runs of one key at once;
* ``stranded``: every call runs or is deduplicated as the rule says: at the end, after every
  call has ended and a TTL more, one quiet call per ``skip`` key must run (not be skipped as
  held by nobody's run: a hold a soft time limit left renewed for the child's life);
* ``coalesce-extra-run``: ``on_duplicate="coalesce"``: one trailing run per run that had
  coalesced duplicates, no more: a follow-up run right after another follow-up while no
  coalesced duplicate ended after the first's task started is one too many (unless the
  first's hold ran out before it dropped its claimed note: see ``_lost_first``);
  ``coalesce-no-run``: a coalesced duplicate with no follow-up at all;
* ``not-lock-error``: a call failed with an exception that is neither a ``LockError`` nor the
  jolt's ``SoftTimeLimitExceeded``.

``CAMPAIGN_EXCLUDE=jolt,latency`` leaves the moves out; ``CAMPAIGN_INCLUDE=jolt_burst`` makes
half the jolts bursts (off by default: see the README). Self-tests, each a broken worker
that must make its property fail: ``CAMPAIGN_BREAK=stranded`` (a jolted call leaves a hold of
its key renewed: ``stranded``), ``coalesce`` (the first duplicate of each episode queues one
more run itself: ``coalesce-extra-run``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from .checker import Violation
from .proxy import Proxy
from .scenario import KindReport, excluded, read_logs, storms

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0
QUEUE = "campaign"
SKIP_KEYS = 3
WORKERS = (("prefork", 3), ("prefork", 3), ("solo", 1))


def run_celery(seed: int, seconds: float) -> KindReport:
    from celery import Celery
    from celery import _state as celery_state

    from django_redlock.testing import RedisServer

    directory = Path(tempfile.mkdtemp(prefix=f"campaign-celery-{seed}-"))
    broker, locks = RedisServer().start(), RedisServer().start()
    proxy = Proxy(locks.port, "locks")
    workers: list[subprocess.Popen[bytes]] = []
    faults: Counter[str] = Counter()
    errors: list[str] = []
    skipped = excluded()
    # Off unless asked (CAMPAIGN_INCLUDE=jolt_burst): it found a hold left renewed (README,
    # "Found by the bursts"); Celery's own limit fires once.
    bursts = "jolt_burst" in os.environ.get("CAMPAIGN_INCLUDE", "").split(",")
    # Not the current app, and the one before made current again at the end whatever made
    # this one current meanwhile: the suite's shared tasks (tests/support/fenced_tasks.py)
    # resolve to the current app, and would publish to this run's broker once it is gone.
    previous = celery_state.get_current_app()
    app = Celery(
        "campaign-producer", broker=f"{broker.url.rsplit('/', 1)[0]}/1", set_as_current=False
    )
    app.conf.broker_connection_retry_on_startup = True
    try:
        config = {"lock_url": proxy.url, "broker_url": f"{broker.url.rsplit('/', 1)[0]}/1",
                  "result_url": f"{broker.url.rsplit('/', 1)[0]}/2", "ttl": TTL,
                  "dir": str(directory)}  # fmt: skip
        env = {**os.environ, "CAMPAIGN_CELERY": json.dumps(config),
               "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}  # fmt: skip
        env.pop("DJANGO_SETTINGS_MODULE", None)
        for i, (pool, concurrency) in enumerate(WORKERS):
            with open(directory / f"worker{i}.log", "wb") as out:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "tests.campaign.celery_worker",
                     "worker", "-P", pool, "-c", str(concurrency), "-Q", QUEUE,
                     "-n", f"campaign{i}@%h", "--without-gossip", "--without-mingle",
                     "--without-heartbeat", "-l", "info"],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))  # fmt: skip
        deadline = time.monotonic() + 90
        for i, worker in enumerate(workers):
            log = directory / f"worker{i}.log"
            while b" ready." not in log.read_bytes():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {i} did not start: {log.read_text()[-3000:]}")
                time.sleep(0.1)
        rng = random.Random(seed * 7 + 3)
        sent: dict[str, dict[str, Any]] = {}  # task id -> the call
        started, origin = time.time(), time.monotonic()

        def send(name: str, key: str, tag: str, seconds: float, jolt: Any = None) -> None:
            task_id = uuid.uuid4().hex
            kwargs: dict[str, Any] = {"key": key, "tag": tag, "seconds": seconds}
            if jolt:
                kwargs["jolt"] = jolt
            app.send_task(f"campaign.{name}", kwargs=kwargs, queue=QUEUE, task_id=task_id)
            sent[task_id] = {"name": name, "key": key, "tag": tag, "t": time.time()}

        plan = (
            []
            if "latency" in skipped
            else storms(seed, seconds, calm=(1.0, 3.0), storm=(1.0, 3.0), tail=2.0)
        )
        episode = 0
        while time.monotonic() < origin + seconds - 1.0:
            now = time.monotonic() - origin
            storm = any(s <= now < s + d for s, d in plan)
            want = rng.uniform(0.02, 0.15) if storm else 0.0
            if (want > 0) != (proxy.latency > 0):
                faults["latency"] += want > 0
                proxy.latency = want
            episode += 1
            # The first episode is always one of skip calls with a jolt (drawn as before):
            # a short run whose draws all went to coalesce and calm injected nothing.
            if rng.random() < 0.5 or episode == 1:  # skip calls, some jolted
                for _ in range(rng.randint(1, 3)):
                    jolt = None  # within 3 ms, or 3 round trips under latency
                    if "jolt" not in skipped and (rng.random() < 0.6 or not faults):
                        burst = rng.random() < 0.5 and bursts
                        jolt = {"delay": rng.uniform(0, 3000 + 6e6 * want),
                                "count": rng.randint(3, 60) if burst else 1,
                                "every": rng.uniform(5, 100)}  # fmt: skip
                        faults["jolt"] += 1
                    task = rng.choice(("skip", "dedupe"))
                    send(task, f"k{rng.randrange(SKIP_KEYS)}", f"e{episode}",
                         rng.uniform(0.02, 0.4), jolt)  # fmt: skip
                time.sleep(rng.uniform(0.05, 0.3))
            else:  # a coalesce episode on a key of its own: one run, duplicates during it
                key, length = f"e{episode}", rng.uniform(0.3, 0.8)
                send("coalesce", key, "first", length)
                # Duplicates early in the run, and a cluster of them near its end (found held,
                # then noted once the run ended: a round trip apart, wider under latency).
                time.sleep(rng.uniform(0.05, 0.2))
                send("coalesce", key, "dup0", 0.05)
                time.sleep(length * rng.uniform(0.4, 1.0))
                for d in range(rng.randint(2, 4)):
                    time.sleep(rng.uniform(0.0, 0.03))
                    send("coalesce", key, f"dup{d + 1}", 0.05)
        proxy.heal()
        ended = _wait_ended(directory, sent, timeout=30.0)
        if not ended:
            errors.append("calls still unfinished 30 s after the last was sent")
        time.sleep(TTL + 0.5)
        finals = []
        for task in ("skip", "dedupe"):  # quiet calls: each must run
            for k in range(SKIP_KEYS):
                send(task, f"k{k}", "final", 0.01)
                finals.append(list(sent)[-1])
        _wait_ended(directory, sent, timeout=15.0)
        events = read_logs(sorted(directory.glob("w*.jsonl")))
        report = check(seed, seconds, events, sent, set(finals))
        report.faults, report.started = faults, started
        report.harness_errors += errors
        report.exclude = ",".join(sorted(skipped))
        return report
    finally:
        app.close()
        previous.set_current()
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        proxy.stop()
        broker.stop()
        locks.stop()
        if os.environ.get("CAMPAIGN_KEEP") is None:
            shutil.rmtree(directory, ignore_errors=True)


def _wait_ended(directory: Path, sent: dict[str, Any], timeout: float) -> bool:
    """Until every call sent (and every follow-up that started) has its ``post``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = read_logs(sorted(directory.glob("w*.jsonl")))
        pre = {e["id"] for e in events if e["e"] == "pre"}
        post = {e["id"] for e in events if e["e"] == "post"}
        if set(sent) <= post and pre <= post:
            return True
        time.sleep(0.2)
    return False


def check(seed: int, seconds: float, events: list[dict[str, Any]], sent: dict[str, Any],
          finals: set[str]) -> KindReport:  # fmt: skip
    calls: dict[str, dict[str, Any]] = {}
    for ev in events:
        call = calls.setdefault(ev["id"], {})
        call[ev["e"]] = ev
    violations: list[Violation] = []
    outcomes: Counter[str] = Counter()
    runs: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for task_id, call in calls.items():
        pre, post = call.get("pre"), call.get("post")
        name = (pre or {}).get("name", "").rsplit(".", 1)[-1]
        if post is None:
            continue
        ret = post.get("ret")
        if "exc" in post:
            outcomes[post["exc"]] += 1
            lock_error = post["exc"] in LOCK_ERRORS or post["module"].startswith("django_redlock")
            if not lock_error and post["exc"] != "SoftTimeLimitExceeded":
                violations.append(Violation("not-lock-error", post["t"], f"{name} {task_id}:"
                                            f" {post['exc']}: {post['msg']}"))  # fmt: skip
        elif isinstance(ret, dict):
            outcomes["coalesced" if ret.get("coalesced") else "skipped"] += 1
        else:
            outcomes["ran" if "run" in call else str(ret)] += 1
        if "run" in call:
            key = (name, call["run"]["key"])
            # A body cut short by a jolt: its release came at some moment before ``post``.
            end = call["done"]["t"] if "done" in call else call["run"]["t"]
            runs.setdefault(key, []).append((call["run"]["t"], end, task_id))
    for (name, key), spans in runs.items():
        spans.sort()
        for (_, e1, a), (s2, _, b) in itertools.pairwise(spans):
            if s2 < e1:
                violations.append(Violation("overlap", s2, f"{name} {key!r}: run {b} began"
                                            f" {e1 - s2:.3f} s before run {a} ended"))  # fmt: skip
    for task_id in finals:
        post = calls.get(task_id, {}).get("post")
        if post is None or "run" not in calls[task_id]:
            key, task = sent[task_id]["key"], sent[task_id]["name"]
            last = max((e for s, e, _ in runs.get((task, key), [])), default=0.0)
            holder = (post or {}).get("ret") or {}
            seen = calls.get(holder.get("holder_task_id", "") if isinstance(holder, dict) else "")
            if seen:
                ended = seen.get("post", {}).get("t", 0.0)
                story = (
                    f"; its holder {holder['holder_task_id']}: jolt {seen['pre'].get('jolt')},"
                    f" {'ran' if 'run' in seen else 'no run'}, ended"
                    f" {sent[task_id]['t'] - ended:.2f} s before the quiet call in"
                    f" {seen.get('post', {}).get('exc') or seen.get('post', {}).get('ret')}"
                )
            else:
                story = ""
            violations.append(Violation(
                "stranded", post["t"] if post else time.time(),
                f"{task} {key!r}: a quiet call sent {sent[task_id]['t'] - last:.2f} s after the"
                f" key's last run ended (every call done, a TTL of {TTL:g} s passed) did not run:"
                f" {post.get('ret') or post.get('exc') if post else 'no outcome'}{story}",
            ))  # fmt: skip
    episodes = 0
    for (name, key), spans in runs.items():
        if name != "coalesce":
            continue
        episodes += 1
        # Every coalesced call of the key, follow-ups too (a follow-up that found the key held
        # by a direct run is a duplicate like any other).
        coalesced = [
            c["post"]["t"] for c in calls.values()
            if "post" in c and "pre" in c and c["pre"]["name"] == "campaign.coalesce"
            and c["pre"]["kw"].get("key") == key and isinstance(c["post"].get("ret"), dict)
            and c["post"]["ret"].get("coalesced")
        ]  # fmt: skip
        follow = [(s, e, i) for s, e, i in spans if i not in sent]
        if coalesced and not follow:
            violations.append(Violation("coalesce-no-run", max(coalesced),
                                        f"coalesce {key!r}: {len(coalesced)} coalesced, no"
                                        " trailing run"))  # fmt: skip
        for previous, current in itertools.pairwise(spans):
            if current[2] in sent:
                continue
            # The first claims the note between its start and its body (``pre`` and ``run``): a
            # duplicate noted in between (its ``post`` follows its note) owes a run after it.
            started = calls[previous[2]].get("pre", {}).get("t", previous[0])
            noted_later = [t for t in coalesced if t >= started]
            tags = [sent.get(i, {}).get("tag", "follow-up") for *_, i in spans]
            if (
                previous[2] not in sent
                and not noted_later
                and not _lost_first(calls[previous[2]], current[0])
            ):
                violations.append(Violation(
                    "coalesce-extra-run", current[0],
                    f"coalesce {key!r}: a second trailing run ({current[2]}) after the trailing"
                    f" run {previous[2]}, though every coalesced duplicate had ended before that"
                    f" one started; runs {tags}, {len(coalesced)} coalesced; each run's"
                    f" begin, end and outcome (s after the first began): {_story(calls, spans)}",
                ))  # fmt: skip
    report = KindReport("celery", "celery", seed, seconds, {
        "clients": len({e["pid"] for e in events}), "acq_ok": outcomes["ran"],
        "writes": outcomes["ran"], "lost": 0}, Counter(), violations)  # fmt: skip
    report.lines.append(
        f"  calls: {len(sent)} sent, outcomes {dict(sorted(outcomes.items()))}; {episodes}"
        f" coalesce episodes; {sum(len(s) for s in runs.values())} runs")  # fmt: skip
    return report


def _story(calls: dict[str, dict[str, Any]], spans: list[tuple[float, float, str]]) -> str:
    """A key's runs as the judge saw them: what to read a finding by (the logs are gone)."""
    t0 = spans[0][0]
    parts: list[str] = []
    for s, e, i in spans:
        post = calls[i].get("post") or {}
        outcome = post.get("exc") or post.get("ret")
        ended = f"{post['t'] - t0:.3f}" if post else "-"
        parts.append(f"{i[:8]} {s - t0:.3f}-{e - t0:.3f} {outcome} at {ended}")
    return "; ".join(parts)


def _lost_first(previous: dict[str, Any], began: float) -> bool:
    """Whether a trailing run's hold ran out before the next trailing run, begun at
    ``began``, took the key: its release raised ``LockLost`` after that one began. It drops
    its claimed note just before its release, so the next holder may still have found it
    claimed, and a claim whose taker no longer holds the key is taken for a stopped run's:
    its call runs again (at least once, as the docs say of a follow-up stopped mid-run)."""
    post = previous.get("post") or {}
    return post.get("exc") == "LockLost" and began < post["t"]


LOCK_ERRORS = {"LockError", "LockNotAcquired", "BackendUnavailable", "LockLost", "StaleFence",
               "QuorumNotReached", "AlreadyQueued"}  # fmt: skip
