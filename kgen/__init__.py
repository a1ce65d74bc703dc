"""kgen: fused kernels rendered from YAML specs (see README.md)."""
import warnings

# torch warns at import when NumPy is missing; kgen never uses NumPy, and the
# warning would turn the CLI's one-line errors into three lines.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

__version__ = "0.1.0"


def compile(model, *example_inputs, **options):  # noqa: A001 - kgen.compile, as torch.compile
    """``model`` as a generated kgen module (a drop-in nn.Module); see ``kgen.compiler.compile``.

    Imported on first use, so that ``import kgen`` does not load torch."""
    from .compiler import compile as compile_

    return compile_(model, *example_inputs, **options)
