"""`snapguard agent`: the node agent that snapshots protected workloads on a reclaim notice.

The agent itself is snapguard.notice; this module maps the flags onto its sources and settings."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..config import load
from ..notice import (AWS_URL, AZURE_URL, DEFAULT_ADDRESS, DEFAULT_CTR, DEFAULT_RUNC_ROOT, GCE_URL, K8S_CA, K8S_TOKEN,
                      K8S_URL, SOURCE_ALIASES, SOURCE_NAMES)
from ..reasons import Reason, SnapguardError
from ._base import positive_seconds, root_only, seconds_or_off

__all__ = ["AGENT_EPILOG", "add_parser", "run"]


AGENT_EPILOG = """\
sources (--source, repeatable; default: local only):
  aws         EC2 spot instance-action through IMDSv2 (token first), 2 minutes' lead
  gce         GCE instance/preempted (watched with wait_for_change) and maintenance-event (alias gcp)
  azure       Azure Scheduled Events, Preempt (and Terminate)
  kubernetes  a watch (list, then watch from its resourceVersion) of this node (--k8s-node) and of
              its pods annotated snapguard.io/job (or of one pod, --k8s-pod), with the in-cluster
              service account's token and CA (alias k8s). A notice: a reclaim taint (GKE's
              cloud.google.com/impending-node-termination, Karpenter's karpenter.sh/disrupted,
              the cluster autoscaler's ToBeDeletedByClusterAutoscaler,
              node.kubernetes.io/out-of-service, the AWS Node Termination Handler's), the
              kubelet's graceful shutdown, a --k8s-node-condition True, an opted-in pod's
              DisruptionTarget condition; a plain cordon only with --notice-on-cordon
  local       the inbox `snapguard notice` writes to (always watched; inotify wakes the agent as a
              notice lands, with --interval as the fallback)

