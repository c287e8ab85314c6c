#!/usr/bin/env bash
# Puts Debian's prometheus and promtool (static but for libc) in a version-keyed cache outside the repo; prints the bin dir last.
#
# Usage:   BIN=$(bash e2e/prometheus.sh | tail -1)
# Env:     KVFLEET_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet)
#          FORCE=1        fetch again even if the binaries are there
# How:     `apt-get download` of the Debian package (no install: no service started, no root needed once the apt
#          lists exist), unpacked with dpkg-deb; `apt-get update` (with sudo when not root) only if the lists lack it.
set -euo pipefail

CACHE_ROOT=${KVFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet}
log() { printf '[prometheus.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

candidate() { apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}'; }
VERSION=$(candidate)
if [ -z "$VERSION" ] || [ "$VERSION" = "(none)" ]; then
    log "apt lists lack prometheus: apt-get update"
    as_root apt-get update -qq >&2
    VERSION=$(candidate)
fi
[ -n "$VERSION" ] && [ "$VERSION" != "(none)" ] || { log "ERROR: no prometheus package in the apt sources"; exit 1; }

BIN="$CACHE_ROOT/prometheus/${VERSION//[^A-Za-z0-9.+-]/_}/bin"
if [ "${FORCE:-0}" != 1 ] && "$BIN/prometheus" --version >/dev/null 2>&1 && "$BIN/promtool" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
log "downloading prometheus $VERSION"
(cd "$WORK" && apt-get download -q "prometheus=$VERSION" >&2)
dpkg-deb -x "$WORK"/prometheus_*.deb "$WORK/root"
mkdir -p "$BIN"
install -m 0755 "$WORK/root/usr/bin/prometheus" "$WORK/root/usr/bin/promtool" "$BIN/"
"$BIN/prometheus" --version >&2
echo "$BIN"
