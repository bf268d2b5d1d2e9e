"""An AdmissionReview (admission.k8s.io/v1) read as the untrusted input it is, and the answers
the webhook gives.

The body is parsed with a size cap (the server's), a nesting bound (`MAX_DEPTH`), no NaN or
Infinity, then checked against a JSON Schema of the envelope (`ENVELOPE`): apiVersion, kind, a
request with its uid, kind, resource and operation as the API server sends them. An envelope that
fails is ADMISSION_REVIEW_INVALID (the server answers 400 with a Status). The object inside (a pod)
is checked apart (`POD`): a pod the webhook cannot read is admitted unchanged, with a warning,
since a webhook fault must never block a pod.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from ..reasons import Reason, SnapguardError

__all__ = ["ADMISSION_V1", "ENVELOPE", "MAX_DEPTH", "POD", "Answer", "Review", "parse", "pod_problem", "status"]

ADMISSION_V1 = "admission.k8s.io/v1"
MAX_DEPTH = 64  # a pod's deepest part (managedFields' fieldsV1) is a few levels below 20
_MAX_WARNINGS, _WARNING_CHARS = 8, 256  # the API server truncates longer ones

_STR = {"type": "string", "maxLength": 4096}
_GVK = {"type": "object", "required": ["group", "version", "kind"],
        "properties": {"group": _STR, "version": _STR, "kind": _STR}}
_GVR = {"type": "object", "required": ["group", "version", "resource"],
        "properties": {"group": _STR, "version": _STR, "resource": _STR}}

ENVELOPE: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "an admission.k8s.io/v1 AdmissionReview request",
    "type": "object",
    "required": ["apiVersion", "kind", "request"],
    "properties": {
        "apiVersion": {"const": ADMISSION_V1},
        "kind": {"const": "AdmissionReview"},
        "request": {
            "type": "object",
            "required": ["uid", "kind", "resource", "operation"],
            "properties": {
                "uid": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9._:-]+$"},
                "kind": _GVK, "resource": _GVR, "requestKind": _GVK, "requestResource": _GVR,
                "subResource": _STR, "name": _STR, "namespace": _STR,
                "operation": {"enum": ["CREATE", "UPDATE", "DELETE", "CONNECT"]},
                "dryRun": {"type": "boolean"},
                "object": {"type": ["object", "null"]}, "oldObject": {"type": ["object", "null"]},
                "options": {"type": ["object", "null"]}, "userInfo": {"type": "object"},
            },
        },
    },
}

_ENV = {"type": "array", "maxItems": 4096, "items": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 4096}, "value": {"type": "string"},
                   "valueFrom": {"type": "object"}}}}
_MOUNTS = {"type": "array", "maxItems": 4096, "items": {
    "type": "object", "required": ["name", "mountPath"],
    "properties": {"name": _STR, "mountPath": _STR}}}
_CONTAINER = {"type": "object", "required": ["name"],
              "properties": {"name": _STR, "image": _STR, "env": _ENV, "volumeMounts": _MOUNTS}}
POD: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "a v1 Pod, the parts the webhook reads",
    "type": "object",
    "required": ["spec"],
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "Pod"},
        "metadata": {"type": "object", "properties": {
            "name": _STR, "generateName": _STR, "namespace": _STR,
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["containers"], "properties": {
            "runtimeClassName": {"type": ["string", "null"]},
            "containers": {"type": "array", "minItems": 1, "maxItems": 1024, "items": _CONTAINER},
            "volumes": {"type": "array", "maxItems": 4096,
                        "items": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}}},
    },
}

_validators: dict[str, Any] = {}


def _validator(schema: dict[str, Any]) -> Any:
    v = _validators.get(schema["title"])
    if v is None:
        import jsonschema

        jsonschema.Draft202012Validator.check_schema(schema)
        v = _validators[schema["title"]] = jsonschema.Draft202012Validator(schema)
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth_over(obj: Any, limit: int) -> bool:
    """Whether `obj` nests deeper than `limit` (walked without recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def _first_error(schema: dict[str, Any], obj: Any) -> str | None:
    error = next(iter(sorted(_validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(top)"
    return f"{where}: {error.message[:200]}"


@dataclass(frozen=True)
class Review:
    """The request of an AdmissionReview: its uid (echoed), what it is about, and the object."""

    uid: str
    group: str
    version: str
    kind: str
    operation: str
    namespace: str
    name: str
    dry_run: bool
    object: dict[str, Any] | None
    sub_resource: str = ""

    @property
    def is_pod_create(self) -> bool:
        return (self.group, self.version, self.kind, self.operation, self.sub_resource) == ("", "v1", "Pod",
                                                                                             "CREATE", "")

    @property
    def subject(self) -> str:
        """The pod's namespace/name for the log (its generateName and `*` before it has a name)."""
        meta = (self.object or {}).get("metadata") if isinstance(self.object, dict) else None
        name = self.name or (f"{meta.get('generateName', '')}*" if isinstance(meta, dict) else "")
        return f"{self.namespace}/{name}"[:200]


def parse(body: bytes) -> Review:
    """The Review of an AdmissionReview body; ADMISSION_REVIEW_INVALID, one line, when it is not one."""
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise SnapguardError(Reason.ADMISSION_REVIEW_INVALID, f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapguardError(Reason.ADMISSION_REVIEW_INVALID, f"the body is not JSON: {str(e)[:200]}") from None
    if _depth_over(doc, MAX_DEPTH):
        raise SnapguardError(Reason.ADMISSION_REVIEW_INVALID, f"the body nests deeper than {MAX_DEPTH} levels")
    problem = _first_error(ENVELOPE, doc)
    if problem:
        raise SnapguardError(Reason.ADMISSION_REVIEW_INVALID, f"not an {ADMISSION_V1} AdmissionReview request: {problem}")
    req = doc["request"]
    return Review(uid=req["uid"], group=req["kind"]["group"], version=req["kind"]["version"], kind=req["kind"]["kind"],
                  operation=req["operation"], namespace=req.get("namespace", ""), name=req.get("name", ""),
                  dry_run=bool(req.get("dryRun", False)), object=req.get("object"),
                  sub_resource=req.get("subResource", ""))


def pod_problem(pod: Any) -> str | None:
    """Why the webhook cannot read this pod (None: it can)."""
    return _first_error(POD, pod)


@dataclass
class Answer:
    """The webhook's answer to one review: always allowed; `patch` the JSONPatch operations (none:
    the pod as it came), `warnings` for the user (kubectl prints them), `actions` for the log."""

    uid: str
    subject: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)

    def warn(self, text: str) -> None:
        self.warnings.append(text)

    def review(self) -> dict[str, Any]:
        """The AdmissionReview response object."""
        response: dict[str, Any] = {"uid": self.uid, "allowed": True}
        if self.patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(self.patch, separators=(",", ":")).encode()).decode()
        if self.warnings:
            response["warnings"] = [w if len(w) <= _WARNING_CHARS else w[:_WARNING_CHARS - 3] + "..."
                                    for w in self.warnings[:_MAX_WARNINGS]]
        return {"apiVersion": ADMISSION_V1, "kind": "AdmissionReview", "response": response}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A meta/v1 Status: what the server answers a request it cannot review."""
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
