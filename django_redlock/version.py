"""The release's version: a leaf module (setup.cfg reads it without importing the package)."""

__version__ = "0.1.0"
