"""The GPU device map of a restore: the operator's, or the one the preflight found the image's
GPUs need here, resolved to UUIDs, completed, and checked to be one the cuda-checkpoint in use
applies."""

from __future__ import annotations

from typing import Any

from .. import preflight
from ..config import Config, resolve_cuda_checkpoint
from ..devicemap import DeviceMap
from ..reasons import Reason, SnapguardError
from ._request import Request

__all__ = ["device_map", "resolve_device_map"]


def device_map(req: Request, report: preflight.Report, config: Config) -> DeviceMap | None:
    """The GPU remapping a restore needs, checked to be one the cuda-checkpoint in use applies."""
    if req.device_map is not None:
        manifest = report.manifest
        pairs: DeviceMap | None = resolve_device_map(req.device_map, manifest.gpus if manifest else [],
                                                     list((report.host.gpu or {}).get("gpus") or []))
    else:
        pairs = next((DeviceMap(tuple((old, new) for old, new in f.evidence["device_map"])) for f in report.findings
                      if f.reason is Reason.GPU_IDENTITY_MISMATCH and "device_map" in f.evidence), None)
    if not pairs:
        return None
    tool = resolve_cuda_checkpoint(config)
    from .. import children

    helps = children.run_captured([tool, "-h"], timeout_s=30, what="cuda-checkpoint -h",
                                  reason=Reason.CUDA_PLUGIN_UNAVAILABLE).stdout if tool else ""
    if DeviceMap.ENV not in helps:
        raise SnapguardError(Reason.GPU_IDENTITY_MISMATCH,
                             f"the image's GPUs are not here and {tool} cannot take a device map from CRIU's "
                             "plugin; install snapguard-cuda-checkpoint at the pinned path",
                             evidence={"device_map": list(pairs.pairs), "cuda_checkpoint": tool})
    return pairs


def _pick(gpus: list[dict[str, Any]], key: str, side: str, given: DeviceMap) -> dict[str, Any]:
    found = [g for g in gpus if (str(g.get("index")) == key if key.isdigit() else g.get("uuid") == key)]
    if not found:
        where = "the image" if side == "old" else "this host"
        raise SnapguardError(Reason.GPU_IDENTITY_MISMATCH, f"device map: {where} has no GPU {key}",
                             evidence={"device_map": [list(p) for p in given], "gpu": key})
    return found[0]


def resolve_device_map(given: DeviceMap, image_gpus: list[dict[str, Any]],
                       host_gpus: list[dict[str, Any]]) -> DeviceMap:
    """An operator's map, OLD=NEW pairs: a GPU UUID as is, an index on the OLD side naming the
    image's GPU of that index (its manifest), on the NEW side this host's (NVML). Every NEW GPU
    must be here and of the image GPU's model: the driver refuses anything else, later and less
    clearly. The map is completed into one naming every GPU of the image's node, the ones left
    out onto this host's unused GPUs in index order: r580's cuCheckpointProcessRestore refuses a
    map that leaves any out (CUDA_ERROR_INVALID_VALUE, even for a process that saw one GPU
    through CUDA_VISIBLE_DEVICES; bench/results/h200x2/remap-probe-*.json)."""
    pairs = []
    for old_key, new_key in given:
        old = _pick(image_gpus, old_key, "old", given) if image_gpus or old_key.isdigit() else {"uuid": old_key}
        new = _pick(host_gpus, new_key, "new", given)
        if old.get("name") not in (None, new.get("name")):
            raise SnapguardError(Reason.GPU_MODEL_MISMATCH, f"device map {old_key}={new_key}: the image's GPU is "
                                 f"a {old['name']}, this host's is a {new.get('name')}",
                                 evidence={"device_map": [list(p) for p in given]})
        pairs.append((str(old["uuid"]), str(new["uuid"])))
    if len({o for o, _ in pairs}) != len(pairs) or len({n for _, n in pairs}) != len(pairs):
        raise SnapguardError(Reason.USAGE_ERROR, "device map: each GPU may appear once on each side",
                             evidence={"device_map": pairs})
    left_old = [str(g["uuid"]) for g in image_gpus if str(g["uuid"]) not in {o for o, _ in pairs}]
    left_new = [str(g["uuid"]) for g in host_gpus if str(g["uuid"]) not in {n for _, n in pairs}]
    if len(left_new) < len(left_old):
        raise SnapguardError(Reason.GPU_COUNT_MISMATCH, f"device map: the image's node had {len(image_gpus)} GPU(s), "
                             f"this host has {len(host_gpus)}; the driver needs every one of them mapped",
                             evidence={"device_map": pairs})
    return DeviceMap(tuple(pairs + list(zip(left_old, left_new))))
