"""The package version, in a module of its own so that modules below the package root can read
it without importing the package (and with it the whole runtime)."""

__version__ = "0.1.0"
