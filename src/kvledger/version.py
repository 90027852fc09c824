"""The package's version, in a module of its own so that the HTTP front can name it without importing
the package's face (``kvledger/__init__.py`` imports the engine)."""

__version__ = "0.1.0"
