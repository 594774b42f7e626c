"""The engine's package version, sent to frontends in ModelInfo."""

__version__ = "0.1.0"