Several sources run at once, each in its own thread: the first notice wins, and one reclaim seen
by two sources snapshots each workload once. Every exchange with a source's peer has one deadline
(--interval, a watch 60 s; at most half the source's documented lead), however slowly the peer
answers; what it answers is parsed with bounds and checked against the owner's format. The inbox
is read without blocking (regular files only, no links, no FIFOs); an entry or a watch event that
is refused is journaled (notice_refused, with its typed reason) and the next one is still read.

On a notice the agent takes one stopping snapshot of each workload `snapguard protect` registered,
into --images (a private local directory), then, with --store URL, puts it into the image store.
With --cri-socket and --registry (the kubelet's path), the node's opted-in pods (RuntimeClass
handler `snapguard`, annotation snapguard.io/job) are found through CRI (ListPodSandbox,
ListContainers) and each is checkpointed through CRI CheckpointContainer, stopped, pushed as an OCI
checkpoint image to PREFIX/JOB and recorded in --store, all within the notice's lead; the
webhook points the job's replacement pod at that image. All of a node's snapshots run at once,
shortest first; the uploads are bound by the notice's lead too.
A notice seen twice is acted on once; the journal in <state_dir>/agent/journal.jsonl records every
step, and a restarted agent discards an image left without its completion marker.


Warm host checks (not with --once): while it waits, the agent runs the snapshot's host checks
(privileges, CRIU and `criu check`, the network lock, the CUDA plugin) in a thread, at start and
every --host-checks-every seconds (default 60; none starts while it acts on a notice). A snapshot
on a notice reuses those that passed when they are at most twice that old, and its timings (the
journal's snapshot_sealed line) say host_checks_age_s; with an older result or none, the
snapshot's own preflight runs them, as without the agent, and a check that failed ahead runs
again there. NVML's GPU inventory (it names the CUDA pids) is always read anew.

Exit (--once): 0 done, 1 a source could not be read (typed line), 2 usage or configuration.
"""


def add_parser(sub: Any) -> None:
    ag = sub.add_parser("agent", help="the node agent: snapshot protected workloads on a reclaim notice",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=AGENT_EPILOG,
                        description=("Watch notice sources and, on a reclaim notice, snapshot (and stop) every "
                                     "workload registered with `snapguard protect`, once per notice. Runs until "
                                     "stopped (packaging/systemd/snapguard-agent.service), or one round with --once."))
    ag.add_argument("--source", action="append", choices=SOURCE_NAMES + tuple(SOURCE_ALIASES), default=[],
                    metavar="NAME", help=f"a notice source to watch: {', '.join(SOURCE_NAMES)} (repeatable; "
                    "several run at once, the first notice wins)")
    ag.add_argument("--store", metavar="URL", help="image store URL (snapguard.store); without it images stay local")
    ag.add_argument("--textfile", metavar="DIR", help="write snapguard_agent_store_writable (1 when the store took "
                    "a probe write at start) and, after each notice, snapguard_agent_last_notice_snapshotted{job} "
                    "and snapguard_agent_last_notice_fell_back{job,reason} to DIR/snapguard-agent.prom for "
                    "node-exporter's textfile collector (default <state_dir>/agent/snapguard-agent.prom)")
    ag.add_argument("--metrics-port", type=port_number, metavar="PORT",
                    help="serve the node's operations metrics (snapguard_snapshots_total, ...; extra `metrics`) "
                    "in Prometheus' text format at http://ADDRESS:PORT/metrics (default: not served)")
    ag.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                    help="the address --metrics-port listens on (default 127.0.0.1, loopback)")
    ag.add_argument("--images", metavar="DIR", help="where images are written (default <state_dir>/agent/images; "
                                                      "the state dir is often tmpfs: give a disk for large images)")
    ag.add_argument("--interval", type=interval_seconds, default=5.0, metavar="S",
                    help="seconds between polls of each source, and each poll's bound (default 5, AWS's advice); "
                         "the local inbox is also read as soon as a notice lands in it")
    ag.add_argument("--once", action="store_true", help="finish what a previous agent left, poll each source once, "
                                                         "act, exit")
    ag.add_argument("--host-checks-every", type=seconds_or_off, default=60.0, metavar="S",
                    help="seconds between runs of the snapshot's host checks kept warm for a notice; a result "
                         "older than 2*S is not used (default 60; 0: off, each snapshot runs them itself)")
    ag.add_argument("--keep", type=int, metavar="N", help="after each upload, keep the job's N newest whole images "
                    "in the store and delete the older ones (default: delete nothing)")
    ag.add_argument("--containerd", action="store_true",
                    help="protect every running container annotated snapguard.io/job (OCI spec annotation or "
                         "containerd label; Kubernetes pod annotations arrive through the runtime's "
                         "pod_annotations, which `snapguard install` sets), listed through containerd's API")
    ag.add_argument("--containerd-address", default=DEFAULT_ADDRESS, metavar="SOCK",
                    help=f"containerd's socket (default {DEFAULT_ADDRESS})")
    ag.add_argument("--containerd-namespace", action="append", default=[], metavar="NS",
                    help="namespace to list (repeatable; default k8s.io and default)")
    ag.add_argument("--containerd-runc-root", default=DEFAULT_RUNC_ROOT, metavar="DIR",
                    help=f"runc's root of containerd's shim; the namespace is appended (default {DEFAULT_RUNC_ROOT})")
    ag.add_argument("--ctr", default=DEFAULT_CTR, metavar="PATH",
                    help=f"containerd's ctr client, root's alone (default {DEFAULT_CTR})")
    ag.add_argument("--cri-socket", metavar="PATH",
                    help="the CRI path: list this node's opted-in pods (RuntimeClass handler `snapguard`, annotation "
                         "snapguard.io/job) on containerd's CRI socket PATH and, on a notice, take each one's stopping "
                         "snapshot through CRI CheckpointContainer, published as an OCI checkpoint image to "
                         "--registry and recorded in --store (e.g. /run/containerd/containerd.sock; config key "
                         "cri_socket)")
    ag.add_argument("--registry", metavar="URL",
                    help="the registry the CRI path pushes checkpoint images to (http:// or https://HOST[:PORT]); "
                         "needed with --cri-socket (config key registry)")
    ag.add_argument("--registry-repository", metavar="PREFIX",
                    help="the repository prefix of the checkpoint images: PREFIX/JOB (config key "
                         "registry_repository, default snapguard/ckpt)")
    ag.add_argument("--aws-url", default=AWS_URL, metavar="URL", help=f"IMDS base (default {AWS_URL})")
    ag.add_argument("--gce-url", default=GCE_URL, metavar="URL", help=f"GCE metadata base (default {GCE_URL})")
    ag.add_argument("--azure-url", default=AZURE_URL, metavar="URL", help=f"Azure IMDS base (default {AZURE_URL})")
    ag.add_argument("--k8s-url", metavar="URL", help="API server (default https://$KUBERNETES_SERVICE_HOST:"
                    f"$KUBERNETES_SERVICE_PORT in a pod, else {K8S_URL})")
    ag.add_argument("--k8s-node", metavar="NAME", default=os.environ.get("NODE_NAME"),
                    help="this node's name: its node and its opted-in pods are watched (default $NODE_NAME, "
                         "which the chart sets from the downward API)")
    ag.add_argument("--k8s-pod", metavar="NS/NAME", help="watch this one pod instead of the node's opted-in pods: "
                    "its DisruptionTarget condition is a notice")
    ag.add_argument("--notice-on-cordon", action="store_true",
                    help="a plain cordon of this node (spec.unschedulable, as `kubectl cordon` or a drain sets it) "
                         "is a notice too (default: not; a cordon is routine maintenance)")
    ag.add_argument("--k8s-node-condition", action="append", default=[], metavar="TYPE",
                    help="a node condition type whose status True is a notice (repeatable)")
    ag.add_argument("--k8s-token-file", default=K8S_TOKEN, metavar="PATH", help=f"bearer token (default {K8S_TOKEN})")
    ag.add_argument("--k8s-ca-file", default=K8S_CA, metavar="PATH", help=f"API server CA (default {K8S_CA})")


def interval_seconds(text: str) -> float:
    """--interval: seconds between 0.1 and 3600 (a poll every microsecond is a busy loop)."""
    value = positive_seconds(text)
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 seconds, not {text}")
    return value


def port_number(text: str) -> int:
    """--metrics-port: a TCP port, 1 to 65535."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1 to 65535), not {text}")
    return int(text)


def _serve_metrics(args: argparse.Namespace, state_dir: str) -> None:
    """--metrics-port: the operations metrics served from this process, or USAGE_ERROR before
    anything is watched (prometheus_client missing, an address that is not one, a port taken)."""
    if args.metrics_port is None:
        return
    import ipaddress

    from .. import metrics

    try:
        ipaddress.ip_address(args.metrics_address)
        metrics.serve(args.metrics_port, args.metrics_address, state_dir)
    except metrics.MetricsUnavailable as e:
        raise SnapguardError(Reason.USAGE_ERROR, f"--metrics-port: {e}") from None
    except (ValueError, OSError) as e:
        raise SnapguardError(Reason.USAGE_ERROR, f"--metrics-port {args.metrics_port} on {args.metrics_address}: "
                             f"cannot listen: {getattr(e, 'strerror', None) or e}") from None


def _check_store(url: str | None) -> None:
    """--store checked where it is given, with the store's own URL checks (USAGE_ERROR), not
    after a notice stopped the workload."""
    if url is not None:
        from ..store import open_store

        open_store(url)


def _sources(args: argparse.Namespace, config: Any) -> list[Any]:
    from .. import notice

    out: list[Any] = [notice.local_source(config)]
    for name in dict.fromkeys(SOURCE_ALIASES.get(n, n) for n in args.source):
        if name == "aws":
            out.append(notice.AwsSpot(args.aws_url))
        elif name == "gce":
            out.append(notice.Gce(args.gce_url))
        elif name == "azure":
            out.append(notice.Azure(args.azure_url))
        elif name == "kubernetes":
            out.extend(notice.kubernetes_sources(args.k8s_url or notice.k8s_default_url(), node=args.k8s_node,
                                                 pod=args.k8s_pod, token_file=args.k8s_token_file or None,
                                                 ca_file=args.k8s_ca_file or None,
                                                 node_conditions=tuple(args.k8s_node_condition),
                                                 notice_on_cordon=args.notice_on_cordon))
    return out


def _containerd(args: argparse.Namespace) -> Any:
    if not args.containerd:
        return None
    from ..trust import UntrustedPathError, resolve_trusted
    from ..notice import ContainerdWatch

    if not os.path.isabs(args.ctr):
        raise SnapguardError(Reason.USAGE_ERROR, f"--ctr {args.ctr!r} is not an absolute path")
    try:
        ctr = resolve_trusted(args.ctr, "exec")
    except UntrustedPathError as e:
        reason = Reason.CONTAINERD_UNAVAILABLE if e.unusable else Reason.UNTRUSTED_PATH
        raise SnapguardError(reason, f"--ctr: {e}", evidence={"path": e.path}) from None
    return ContainerdWatch(ctr, args.containerd_address, tuple(args.containerd_namespace) or ("k8s.io", "default"),
                           args.containerd_runc_root)


class _Setting:
    """One of the CRI path's settings: its flag's value, else its config key's, and where it came from."""

    def __init__(self, flag: str, flag_value: str | None, key: str, config: Any) -> None:
        from_flag = flag_value is not None
        self.value: str = flag_value if from_flag else getattr(config, key)
        self.name = flag if from_flag else f"`{key}` (config {config.source or 'defaults'} or $SNAPGUARD_*)"
        self.reason = Reason.USAGE_ERROR if from_flag else Reason.CONFIG_INVALID

    def refuse(self, why: str) -> SnapguardError:
        return SnapguardError(self.reason, f"{self.name} {self.value!r}: {why}")


def _cri(args: argparse.Namespace, config: Any) -> Any:
    """The CRI path from --cri-socket, --registry and --registry-repository, each over its config
    key (cri_socket, registry, registry_repository), checked before anything is watched:
    USAGE_ERROR for a flag, CONFIG_INVALID for a key."""
    sock = _Setting("--cri-socket", args.cri_socket, "cri_socket", config)
    registry = _Setting("--registry", args.registry, "registry", config)
    repo = _Setting("--registry-repository", args.registry_repository, "registry_repository", config)
    if not sock.value:
        if args.registry:
            raise SnapguardError(Reason.USAGE_ERROR, "--registry is the CRI path's: give --cri-socket too (or "
                                 "config key cri_socket)")
        return None
    from urllib.parse import urlsplit

    from ..notice import CriPods

    if not os.path.isabs(sock.value):
        raise sock.refuse("not an absolute path")
    if not registry.value:
        raise SnapguardError(sock.reason, f"{sock.name} publishes to a registry: give --registry URL (or config "
                             "key registry)")
    url = urlsplit(registry.value)
    if url.scheme not in ("http", "https") or not url.hostname or url.path.strip("/") or url.query:
        raise registry.refuse("not http(s)://HOST[:PORT]")
    if not args.store:
        raise SnapguardError(Reason.USAGE_ERROR, f"{sock.name}: the CRI path records each published image in the "
                             "job's store entry: give --store URL")
    prefix = repo.value.strip("/")
    if not all(part and part == part.lower() and part.replace("-", "").replace("_", "").replace(".", "").isalnum()
               for part in prefix.split("/")):
        raise repo.refuse("not an OCI repository name (lower-case letters, digits, '.', '_', '-', '/')")
    return CriPods(sock.value, registry.value.rstrip("/"), prefix)


def run(args: argparse.Namespace) -> int:
    from ..notice import Agent

    root_only("snapguard agent")
    if args.keep is not None and args.keep < 1:
        raise SnapguardError(Reason.USAGE_ERROR, f"--keep {args.keep}: keep at least the newest whole image")
    _check_store(args.store)
    config = load()
    cri = _cri(args, config)
    _serve_metrics(args, config.state_dir)
    agent = Agent(config, _sources(args, config), store_url=args.store, images=args.images, interval_s=args.interval,
                  log=lambda line: print(line, file=sys.stderr, flush=True), containerd=_containerd(args), cri=cri,
                  keep=args.keep, host_checks_every_s=args.host_checks_every or None,
                  metrics_path=os.path.join(os.path.abspath(args.textfile), "snapguard-agent.prom")
                  if args.textfile else None)
    return agent.run(once=args.once)
