"""Sphinx configuration: `make docs` builds the site into docs/_build/html, warnings as errors.

The build needs no network: the intersphinx inventories are files in docs/_inventories/
(see its README.md for where each comes from and how to add a name).
"""

from __future__ import annotations

import sys
from pathlib import Path

import django
from django.conf import settings

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

# autodoc imports the app's modules, and some of them need Django set up. The LocMem backend
# keeps startup off the network (the app loads its scripts into every configured Redis).
settings.configure(
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "django_redlock",
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    DJANGO_REDLOCK={"default": {"BACKEND": "django_redlock.backends.locmem.LocMemBackend"}},
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    USE_TZ=True,
)
django.setup()

import django_redlock  # noqa: E402

project = "django-redlock"
copyright = "django-redlock contributors"
release = version = django_redlock.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "redlock_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
# GitHub's heading anchors, so that a link into these pages works on GitHub and here alike.
myst_heading_anchors = 4

nitpicky = True  # every cross-reference must resolve
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_default_options = {"member-order": "bysource"}
# Type variables and internal helper types in signatures: not part of the public API.
nitpick_ignore_regex = [
    ("py:class", r"django_redlock\..*\.[FTB]"),
    ("py:class", r"(F|T|B)"),
]
# Private helpers a docstring names for the curious; not part of the reference.
nitpick_ignore = [
    ("py:func", "validation.fit_name"),
    ("py:func", "_canonical"),
]

_INV = HERE / "_inventories"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3.11/", str(_INV / "python.inv")),
    "django": ("https://docs.djangoproject.com/en/5.2/", str(_INV / "django.inv")),
    "celery": ("https://docs.celeryq.dev/en/stable/", str(_INV / "celery.inv")),
    "redis": ("https://redis.readthedocs.io/en/stable/", str(_INV / "redis.inv")),
}

intersphinx_timeout = 1  # never reached: every inventory above is a local file

html_theme = "furo"
html_title = f"django-redlock {release}"
html_static_path: list[str] = []
