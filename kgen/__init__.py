"""kgen: fused kernels rendered from YAML specs (see README.md)."""

__version__ = "0.1.0"
