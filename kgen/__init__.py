"""kgen: fused kernels rendered from YAML specs (see README.md)."""
import warnings

# torch warns at import when NumPy is missing; kgen never uses NumPy, and the
# warning would turn the CLI's one-line errors into three lines.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__version__ = "0.1.0"
