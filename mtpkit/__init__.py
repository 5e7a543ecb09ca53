"""mtpkit: keep, convert, run and check multi-token-prediction heads on MLX."""

__version__ = "0.1.0"
