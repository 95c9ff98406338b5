"""The report's prose: why the missed targets are missed (from side runs; kept by hand).

The full run's own figures are not typed here: ``{figure.name}`` is the figure's value in the
run being reported (bench/figures.py), ``{figure.name:verdict}`` whether it met its target,
so that the prose and the table above it cannot disagree. Figures from side runs are typed,
and say they come from side runs.
"""

from __future__ import annotations

import re
from typing import Any

from bench.figures import figures

_FIELD = re.compile(r"\{([\w.]+)(:verdict)?\}")


def render(text: str, results: dict[str, Any]) -> str:
    found = figures(results)

    def one(match: re.Match[str]) -> str:
        figure = found[match[1]]  # KeyError: a name bench/figures.py does not make
        if match[2]:
            return "met" if figure.met else "missed"
        return figure.value

    return _FIELD.sub(one, text)


def analysis(results: dict[str, Any]) -> str:
    """The section, with the Redlock paragraph when that target was missed."""
    q = results["quorum"]
    met = q["ours Redlock N=5"] >= max(5 * q["pottery Redlock N=5"], 0.5 * q["ours single node"])
    return render(ANALYSIS + ("" if met else REDLOCK_NOTE), results)


ANALYSIS = """## Why the missed targets are missed

Figures in parentheses come from side runs on the same machine (`BENCH_ONLY=<scenario>`,
`cProfile`, `py-spy`, `INFO commandstats`); the CHANGELOG lists what was changed because of
them.

- **Fenced purchases ({fenced.vs_select_for_update} `select_for_update` in the full run
  above, target 1.0 x: {fenced.vs_select_for_update:verdict}; 0.62-0.98 x, median 0.81, in five side runs at load
  average 5-9 before that; 0.58-0.78 x in three timed side runs at 3.5-5; target 1.0 x).** Out of reach
  with the guarantees kept. The floor, from a side run with `time.monotonic()` and
  `time.process_time()` around each step of each purchase (8 buyers, load 3.5-5): a purchase
  of ours takes 4.6-5.4 ms of the chain from one commit to the next, against 3.1-3.6 ms. Ours
  has three steps on that chain that `select_for_update` has not. (1) The hand-off through
  Redis, from the holder's commit to the next holder's acquisition: 1.2-1.3 ms, of which the
  release call is 0.5-0.6 ms (0.30-0.38 ms of it the holder's CPU); then one waiter's wake-up
  by pub/sub (its listener thread, then its main thread) and its acquire script. Under this
  contention the acquire and release scripts take 96 and 116 µs in Redis (slowlog medians;
  36 and 19 µs uncontended at the same time), and a purchase makes 3.2 `EVALSHA` (a try that
  finds the lock held, the try once woken, the release) and costs Redis about 0.5 ms of CPU.
  (2) `BEGIN` and the fence upsert: 0.9-1.0 ms, two round trips. PostgreSQL spends 79 µs on
  the upsert (47 executing, 32 planning: `pg_stat_statements`); `BEGIN` is psycopg's own
  round trip before a transaction's first statement, which `select_for_update`'s buyers send
  before they wait, off the chain. (3) A read of the row that does not wait, where
  `select_for_update`'s locked read returns as the previous holder commits. On the two cores,
  the buyers spend 3.5-4.2 ms of CPU per purchase of ours against 2.9-3.0 ms: the acquire and
  its wait 1.1-1.2 ms (`select_for_update`'s BEGIN and locked read: 1.2-1.3 ms), the fence
  step 0.53-0.60 ms, the release 0.30-0.38 ms. `select_for_update` pays at its commit instead,
  which wakes the queued sessions (0.84-1.07 ms from sending COMMIT to its answer, against
  0.30-0.34 ms for ours), and it holds 8 connections in transactions at peak (4.6 on average)
  where ours holds 1 (0.4). The busier the machine, the closer the two: `select_for_update`
  needs fewer process wake-ups per purchase, and each costs more on a loaded machine (one
  run at load 9 gave 1.06 x, on the code before this change).
  The fence check, 893 µs per block in the first side run, measures 406-581 µs (median 453;
  455-791, median 582, for the code before, in the same interleaved runs). That 893 was a
  difference of two medians of turns taken seconds apart while the load drifted; it is now
  the median of paired neighbouring turns. What is in it: one round trip of one statement
  (a `SELECT 1` through Django's cursor alone takes 190 µs on a quieter machine, 120 µs with
  bare psycopg), PostgreSQL's 79 µs, and Django's cursor and psycopg. Done: the fence table
  no longer indexes `touched`, which every block rewrites, so each upsert is a HOT update
  (1,638 of 1,638 in a side run, none before): 47 µs of execution instead of 75-78, no new
  index entries, and one row of 5,000 upserts stays in one 8 kB page (144 kB with the index);
  `prune-fences` scans the table instead. The statement's text is built once. Tried and
  dropped: psycopg's pipeline mode to send `BEGIN` with the upsert (729 µs per block against
  532: its bookkeeping costs more than the round trip it saves). A prepared upsert would save
  the planning, but it goes through Django's cursor like any query, so that stays Django's
  setting (`server_side_binding`, `prepare_threshold`: prepared statements break behind
  PgBouncer in transaction mode).
- **Uncontended vs raw ({uncontended.vs_raw} in the full run, target 0.95 x:
  {uncontended.vs_raw:verdict}; 0.875 x in a side run). Against redis-py's `Lock`:
  {uncontended.vs_redis_py} in the full run, {uncontended.vs_redis_py:verdict}; 1.12 x in the
  side run (0.82 x before an earlier session's change).** The row "where the time goes" is the measured floor. Its cases, in µs
  per cycle, wall / client CPU, from the side run on a quiet machine: raw 216 / 168; our two
  scripts alone, with a real cycle's keys and arguments, 171 / 82; the whole `with lock()`
  cycle 251 / 169; the `Lock` object with its two round trips answered in-process 44 / 44
  (38 without the watchdog hand-over, 37 with metrics and spans off). So our wire path is
  now cheaper than the raw loop's (it skips the pool checkout, redis-py's command wrapper
  and its serializer: a connection per thread, packed by hiredis), and the whole gap to raw
  is the `Lock` object: 44 µs of Python when hot, about 85 µs of client CPU between real
  round trips (caches are cold after each system call), against the 35 µs raw loses on its
  wire path. What those 44 µs buy, from the in-process cases: the watchdog hand-over (6 µs:
  a hold outliving TTL/3 is renewed), metrics (under 1 µs to 7 µs: deferred to the scrape),
  argument checks and the object (4 µs), building and parsing the two script calls with
  fence, holder and fair-queue data (5 µs), and about 25 µs for the hold's bookkeeping that
  makes "unknown is not lost" true: the owner's hold record, the token kept for a retry
  after a lost reply, the self-wait registry (an acquire that would wait for its own thread
  forever), the fork check, and the lock_acquired and lock_released signals. On the server
  our scripts also take longer than `SET` and the raw compare-and-delete (the fence counter,
  the server clock, the fair-queue check, the holder metadata). Reaching 0.95 x raw would
  take the Lock object under 10 µs, which is less than its watchdog hand-over and
  bookkeeping alone: we keep them. Done in an earlier session: a connection per thread (no
  pool checkout per command), hiredis packing, keys built once per name, a fork counter
  instead of `os.getpid()`, no tracer-provider lookup per acquire when none is set. Done in
  session 13 (issue 46), profiled with cProfile and `time.process_time` loops against a
  real redis-server: what every cycle paid and only some need. A name is checked once per
  process (a bounded set), the four lock kinds are made once, an op and its script call are
  no longer frozen dataclasses (about 0.3 us each to make, two of each per cycle), a plain
  lock makes no settle step (only a reentrant count is ever settled), the debug log builds no
  message and the `lock_acquired` / `lock_released` signals are not called while nobody
  listens, the owner id's look-up makes no generator, and the acquire's arguments are made as
  text (the packer converted the key count, TTL and wait on every call). The `Lock` object
  with its round trips answered in-process went from 42.6 to 35.1 us of client CPU (the
  fastest of 10 turns each, the code before and after run back to back; auto_renew=False
  39.2 to 31.9, metrics and spans off 36.3 to 28.6); round trips and commands per cycle
  unchanged (2 and 2: `EVALSHA` each). Against redis-py's `Lock` and raw in the same
  process, turns of 0.1 s, each ratio the median of 40 neighbouring pairs, the code before
  and after taking turns, three runs each on a shared machine at load average 6-17 (so
  lower than on a quiet one): before 0.75, 0.79, 0.61 x redis-py and 0.59, 0.61, 0.57 x
  raw; after 0.86, 0.94, 0.86 x redis-py and 0.74, 0.77, 0.77 x raw (three more pairs at
  load 4-8, the final code: before 0.78, 0.81, 0.80 x and 0.67, 0.71, 0.72 x; after 0.88,
  0.87, 0.90 x and 0.75, 0.77, 0.78 x). Each change added to
  the one before (turns of 0.1 s, 30 pairs, three rounds over the six trees, vs redis-py):
  before 0.75, 0.80, 0.79; the name and kind caches 0.78, 0.75, 0.75; ops and calls not
  frozen 0.81, 0.79, 0.83; no settle step, log or signal call 0.81, 0.84, 0.83; the owner
  id's loop 0.87, 0.78, 0.87; arguments as text 0.90, 0.85, 0.87 (vs raw, from 0.65-0.67 to
  0.73-0.79). What is left of the
  object's 35 us, from the same in-process cases: metrics and spans' hooks 6 us (three
  queued events, two family look-ups and the hold's `Held` per cycle; the histograms are
  counted at the scrape), the watchdog hand-over 3-4 us (the hold registered with the
  renewer and counted as taken by its thread, for the self-wait check), the owner id 2-3 us
  (a reentrant owner is the running `Context`, found through a `ContextVar` token: the
  self-wait check needs it for plain locks too), the constructor's argument checks 2.2 us,
  and the rest the two generator-driven steps and the hold's record.
  Session 15 (issue 46), measured in one process with the code before (a copy of the package
  under another name, its own backend alias) and after taking turns, 40 pairs of neighbouring
  turns, the median of their ratios, three runs at load average 5-7: the `Lock` object with
  its round trips answered in-process 0.88, 0.90, 0.87 x before's client CPU (about 4-9 us
  less of 39-47), and a whole `with lock()` cycle on a real Redis 0.93, 0.95, 0.97 x. What
  went: one metrics event for a new hold instead of two (and one family look-up and clock
  reading), histograms counted a batch at a time at the scrape (prometheus_client's
  `observe` walks the buckets and takes a lock per move: about 1 us per value, now 0.05), the
  constructor's checks of arguments left at their defaults, the generator of a plain lock's
  pre-acquire checks (one check applies), the hold's `__dict__`, and a dict copy in the
  self-wait registry. Against the anchors in the same runs (`BENCH_ONLY=uncontended`,
  load 7): 0.88, 0.88, 0.86 x redis-py and 0.79, 0.76, 0.75 x raw, the targets (1.1 x and
  0.95 x) not reached: the object still costs about 30 us of client CPU per cycle in-process
  (the watchdog hand-over 7 of them, metrics 4), on top of a wire path already cheaper than
  raw's, and no single step left is above 2 us.
- **Redis CPU per uncontended cycle ({redis_cpu.ratio} raw in the full run, target 1.3 x:
  {redis_cpu.ratio:verdict}. The run before it gave 1.22 x, and four side runs 1.18-1.29 x, on
  Redis 7.0; an earlier session's side runs on 6.2 gave 1.26-1.68 x: the machine's state tips
  it, as (1) below explains).**
  Measured with the same method on the code before and after this change, same session, two
  runs each: `INFO cpu` 1.45 x and 1.39 x before, 1.26 x and 1.68 x after; `INFO
  commandstats` 25.1-25.4 us per cycle before against the raw cycle's 5.6-6.1 (4.1-4.5 x),
  19.0-21.4 us after against 4.8-5.5 (3.5-4.5 x): release.lua went from 8.9-9.8 us to
  6.3-7.0 us; acquire.lua stayed at 10.6-13.7 us. Two things decide the CPU ratio. (1) What a
  round trip costs Redis outside the commands (reading, parsing, replying, and above all
  waking from `epoll_wait`): on this shared 2-core VM that swings between runs from about 16
  to 60 us per raw cycle; when it is high, ours comes out at 1.25-1.3 x, when it is low, at
  1.7-2.3 x. The per-turn ratios (p10/p50/p90 in the table) show the spread inside one run.
  A busy production Redis, with many clients per `epoll_wait`, pays less per round trip, so
  the commandstats difference is the better guide there: ours costs Redis about 14-16 us
  more per cycle. (2) That difference is what the scripts do, and the costs are not the
  same for every call. The cost model, measured on this run's own server (Redis 7.0.15) by
  `bench/calibration.py` (its two rows in the table: the probes, and the model's sum for a
  cycle's two scripts beside what they measure; three side runs in session 13,
  `BENCH_ONLY="redis cpu"`, `INFO commandstats` usec per `EVALSHA` call): being a
  script costs 1.0-1.1 us empty, 1.2-1.5 us with one key and one argument, 2.2-2.6 us with
  acquire.lua's 5 keys and 5 arguments (about 0.25 us per key or argument: each becomes a
  Lua string). Inside a script, on top of that: a write with a TTL (`SET ... PX`) 2.0-2.2 us;
  a key made and dropped (`SET NX PX`, then `DEL`) 2.9-3.1 us; a refused `SET NX PX` 1.2-1.4
  us; `TIME` 1.0-1.5 us; a read (`EXISTS`, `GET`) 0.6-0.9 us; a `DEL` of a missing key or a
  `PUBLISH` nobody hears 0.6-0.8 us. Direct, `SET NX PX` is 1.0 us. So the old rule of thumb
  (Redis 6.2: about 1-1.3 us per `redis.call`, whatever the command) is wrong on Redis 7:
  writes with a TTL cost three times a read, the script's keys and arguments cost before its
  first call, and cutting reads buys little. In the same side runs: acquire.lua 11.5-12.5
  us, release.lua 5.7-6.8 us, against raw `SET NX PX` 1.0 us and the raw compare-and-delete
  3.3-4.5 us (a 1-key script, a `GET` and a `DEL`); per cycle 20-24 us against 4.5-5.4, and
  `INFO cpu` 35-37 us against 15-18 (1.96-2.38 x). The acquire is about its shape (2.2-2.6),
  `TIME` (1-1.5), the fair-queue `EXISTS` (0.7), the counter's `GET` and `SET ... PX` (0.7
  and 2.1) and the lock's own `SET NX PX` on a free key (2-3), plus the Lua between them; the
  release about its shape, a `GET` and a `DEL` of the lock, and the waiters' `EXISTS`.
  Session 15 (issue 46) added the probes the leaner designs would use, a `SET ... PX ...
  GET` (one write that also reads the old counter) and an `EXISTS` of 3 keys, and the
  release's shape (5 keys, 3 arguments), and sums the model for a cycle: in a side run, SET
  PX 2.4 us, SET PX GET 1.9, SET NX PX + DEL 3.1, TIME 1.1, GET 0.65, EXISTS 0.54 and of 3
  keys 0.77; the shapes 2.5 and 2.2; the model's cycle 16.0 us against the scripts' 20.6
  measured (acquire.lua 13.8, release.lua 6.7): about 4.5 us of a cycle is the Lua between
  the calls (the value's text, the fence's arithmetic and formatting, the argument reads),
  not the calls. So a `SET PX GET` in place of the counter's `GET` and `SET PX` would save
  about 1 us, and one `EXISTS` of 3 keys in place of two about 0.3: the floor the issue
  names is within about 2 us of today's acquire. Each
  call beyond raw's is a product feature (the server clock for the fence and the admin's
  acquired-at, the fence counter and its TTL, fair queues, wake-ups); the fence counter's
  write with its TTL is the largest single one. Cut earlier: the release's TYPE, its PUBLISH
  to a release channel nobody listens to outside a Cluster or a Redlock, its ZRANGE of the
  waiters and EXISTS of the queue (one EXISTS of both now decides whether anyone waits), the
  second SET NX of a held plain lock, and the definition of the waiting and queueing helpers
  (Lua closures, about 0.1 us each) on the common path. Tried and dropped: a GETSET of the
  counter after the SET NX (one call fewer only when the name was not already taken in the
  same millisecond, two more writes when it was: half the time at a few thousand holds a
  second).
  Session 21 (issue 46): the helpers still built for the common path (`_hold.lua`'s, spliced
  at the top) are not built for it now: a one-off try of a free plain lock and a plain
  release run flat before any helper is defined. Measured by `bench/script_costs.py` (not
  make bench: the figures above are the full run's), `python -m bench.script_costs --against
  bfed1f6`, `SCRIPT_COSTS_ROUNDS=24`, three runs at load 7.5 (6,000 cycles each way per run,
  the old and new scripts taking turns; medians of the rounds): acquire.lua 24.8-26.1 us
  before, 22.3-23.5 after (per-round differences' median 1.9-2.9 us saved); release.lua
  13.9-14.5 us before, 10.6 after (3.3-4.1 saved); raw `SET NX PX` 1.9-2.0. Tried and
  dropped, under 1 us (probe scripts alone, same method): an optimistic fence (the counter's
  `SET ... PX ... GET` written with the clock's fence, rewritten with the lock when the old
  counter was not below it: -0.2 to +0.5 us against `GET` + `SET PX`, and two more writes
  whenever the counter is ahead), and fewer `string.format` calls (about 0.2 us).
- **Fair worst wait ({contended.fair.worst_wait} in the full run, target
  {contended.fair.worst_wait:verdict}: 2 x a FIFO ideal, see the table; 13-22 ms in earlier
  runs).** The ideal is 7
  hand-offs of about 0.6 ms. One scheduler delay of a few ms to any of the 8 contenders or to
  Redis, all sharing 2 cores, delays everyone in the queue; on this machine even an idle
  process sees its 0.5 ms sleeps overshoot by up to 4 ms, and a queue of 8 collects several
  of those in a 7.5 s run. The tail shows it: the fair lock's p99 wait
  ({contended.fair.wait_p99} in the full run; 6.7 ms in an earlier one) is near 2 x the
  ideal, and its worst wait is far below those of the libraries that are not fair (redis-py
  {contended.redis_py.worst_wait}, pottery {contended.pottery.worst_wait}: their waiters
  starve). Left out
  of the worst wait: each process's first wait (its start-up), for every library alike.
- **10 ms holds ({hold10.ours.ideal} the 100/s ideal in the full run, fair
  {hold10.fair.ideal}; target 0.95 x: {hold10.ours.ideal:verdict}).** Each cycle is the 10 ms hold, the
  sleep's overshoot, the release, the wake-up and the next acquire: about 0.6 ms on top of
  the hold. redis-py's `Lock` reaches {hold10.redis_py.ideal} by handing the lock back to
  the process that just released it (worst wait {hold10.redis_py.worst_wait}), which ours
  does too when it is quicker than the woken waiter (worst wait {hold10.ours.worst_wait}). The
  fair lock always hands over, so it pays every wake-up.
- **Semaphore against the hand-rolled sorted-set recipe ({semaphore.vs_recipe} in the full
  run, target 1.0 x: {semaphore.vs_recipe:verdict}; 0.86 x in a side run; 0.82-0.87 x before the
  connection per thread, 0.64-0.81 x in earlier sessions' side runs).** Where a cycle's time goes, measured per cycle on Redis 7.0
  (`time.process_time` around 2,000 cycles, five turns, and `INFO commandstats`): the recipe
  costs its client 140-157 us of CPU and Redis 3.5 us; our two ops alone (the backend's
  acquire and release, no `Semaphore` object) cost the client 127-142 us and Redis 23 us
  (permit_acquire.lua 15, permit_release.lua 8.5), and take the recipe's wall time (230-260
  us against 226-261); the `Semaphore` object (the owner's hold, the watchdog hand-over,
  metrics, signals, argument checks) adds 25-30 us of client CPU, all of it Python spread
  over a dozen steps. So the recipe is faster by what it leaves out, on both sides of the
  wire, and no trimming of either closes a 13-18 % gap while the permit keeps its
  guarantees. Both make exactly 2 round trips. The recipe
  sends ZREMRANGEBYSCORE, ZADD and ZCARD in a MULTI and a ZREM: 3.9-4.4 us of Redis time per
  cycle (`INFO commandstats`). Our two scripts take 28.7-32.6 us per cycle (35 us before):
  permit_acquire.lua 19-20 us (22.5 before), permit_release.lua 11 us (16.4-19.2 before).
  They make 15 `redis.call`s (writes with a TTL about 2 us each, reads under 1 us, `TIME`
  about 1 us: the cost model above), for what the recipe leaves out: expiry on the
  server's clock (`TIME` in both), a fence from the name's counter (GET, SET), the holder's
  details for the admin (HSET, HDEL or DEL), the key TTLs that make a crashed holder's keys
  go (two PEXPIREs when the name had no lease), the fair-queue check, the check that the
  token's lease is live at release, and the check for waiters to wake. Cut in this change: the
  release reads no details for a permit (the caller says its mode), skips the waking (and the
  definition of its helpers) when none of the waiters' keys exists, and drops the details
  in one call; the acquire counts the leases (one ZCARD, which also detects a name held by a
  lock) and skips the ZSCORE when there are none, takes a free permit before the waiting
  helpers are defined, skips the PTTL on keys it just made, and a one-off try sends 6
  arguments instead of 10. Earlier: no pruning below the limit, one HSET per grant, key TTLs
  only raised, no PUBLISH to a release channel nobody listens to (outside a Cluster). Left:
  Redis 7's `FUNCTION`s would not change the per-call cost; storing the details in the
  sorted set's members would save the hash (two calls) but change what the admin and
  `redlock list` read. Contended (8 processes, semaphore of 3, 10 ms holds) ours reaches
  {semaphore10.ours.ideal} the 300/s ideal in the full run (both, 0.92-0.98 x in side runs);
  ours sends {semaphore10.ours.commands} commands per acquisition against the recipe's
  {semaphore10.recipe.commands} (it polls every 10 ms) and costs Redis 270-290 us of CPU per
  acquisition against its 150-160 us (side runs), and wakes a waiter under a millisecond
  after a release.
- **Memory per held plain lock ({memory.plain} in the full run, target 200 B:
  {memory.plain:verdict}).** The lock's value carries the holder for the admin and
  `redlock list` (host name, process id and thread name, about a byte per character of each:
  the method above), and the fence counter is a key of its own that outlives the hold, so
  that fences keep growing. A shorter host or thread name makes it smaller; nothing was cut.
  Session 15 (issue 46) measured where the bytes go (`MEMORY USAGE` on Redis 7.0.15 with
  jemalloc, keys named as the bench's, `SET` of values of each length): a string key counts
  its dict entry, its name and its value rounded up to jemalloc's size classes, so a value of
  up to 12 bytes costs 88 B, up to 28 bytes 104 B, up to 44 bytes 120 B (stored with its
  object header in one allocation), up to 60 bytes 136 B, and the plain lock's 67-byte value
  152 B; the counter's 34-byte `fence|token` 120 B. Both values hold the 17-character token
  (the counter's is what a fenced block compares with its row's writer), so each key costs
  at least 104 B and the two at least 208 B, whatever the encoding of the rest; with today's
  16-digit fence and no holder details or acquired-at at all, 120 + 120 = 240 B. The holder
  details and the acquired-at cost 32 B of today's 272. Under 200 B takes one key while
  held (the counter written at the release only: a crashed holder's token would then never
  reach it, and a fenced block after it would compare with the one before) or a token under
  13 characters (fewer random bits): each a promise weakened, so the target stays missed.
  (The 224 B of earlier runs was before the counter kept the token.)
"""


