"""CUDA checkpointing: the driver API (cuCheckpointProcess*) and what snapguard builds on it.

Public API: `load` (the driver), `CudaError`, `recover` (bring a process back to running after a
failed snapshot), `libcuda_checkpoint_symbols` (read from the ELF without loading it), `Broker` (the
executor answering CRIU's plugin's cuda-checkpoint runs while CRIU runs; `BROKER_ENV` names it).
"""

from ..wire import BROKER_ENV as BROKER_ENV
from ._broker import Broker
from ._driver import CHECKPOINT_SYMBOLS, CudaError, Driver, load, uuid_bytes
from ._recover import recover
from ._symbols import find_libcuda, libcuda_checkpoint_symbols

__all__ = ["BROKER_ENV", "CHECKPOINT_SYMBOLS", "Broker", "CudaError", "Driver", "find_libcuda",
           "libcuda_checkpoint_symbols", "load", "recover", "uuid_bytes"]
