"""JSON schemas (draft 2020-12) of what each notice source reads from a peer or the inbox.

Only the fields a source uses are constrained; others are allowed (the owners add fields). The
shapes are those the owners document: EC2's `spot/instance-action`, Azure Scheduled Events,
Kubernetes v1 Node, Pod, their lists and watch events (a `Status` object in an ERROR event), and
the inbox entry `snapguard notice` writes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AWS_INSTANCE_ACTION", "AZURE_EVENTS", "INBOX_ENTRY", "K8S_LIST", "K8S_NODE", "K8S_POD",
           "K8S_WATCH_EVENT"]

_STR = {"type": "string", "maxLength": 4096}
_STRMAP = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 65536}, "maxProperties": 512}

AWS_INSTANCE_ACTION: dict[str, Any] = {
    "type": "object",
    "required": ["action", "time"],
    "properties": {"action": {"enum": ["terminate", "stop", "hibernate"]}, "time": {"type": "string", "maxLength": 64}},
}

AZURE_EVENTS: dict[str, Any] = {
    "type": "object",
    "required": ["DocumentIncarnation", "Events"],
    "properties": {
        "DocumentIncarnation": {"type": "integer", "minimum": 0},
        "Events": {"type": "array", "maxItems": 256, "items": {
            "type": "object", "required": ["EventId", "EventType"],
            "properties": {"EventId": {"type": "string", "minLength": 1, "maxLength": 128},
                           "EventType": {"type": "string", "maxLength": 64},
                           "NotBefore": {"type": "string", "maxLength": 64},
                           "Resources": {"type": "array", "items": _STR, "maxItems": 1024}}}},
    },
}

_CONDITIONS = {"type": "array", "maxItems": 128, "items": {
    "type": "object", "required": ["type", "status"],
    "properties": {"type": _STR, "status": {"enum": ["True", "False", "Unknown"]}, "reason": _STR,
                   "message": {"type": "string", "maxLength": 65536}, "lastTransitionTime": _STR}}}

_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}, "namespace": _STR,
                            "uid": _STR, "resourceVersion": _STR, "annotations": _STRMAP, "labels": _STRMAP,
                            "deletionTimestamp": _STR}}

K8S_NODE: dict[str, Any] = {
    "type": "object",
    "required": ["metadata"],
    "properties": {
        "kind": {"const": "Node"},
        "metadata": _METADATA,
        "spec": {"type": "object", "properties": {
            "unschedulable": {"type": "boolean"},
            "taints": {"type": "array", "maxItems": 256, "items": {
                "type": "object", "required": ["key", "effect"],
                "properties": {"key": _STR, "value": _STR, "timeAdded": _STR,
                               "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}}}}}},
        "status": {"type": "object", "properties": {"conditions": _CONDITIONS}},
    },
}

K8S_POD: dict[str, Any] = {
    "type": "object",
    "required": ["metadata"],
    "properties": {
        "kind": {"const": "Pod"},
        "metadata": {**_METADATA, "required": ["name", "namespace"]},
        "spec": {"type": "object", "properties": {"nodeName": _STR, "runtimeClassName": _STR}},
        "status": {"type": "object", "properties": {"conditions": _CONDITIONS, "phase": _STR}},
    },
}

K8S_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["metadata", "items"],
    "properties": {
        "kind": {"enum": ["NodeList", "PodList"]},
        "metadata": {"type": "object", "required": ["resourceVersion"],
                     "properties": {"resourceVersion": {"type": "string", "minLength": 1, "maxLength": 128}}},
        "items": {"type": "array", "maxItems": 10000, "items": {"type": "object"}},
    },
}

K8S_WATCH_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["type", "object"],
    "properties": {
        "type": {"enum": ["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]},
        "object": {"type": "object", "properties": {
            "metadata": {"type": "object", "properties": {"resourceVersion": {"type": "string", "maxLength": 128}}},
            "code": {"type": "integer"}, "reason": _STR, "message": _STR}},
    },
}

INBOX_ENTRY: dict[str, Any] = {
    "type": "object",
    "required": ["id"],
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$"},
        "reason": {"type": ["string", "null"], "maxLength": 1024},
        "time": {"type": "number"},
        "by_uid": {"type": "integer"},
        "deadline": {"type": ["number", "null"]},
    },
}
