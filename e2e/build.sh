#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd and kwok from the Go module proxy into a version-keyed cache outside the repo; prints the bin dir on the last line.
#
# Usage:   BIN=$(e2e/build.sh | tail -1)
# Env:     K8S_VERSION ETCD_VERSION KWOK_VERSION  versions to build (defaults below)
#          KVFLEET_CACHE   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet)
#          BUILD_JOBS      go build -p value (default 2: the dev box has 2 cores and a
#                          kube-apiserver link alone needs ~2 GiB RSS)
#          FORCE=1         rebuild even if the binaries are already there
#          CHECK_ONLY=1    never build: print the bin dir if all binaries are there, else exit 3
# Output:  progress and Go's own output on stderr; the summary and, last, the bin dir on stdout.
# Needs:   go >= 1.26 (etcd v3.5.35 and kwok v0.8.0 declare `go 1.26.0`), network access
#          to GOPROXY only. No Docker, no sudo, no cgo.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.35.4}
ETCD_VERSION=${ETCD_VERSION:-v3.5.35}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
BUILD_JOBS=${BUILD_JOBS:-2}
FORCE=${FORCE:-0}

CACHE_ROOT=${KVFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet}
DEST="$CACHE_ROOT/k8s/${K8S_VERSION}-etcd${ETCD_VERSION}-kwok${KWOK_VERSION}"
BIN="$DEST/bin"
WORK="$DEST/work"   # generated wrapper modules live here, never in the repo
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok)
K8S_CMDS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

log() { printf '[build.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Does binary $1 exist and answer a version query? kwok has `--version` (cobra) and a
# `version` subcommand depending on release, so accept either. kubectl has no `--version`
# flag; `version --client` never contacts a server (KUBECONFIG is pointed at nothing anyway).
version_cmd() {
    case $1 in
        kubectl) echo "version --client" ;;
        *) echo "--version" ;;
    esac
}
answers_version() {
    local b="$BIN/$1"
    [[ -x "$b" ]] || return 1
    # shellcheck disable=SC2046
    KUBECONFIG=/dev/null timeout 30 "$b" $(version_cmd "$1") >/dev/null 2>&1 && return 0
    [[ "$1" == kwok ]] && timeout 30 "$b" version >/dev/null 2>&1 && return 0
    return 1
}
version_of() {
    local b="$BIN/$1" out
    # shellcheck disable=SC2046
    out=$(KUBECONFIG=/dev/null timeout 30 "$b" $(version_cmd "$1") 2>&1) || { [[ "$1" == kwok ]] && out=$(timeout 30 "$b" version 2>&1); } || out="(no version output)"
    printf '%s' "$out"
}
all_present() {
    local b
    for b in "${BINARIES[@]}"; do answers_version "$b" || return 1; done
}

# Fast path first, before touching Go at all: callers run this on every test session.
if [[ "$FORCE" != 1 || "${CHECK_ONLY:-0}" == 1 ]] && all_present; then
    echo "$BIN"
    exit 0
fi
if [[ "${CHECK_ONLY:-0}" == 1 ]]; then
    log "not built (or incomplete): $BIN; run e2e/build.sh without CHECK_ONLY"
    exit 3
fi

command -v go >/dev/null || die "go is not on PATH (need go >= 1.26)"

# Binaries and module caches must never land inside a git checkout (they would get committed).
script_repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null || true)
if [[ -n "$script_repo" ]]; then
    real_dest=$(realpath -m "$DEST"); script_repo=$(realpath "$script_repo")
    [[ "$real_dest/" != "$script_repo/"* ]] || die "cache dir $DEST is inside the repo $script_repo; set KVFLEET_CACHE elsewhere"
fi
mkdir -p "$BIN" "$WORK"

# One build per version key at a time: a second caller waits, then takes the fast path.
if command -v flock >/dev/null; then
    exec 9>"$DEST/.lock"
    flock 9
    if [[ "$FORCE" != 1 ]] && all_present; then echo "$BIN"; exit 0; fi
fi

# -mod=mod lets go add missing requirements/go.sum lines to the generated wrappers instead
# of failing; -buildvcs=false because the cache dir may sit under some unrelated VCS tree.
# CGO off: upstream ships these binaries static, and it needs no C toolchain here.
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
export GO111MODULE=on
# Module queries run from $WORK (no go.mod of its own) and with workspaces off, so a stray
# go.mod/go.work in the caller's cwd (e.g. /tmp) is never read or modified.
export GOWORK=off

