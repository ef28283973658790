"""Test-only helpers (moving to tests/helpers)."""
