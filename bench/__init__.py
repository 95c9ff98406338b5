"""``make bench``: django-redlock against the Python anchors, side by side, on the same Redis.

``run`` is the entry point (``python bench/run.py`` or ``python -m bench``), ``harness`` what
the scenarios share (servers, turns, medians), ``scenarios/`` one module per scenario,
``report`` bench/README.md and the plot. ``contender.py`` is one contending process.
"""
