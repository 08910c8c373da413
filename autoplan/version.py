"""The package version, apart so that modules can record it without importing the whole API."""

__version__ = "0.1.0"
