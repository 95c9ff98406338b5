"""A ``with`` statement's exit token (``fencing.TrackedExit``) is its thread's, and a ``with``
left as its exit began is released by the library for plain kinds only (review rl, 1-2)."""

from __future__ import annotations

import threading

from django_redlock import fencing, lock, read_write_lock


def test_a_with_s_exit_token_is_read_in_its_own_thread(name: str) -> None:
    """Two threads' ``with`` statements on one object: each ``__enter__`` reads the token its
    own statement's ``__exit__`` lookup made, not one another thread's lookup stored in
    between (it was an attribute of the object: the statement watched was the other's)."""
    lk = lock(name)
    mine = lk.__exit__  # this thread's statement looked __exit__ up
    other: list[object] = []
    looked = threading.Thread(target=lambda: other.append(lk.__exit__))
    looked.start()
    looked.join()
    token = fencing._exit_token(lk)
    assert token is not None and token() is mine
    assert other[0] is not mine


def test_a_reentrant_lock_s_withs_ending_out_of_order_keep_the_hold(name: str) -> None:
    """Two generators of one thread each in a ``with`` of one reentrant object; the first one's
    ends first. Its statement's end must not release the level the second still holds (before:
    the payer released it, and another thread took the name: two holders)."""
    lk = lock(name, ttl=5, reentrant=True)

    def inside() -> object:
        with lk:
            yield

    first, second = inside(), inside()
    next(first)
    next(second)
    first.close()  # the first ``with`` ends, normally
    taken: list[bool] = []
    thread = threading.Thread(target=lambda: taken.append(lock(name).acquire(timeout=1.0)))
    thread.start()
    thread.join()
    assert taken == [False], "another thread took the name the second generator holds"
    second.close()
    assert not lk.locked()


def test_a_read_lock_shared_by_threads_keeps_each_thread_s_read(name: str) -> None:
    """Threads sharing one read lock object (reentrant per thread): one thread's ``with`` ending
    must not release another's read."""
    read = read_write_lock(name, ttl=5).read()
    inside, leave = threading.Event(), threading.Event()

    def reader() -> None:
        with read:
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=reader)
    thread.start()
    assert inside.wait(5)
    with read:
        pass
    writer = read_write_lock(name, ttl=5)
    assert not writer.write().acquire(timeout=1.0), "a writer beside a live read"
    leave.set()
    thread.join()
