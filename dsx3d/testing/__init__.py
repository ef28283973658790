"""Multi-process machinery for tests and `dsx3d verify` (CPU, gloo)."""
