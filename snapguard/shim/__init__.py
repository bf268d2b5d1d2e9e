"""snapguard-runc, the executor containerd runs in place of runc (entry: `snapguard.shim.entry:main`).

Kept import-free: the pass-through path imports this package on every container operation.
"""