STEP_NAMES=()
STEP_SECS=()
# run_step NAME CMD...: time a step; on failure name the step and stop.
run_step() {
    local name=$1; shift
    local t0 t1 rc=0
    log "step '$name': start"
    t0=$(date +%s)
    "$@" || rc=$?
    t1=$(date +%s)
    if (( rc != 0 )); then
        die "step '$name' failed (exit $rc) after $((t1 - t0))s; see the go output above. Cache: $DEST"
    fi
    log "step '$name': done in $((t1 - t0))s"
    STEP_NAMES+=("$name")
    STEP_SECS+=("$((t1 - t0))")
}

# ---------------------------------------------------------------- kubernetes
# `go install k8s.io/kubernetes/cmd/...@v` is refused (its go.mod has replace directives),
# and requiring it plainly fails on `k8s.io/<staging> v0.0.0` (unknown revision). So we
# generate a wrapper module that requires k8s.io/kubernetes and replaces every staging
# module with its published twin v0.<minor>.<patch> (kubernetes/kubernetes#79384).
[[ "$K8S_VERSION" =~ ^v1\.([0-9]+)\.([0-9]+.*)$ ]] || die "K8S_VERSION must look like v1.N.M, got $K8S_VERSION"
K8S_MINOR=${BASH_REMATCH[1]}
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
K8S_WRAP="$WORK/k8s"

