"""The one module family that talks to torch.distributed (ruff's banned-api rule enforces it)."""
