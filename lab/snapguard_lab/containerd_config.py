"""The config files of the lab's private containerd (snapguard_lab.testbed.Containerd): without
CRI, for containerd 1.6 (version 2) and 2.x (version 3), and containerd 2.x with its CRI plugin."""

from __future__ import annotations

from pathlib import Path

__all__ = ["cri_config", "plain_config"]


def plain_config(w: Path, socket: str, version: int) -> str:
    """containerd's config without CRI: its root, state and sockets in `w`."""
    common = (f'root = "{w}/root"\n'
              f'state = "{w}/state"\n')
    listen = (f'[grpc]\n  address = "{socket}"\n'
              f'[ttrpc]\n  address = "{socket}.ttrpc"\n'
              '[debug]\n  address = ""\n'
              '[metrics]\n  address = ""\n')
    if version == 2:
        return ("version = 2\n" + common +
                'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n' + listen +
                '[plugins."io.containerd.runtime.v2.task"]\n'
                f'  state = "{w}/state/v2"\n')
    # containerd 2.x: the CRI service and NRI off (NRI's socket is host-wide); its temp dir
    # (TMPDIR of the shim: `ctr containers checkpoint` images) and opt dir inside w
    return ("version = 3\n" + common + f'temp = "{w}/tmp"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.nri.v1.nri"]\n' + listen +
            "[plugins.'io.containerd.internal.v1.opt']\n"
            f'  path = "{w}/opt"\n')


def cri_config(w: Path, socket: str, bin_dir: str, runtime_binary: str, runc_root: str, *, handler: str,
               pause_image: str) -> str:
    """containerd 2.x's config with CRI: the runtime handler `handler`, whose runc is runtime_binary,
    and `pause_image` as the sandbox image."""
    return f"""version = 3
root = '{w}/root'
state = '{w}/state'
temp = '{w}/tmp'

[grpc]
  address = '{socket}'
[ttrpc]
  address = '{socket}.ttrpc'
[debug]
  address = '{w}/debug.sock'
  level = 'info'
[metrics]
  address = ''

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{pause_image}'
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = '{w}/certs.d'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = false
    disable_apparmor = true
    # without CAP_SYS_RESOURCE the pause spec's oomScoreAdj -998 fails in runc's nsexec
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = '{handler}'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}]
        runtime_type = 'io.containerd.runc.v2'
        runtime_path = '{bin_dir}/containerd-shim-runc-v2'
        sandboxer = 'podsandbox'
        # as `snapguard install` writes it: the pod's snapguard.io/* annotations reach its containers' specs
        pod_annotations = ['snapguard.io/*']
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{handler}.options]
          BinaryName = '{runtime_binary}'
          SystemdCgroup = false
          Root = '{runc_root}'
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{w}/cni']
      conf_dir = '{w}/cni'
  [plugins.'io.containerd.internal.v1.opt']
    path = '{w}/opt'
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
"""
