"""Test-only fault injection, installed once at start-up from environment variables (never on the
hot path of a normal engine)."""
