"""The package's version, in a leaf module: every layer (the server's /version included)
may read it without importing the package's front door."""

__version__ = "0.1.0"