k8s_prepare() {
    local info gomod staging godebug goline
    # The proxy gives us k8s.io/kubernetes's own go.mod; its `k8s.io/X => ./staging/src/k8s.io/X`
    # lines are the authoritative staging list for this version, so version bumps just work.
    info=$(cd "$WORK" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION") || { log "$info"; return 1; }
    gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$info")
    [[ -f "$gomod" ]] || { log "no GoMod file in: $info"; return 1; }
    staging=$(sed -n 's#^[[:space:]]*\(replace[[:space:]]\{1,\}\)\{0,1\}\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\2#p' "$gomod" | sort -u)
    [[ -n "$staging" ]] || { log "found no staging replace lines in $gomod"; return 1; }
    # The main module's go line (and godebug lines) set the binary's GODEBUG defaults;
    # copy upstream's so the wrapper behaves like an upstream release build.
    goline=$(grep -m1 '^go [0-9]' "$gomod")
    godebug=$(awk '/^godebug[[:space:]]*\(/{p=1} p{print; if(/^\)/)p=0; next} /^godebug[[:space:]]/{print}' "$gomod")
    log "k8s.io/kubernetes $K8S_VERSION: $(wc -l <<<"$staging") staging modules -> $STAGING_VERSION; $goline; ${godebug:-no godebug}"

    rm -rf "$K8S_WRAP"; mkdir -p "$K8S_WRAP"
    {
        echo "// Generated by kvfleet e2e/build.sh; safe to delete."
        echo "module kvfleet.local/k8sbins"
        echo
        echo "$goline"
        [[ -n "$godebug" ]] && { echo; echo "$godebug"; }
        echo
        echo "require k8s.io/kubernetes $K8S_VERSION"
        echo
        echo "replace ("
        local m; for m in $staging; do echo "	$m => $m $STAGING_VERSION"; done
        echo ")"
        echo
        # `tool` lines (go >= 1.24) keep the cmd packages' deps in go.mod through tidy.
        echo "tool ("
        for m in "${K8S_CMDS[@]}"; do echo "	k8s.io/kubernetes/cmd/$m"; done
        echo ")"
    } >"$K8S_WRAP/go.mod"
    (cd "$K8S_WRAP" && go mod tidy)
}

# Same -X stamps as upstream hack/lib/version.sh, so /version and --version report the
# real release instead of v0.0.0-master+$Format:%H$. The build date is the tag time from
# the proxy's .info, so rebuilds are reproducible.
k8s_ldflags() {
    local date pkg ld="-s -w"
    date=$(cd "$WORK" && go list -m -json "k8s.io/kubernetes@$K8S_VERSION" 2>/dev/null | sed -n 's/^[[:space:]]*"Time": "\(.*\)",\{0,1\}$/\1/p')
    date=${date:-1970-01-01T00:00:00Z}
    for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
        ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$K8S_MINOR"
        # gitCommit is blanked: the proxy does not carry the hash, and the default is "$Format:%H$".
        ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date -X $pkg.gitCommit="
    done
    printf '%s' "$ld"
}

k8s_build() {
    local name=$1
    # tags selinux,notest and -trimpath match upstream's hack/lib/golang.sh static builds.
    (cd "$K8S_WRAP" && go build -p "$BUILD_JOBS" -trimpath -tags selinux,notest \
        -ldflags "$K8S_LDFLAGS" -o "$BIN/$name" "k8s.io/kubernetes/cmd/$name")
}

# ---------------------------------------------------------------- generic wrapper
# make_wrapper DIR MODULE VERSION PKG: a throwaway main module requiring MODULE@VERSION (PKG as a tool). Needed
# when MODULE's go.mod has replace directives (etcd: `=> ../api` etc.), which makes
# `go install MODULE/...@VERSION` refuse; in a wrapper those replaces are simply ignored.
make_wrapper() {
    local dir=$1 mod=$2 ver=$3 pkg=$4
    rm -rf "$dir"; mkdir -p "$dir"
    printf '// Generated by kvfleet e2e/build.sh; safe to delete.\nmodule kvfleet.local/wrap\n\ngo 1.24\n\nrequire %s %s\n\ntool %s\n' \
        "$mod" "$ver" "$pkg" >"$dir/go.mod"
    # tidy raises the go line to whatever the dependency declares (1.26 for etcd 3.5.35).
    (cd "$dir" && go mod tidy)
}

etcd_build() {
    make_wrapper "$WORK/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3 || return 1
    # Without -o the binary would be named `server`. etcd's version is a source constant.
    (cd "$WORK/etcd" && go build -p "$BUILD_JOBS" -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
}

kwok_build() {
    local out rc=0
    # kwok's go.mod has no replace directives (v0.7/v0.8), so plain go install works;
    # fall back to a wrapper module if a future release adds some.
    out=$(cd "$WORK" && GOBIN="$BIN" go install -p "$BUILD_JOBS" -trimpath -ldflags "-s -w" \
        "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" 2>&1) || rc=$?
    [[ -n "$out" ]] && printf '%s\n' "$out" >&2
    (( rc == 0 )) && return 0
    grep -q 'replace directives' <<<"$out" || return "$rc"
    log "go install refused kwok (replace directives); using a wrapper module"
    make_wrapper "$WORK/kwok" sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok || return 1
    (cd "$WORK/kwok" && go build -p "$BUILD_JOBS" -trimpath -ldflags "-s -w" -o "$BIN/kwok" sigs.k8s.io/kwok/cmd/kwok)
}

# ---------------------------------------------------------------- main
log "go: $(go version); jobs: $BUILD_JOBS; dest: $DEST"
log "versions: kubernetes $K8S_VERSION (staging $STAGING_VERSION), etcd $ETCD_VERSION, kwok $KWOK_VERSION"
T_ALL=$(date +%s)

# A binary from an interrupted earlier run is kept if it works: go build writes to a temp
# file and renames, so a present binary is a complete one, and the dir is version-keyed.
need() { [[ "$FORCE" == 1 ]] || ! answers_version "$1"; }

k8s_needed=0
for b in "${K8S_CMDS[@]}"; do need "$b" && k8s_needed=1; done
if (( k8s_needed )); then
    run_step "k8s: generate wrapper + go mod tidy (downloads)" k8s_prepare
    K8S_LDFLAGS=$(k8s_ldflags)
    for b in "${K8S_CMDS[@]}"; do
        if need "$b"; then run_step "k8s: build $b" k8s_build "$b"; else log "$b: present, skipped"; fi
    done
fi
if need etcd; then run_step "etcd: wrapper + build" etcd_build; else log "etcd: present, skipped"; fi
if need kwok; then run_step "kwok: go install" kwok_build; else log "kwok: present, skipped"; fi

for b in "${BINARIES[@]}"; do
    answers_version "$b" || die "$b was built but does not answer --version: $BIN/$b"
done
T_TOTAL=$(( $(date +%s) - T_ALL ))

{
    echo "== kvfleet control-plane binaries ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(go version | awk '{print $3}'), -p $BUILD_JOBS)"
    echo "-- step wall times"
    for i in "${!STEP_NAMES[@]}"; do printf '  %6ss  %s\n' "${STEP_SECS[$i]}" "${STEP_NAMES[$i]}"; done
    printf '  %6ss  %s\n' "$T_TOTAL" "total"
    echo "-- sizes"
    for b in "${BINARIES[@]}"; do printf '  %6s  %s\n' "$(du -h "$BIN/$b" | cut -f1)" "$b"; done
    echo "-- versions"
    for b in "${BINARIES[@]}"; do
        echo "  $b:"; version_of "$b" | sed 's/^/    /'; echo
    done
} | tee "$DEST/summary.txt"
echo "$BIN"
