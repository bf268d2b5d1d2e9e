"""The process model: every read of /proc that snapguard makes, under one procfs root.

The root is `procfs_path()` ("/proc" unless a test or a container-aware caller sets another with
`set_procfs_path` or `using_procfs`, as psutil's PROCFS_PATH); functions also take `proc=` for
fixture trees. Processes that exit while they are read are normal on a busy node and skipped:
a read that loses its process yields the function's empty answer, never an exception.

`from snapguard import procfs; procfs.X` is the public face: `_root` (the root and the read
helpers), `host` (this host), `process` (single processes, trees, node-wide scans), `mounts`
(mountinfo) and `inventory` (what a tree holds, its TCP connections).

psutil is not used: its `children(recursive=True)` scans every process's stat on the node, and
`memory_maps` is 20x slower than this package's reads (bench/scan.py); both matter on nodes with
thousands of processes, inside a snapshot's stall.
"""

from __future__ import annotations

from ._root import procfs_path, set_procfs_path, using_procfs
from .host import boot_id, cpu_info, host_facts, mem_available_bytes
from .inventory import (CUDA_LIB, NCCL_SHM, NVIDIA_DEV, Inventory, ProcInfo, established_tcp, internal_only,
                        inventory, parse_maps, read_proc, tree_tcp)
from .mounts import mount_here, mount_of, mount_table, mounts_on_path
from .process import (alive, cgroup_memory_headroom, check_target, cmdline, euid, exists, nspid, own_mntns,
                      own_netns, pid_map, pids, proc_text, process_state, process_tree, running_start_ticks,
                      self_fd, start_ticks, with_argument)

__all__ = [
    "CUDA_LIB", "NCCL_SHM", "NVIDIA_DEV", "Inventory", "ProcInfo", "alive", "boot_id", "cgroup_memory_headroom",
    "check_target", "cmdline", "cpu_info", "established_tcp", "euid", "exists", "host_facts", "internal_only",
    "inventory", "mem_available_bytes", "mount_here", "mount_of", "mount_table", "mounts_on_path", "nspid", "own_mntns",
    "own_netns", "parse_maps", "pid_map", "pids", "proc_text", "process_state", "process_tree", "procfs_path",
    "read_proc", "running_start_ticks", "self_fd", "set_procfs_path", "start_ticks", "tree_tcp", "using_procfs",
    "with_argument",
]
