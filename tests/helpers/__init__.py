"""Test-only helpers: tiny recipes, a random recipe grid, a pickle payload, Trainer fixtures (not installed)."""
