import os

# Every connection's owner is checked (django_redlock/backends/owners.py): a connection
# released twice or used by two owners fails loudly. Set before django_redlock is imported.
os.environ.setdefault("DJANGO_REDLOCK_CHECK_OWNERS", "1")
