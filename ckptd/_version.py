"""The package's version (one place: ``ckptd.__version__``, the node agent's identity)."""

__version__ = "0.1.0"
