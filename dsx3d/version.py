"""The package version (one place: setup.cfg reads it, `dsx3d --version` prints it)."""

__version__ = "0.1.0"
