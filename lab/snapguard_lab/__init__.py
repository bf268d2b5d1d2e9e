"""snapguard's lab: the drills, the test rig and their example workloads, shipped apart from the
product (as trio.testing ships beside trio). snapguard itself never imports this package; the lab
uses only snapguard's public modules (`config`, `reasons`, `takepoint`, `pipeline`).

  testbed      a private containerd, the counter image, host-bind runc bundles, the ddp job
  drill        `snapguard-lab drill`: the counter through containerd, snapguard-runc, runc and CRIU
  torch_drill  `snapguard-lab drill --workload torch`: snapshots of a live trainer, bit for bit
  planted      real processes holding one thing a snapshot trips over (io_uring, TCP, deleted shm...)
  workloads    the example workloads, as package data
"""

__version__ = "0.1.0"
