#!/usr/bin/env bash
# A real Prometheus server (and promtool) for the tests, from Debian's
# `prometheus` package: downloaded with apt-get and unpacked with dpkg-deb into
# build/prometheus/, nothing installed system-wide. `make test` runs this; the
# tests that need it skip, saying why, where the package cannot be fetched.
#
#     scripts/install_prometheus.sh [DEST]     # default: build/prometheus
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$(realpath -m "${1:-$ROOT/build/prometheus}")"
if [ -x "$DEST/prometheus" ] && [ -x "$DEST/promtool" ]; then
    exit 0
fi
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && apt-get download -q prometheus >/dev/null 2>"$TMP/apt.log") || {
    echo "install_prometheus.sh: apt-get download prometheus failed:" >&2
    tail -3 "$TMP/apt.log" >&2
    exit 1
}
dpkg-deb -x "$TMP"/prometheus_*.deb "$TMP/x"
mkdir -p "$DEST"
cp "$TMP/x/usr/bin/prometheus" "$TMP/x/usr/bin/promtool" "$DEST/"
"$DEST/prometheus" --version | head -1
