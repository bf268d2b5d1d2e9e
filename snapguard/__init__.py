"""snapguard: a guarded runc executor for GPU nodes.

Kept import-free: `snapguard-runc`'s pass-through path imports this package on every container
operation.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
