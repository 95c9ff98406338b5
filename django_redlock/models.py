"""Models: ``HeldLock`` (no table: live locks are in Redis), ``LockIncident`` and ``Fence``."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class HeldLock(models.Model):
    """The admin's "Held locks" entry and its permissions; rows come from the backends."""

    class Meta:
        managed = False
        verbose_name = "held lock"
        verbose_name_plural = "held locks"
        default_permissions = ("view",)
        permissions = [("force_release", "Can force-release held locks")]


class LockIncident(models.Model):
    """Something operators want to look back at: a forced release, a lost hold, ..."""

    class Kind(models.TextChoices):
        FORCE_RELEASE = "force_release", "forced release"
        LOST = "lost", "hold lost"
        DUPLICATE_SKIPPED = "duplicate_skipped", "Celery duplicate skipped"
        ACQUIRE_TIMEOUT = "acquire_timeout", "acquire timed out"
        QUORUM_FAILURE = "quorum_failure", "quorum not reached"

    kind = models.CharField(max_length=32, choices=Kind.choices, db_index=True)
    name = models.CharField("lock", max_length=1024)
    backend = models.CharField(max_length=100, db_index=True)
    detail = models.TextField(blank=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "lock incident"

    def __str__(self) -> str:
        return f"{self.get_kind_display()}: {self.name} ({self.backend})"


class Fence(models.Model):
    """The newest fence a fenced transaction recorded for a lock (see :mod:`..fencing`).

    One row per backend alias and lock name, keyed by a hash of both (portable: names may be
    1024 bytes, beyond some databases' index limits). The row with an empty name is the
    backend's floor: the largest fence ``manage.py redlock prune-fences`` forgot.
    """

    key = models.CharField(max_length=64, primary_key=True)
    backend = models.CharField(max_length=100)
    name = models.CharField("lock", max_length=1024)
    fence = models.BigIntegerField()
    #: The fence this row held before the last check (None: the row was new).
    previous = models.BigIntegerField(null=True, blank=True)
    #: The token of the hold that recorded ``fence`` (None: unknown), so a later block can tell
    #: that hold was granted before its own (``fence_table.check_fence``).
    holder = models.CharField(max_length=64, null=True, blank=True)
    #: Not indexed: every block rewrites it, and an index on it would make each upsert a
    #: non-HOT update on PostgreSQL (new index entries, a dead tuple per block). Only
    #: ``prune-fences`` reads it, with a sequential scan.
    touched = models.DateTimeField()
    #: The mark of the fenced block that wrote ``fence`` (random, unique per block whatever
    #: the clocks do): a lost COMMIT's outcome check looks for it (None: written before marks).
    mark = models.BigIntegerField(null=True, blank=True)
    #: ``mark`` as it was before the last check, beside ``previous``: whose write a later
    #: block overwrote (None: unknown, a row new then or written before this column).
    previous_mark = models.BigIntegerField(null=True, blank=True)

    class Meta:
        verbose_name = "lock fence"
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.name!r} on {self.backend!r}: fence {self.fence}"