REDLOCK_NOTE = """- **Redlock ({redlock.vs_pottery} pottery and {redlock.vs_single} our single node
  in the last full run, targets 5 x and 0.5 x: {redlock.vs_pottery:verdict}).** A cycle is
  one script call per node to acquire and one to release (the suite counts 2.0 calls per node
  per cycle with `INFO commandstats`). The same run's raw-socket anchors (the cycle's two
  commands written to every node at once and parsed by hiredis, no lock logic): raw N=5
  {redlock.raw_n5}, raw single {redlock.raw_single} cycles/s. So on this 2-core machine five
  nodes cost even a bare client {redlock.raw_ceiling} its single node (each node is a
  redis-server woken twice per cycle on the same two cores), and ours is {redlock.vs_raw_n5}
  raw N=5. Where a cycle goes (side runs, `getrusage` over 3,000 cycles, quiet machine):
  ours 770-880 µs of wall, 505-565 µs of user CPU and 100-115 µs of system CPU; raw N=5
  210-220 µs, 40-60 user, 65-85 system; our single node 210-230 µs, 115-140 user. What the
  remaining microseconds buy, in the order of their cost:
  - **The lock object** (argument checks, token, the hold's bookkeeping behind "unknown is
    not lost" and the self-wait check, the watchdog hand-over, metrics): the same as on one
    node, about 115-140 µs of user CPU (the single-node row's cycle, less raw single's).
  - **Ten node requests**: about 35 µs of user CPU each, in about 120 Python calls each
    (cProfile: 1,518 calls per N=5 cycle against 308 for one node). They pay for each
    connection's owner written at every move (no reply read by the wrong request, whatever
    line an interrupt hits), the thread's lane checked (a thread's requests to a node stay in
    order), the reused connections checked for a close by the server (one `poll` per
    fan-out), commands packed as text (hiredis' crash under signal handlers), the quorum
    decided as replies come (a paused node left behind), and the breaker's health. Turned
    off in a side experiment (the same servers, taking turns, 10 rounds), the owner moves,
    the lane check, the close check and the text packing together cost about 70 µs of CPU
    (10 % of the cycle rate), none more than 35 µs alone: the rest is CPython's cost per
    call, spread over all of them.
  - **Ten writes**, each waking a redis-server: 11 µs median, 23 µs mean (the writer is
    preempted by the server it woke), as raw pays.
  Reading the replies from each socket with our own hiredis reader, and keeping one `poll`
  per fan-out, took the client CPU per cycle from about 900 to about 660 µs and the cycle
  rate 1.2 x (the code before and after, on the same servers, taking turns). 0.5 x single needs the ten node
  requests at about 7 µs of Python each: out of reach in CPython with a tracked owner per
  connection; a fan-out in C (or one reader thread for the whole process, sans-IO as the lock
  core already is) is what is left. Session 13 (issue 46): the `Lock` object's cuts above
  apply here too; against pottery N=5 in the same process (turns of 0.2 s, the median of 20
  neighbouring pairs, the code before and after taking turns, load average 6-17): before
  4.03, 3.56, 4.89, 4.11 x, after 4.11, 4.14, 4.32 x (and 1.56 x once, when the load
  spiked); three more pairs at load 4-8: before 3.74, 4.26, 3.71 x, after 4.05, 4.16, 5.33 x.
  A gain of a few per cent, inside the noise; 5 x not reached. Some runs of either failed with `QuorumNotReached`: on
  the loaded machine three nodes stayed silent past the 0.1 s node timeout. A cProfile of
  1,500 cycles shows no single client-side cost to cut: the ten `write`s (about 28 us each
  in wall time, each waking a redis-server) and the `poll`s lead, and the Python is spread
  over the node requests' steps (owner moves, lane checks, the reply reads; 191
  `isinstance` and 54 `getattr` calls per cycle, none from one place).
"""
