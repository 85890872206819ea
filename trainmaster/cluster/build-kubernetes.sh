#!/usr/bin/env bash
# Build the Kubernetes server binaries `trainmaster cluster up` runs, once, into a cache outside
# the repository: Debian's source package `kubernetes` (the whole upstream tree with vendor/),
# compiled with Debian's Go; the pause image compiled from the same tree. Reused when the stamp
# says the build completed. Prints progress; says plainly why it could not.
#
#   build-kubernetes.sh [--cache DIR]     (default /var/cache/trainmaster)
#
# Exit 0: built or already there. Exit 3: cannot build here (reason printed). Else: build failed.
set -uo pipefail

# The whole script is one function, read before it runs: bash reads a script as it goes, so an
# edit of this file (a checkout) during the ~8 minute build would otherwise break the run.
main() {
CACHE_ROOT=${TM_K8S_CACHE:-/var/cache/trainmaster}
if [ "${1:-}" = "--cache" ]; then CACHE_ROOT=$2; fi
TOOLCHAIN="golang-go etcd-server containerd runc containernetworking-plugins busybox-static rsync gcc libc6-dev make golang-github-modern-go-reflect2-dev"
# the build's revision: a cache built by an earlier revision of this script is built again
REVISION=2
REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kube-controller-manager cmd/kubelet"
PROGRAMS="kube-apiserver kube-scheduler kube-controller-manager kubelet"
# kubectl too, unless one is on PATH already (any client from 1.19 to 1.33 speaks to this server)
if ! command -v kubectl >/dev/null 2>&1; then WHAT="$WHAT cmd/kubectl"; PROGRAMS="$PROGRAMS kubectl"; fi
APT="apt-get -o DPkg::Lock::Timeout=600"
DEB_SRC_FILE=/etc/apt/sources.list.d/trainmaster-deb-src.sources

say() { echo "k8s-deps: $*"; }
cannot() { say "cannot build Kubernetes here: $*"; say "the tests that need a cluster will skip"; exit 3; }

[ "$(id -u)" = 0 ] || cannot "not root (apt-get install and the build cache under $CACHE_ROOT need root)"
command -v apt-get >/dev/null || cannot "no apt-get (the build uses Debian's source package 'kubernetes')"

mkdir -p "$CACHE_ROOT" || cannot "cannot create $CACHE_ROOT"
exec 9>"$CACHE_ROOT/kubernetes-build.lock"
if ! flock -n 9; then
    say "another build holds $CACHE_ROOT/kubernetes-build.lock; waiting for it (up to 30 min)"
    flock -w 1800 9 || cannot "the other build did not finish within 30 minutes"
fi

# 1. Debian toolchain packages (binary packages; no registry ships the server binaries)
missing=$(for p in $TOOLCHAIN; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done | tr '\n' ' ')
if [ -n "${missing// /}" ]; then
    say "installing Debian packages: $missing"
    $APT install -y -q $missing >/dev/null 2>&1 || { $APT update -q >/dev/null 2>&1 && $APT install -y -q $missing >/dev/null 2>&1; } \
        || cannot "apt-get could not install: $missing"
fi

# 2. The source package's version decides the cache folder
ensure_deb_src() {
    if apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version:'; then return 0; fi
    if [ ! -f "$DEB_SRC_FILE" ]; then
        src=$(grep -l '^Types:.*deb' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
        if [ -n "$src" ] && grep -q 'deb.debian.org/debian$' "$src"; then
            say "adding a deb-src entry ($DEB_SRC_FILE, a copy of $src's Debian entries)"
            sed 's/^Types: deb$/Types: deb-src/' "$src" >"$DEB_SRC_FILE"
        elif grep -qs '^deb http' /etc/apt/sources.list; then
            say "adding deb-src lines ($DEB_SRC_FILE, copies of /etc/apt/sources.list)"
            grep '^deb http' /etc/apt/sources.list | sed 's/^deb /deb-src /' >"${DEB_SRC_FILE%.sources}.list"
        else
            return 1
        fi
    fi
    say "apt-get update (for the source index)"
    $APT update -q >/dev/null 2>&1
    apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version:'
}
ensure_deb_src || cannot "no deb-src entry for Debian's 'kubernetes' source package (apt-cache showsrc kubernetes finds nothing)"
DEB_VERSION=$(apt-cache showsrc kubernetes | sed -n 's/^Version: //p' | sort -V | tail -1)
UPSTREAM=${DEB_VERSION%%-*}; UPSTREAM=${UPSTREAM#*:}; UPSTREAM=${UPSTREAM##*+really}  # 1.20.5+really1.20.2: the tree is 1.20.2
OUT="$CACHE_ROOT/kubernetes-$UPSTREAM"
STAMP="$OUT/.built-r$REVISION"
if [ -f "$STAMP" ]; then
    say "Kubernetes $UPSTREAM already built in $OUT (stamp $(cat "$STAMP"))"
    exit 0
fi

# 3. Sources
WORK="$CACHE_ROOT/kubernetes-$UPSTREAM.build"
mkdir -p "$WORK/src"
cd "$WORK/src" || exit 1
if ! ls kubernetes_*.orig.tar.* >/dev/null 2>&1; then
    say "downloading the source package kubernetes $DEB_VERSION (apt-get source --download-only, ~34 MB)"
    $APT source --download-only -q kubernetes >/dev/null 2>&1 || cannot "apt-get source --download-only kubernetes failed"
fi
TREE="$WORK/tree"
if [ ! -f "$TREE/build/pause/linux/pause.c" ]; then
    say "unpacking $(ls kubernetes_*.orig.tar.*)"
    rm -rf "$TREE" && mkdir -p "$TREE"
    tar -xf kubernetes_*.orig.tar.* -C "$TREE" --strip-components=1 || { say "unpacking failed"; exit 1; }
fi

# The tree vendors github.com/modern-go/reflect2 v1.0.1, whose map iteration faults under Go >= 1.18
# (the apiserver dies encoding a custom resource: "unexpected fault address"); Debian's 1.0.2 fixes it
if [ -d "$REFLECT2" ]; then
    say "vendor: github.com/modern-go/reflect2 v1.0.1 replaced by Debian's $(dpkg-query -W -f='${Version}' golang-github-modern-go-reflect2-dev) (v1.0.1 crashes under Go 1.19)"
    rm -rf "$TREE/vendor/github.com/modern-go/reflect2"
    cp -r "$REFLECT2" "$TREE/vendor/github.com/modern-go/reflect2"
else
    cannot "Debian's golang-github-modern-go-reflect2-dev is missing ($REFLECT2): the apiserver would crash under Go 1.19"
fi

# 4. The pause container (the pod sandbox), from the tree's own source
mkdir -p "$OUT/bin"
say "compiling pause from build/pause/linux/pause.c (gcc -static)"
gcc -Os -static -o "$OUT/bin/pause" "$TREE/build/pause/linux/pause.c" || { say "gcc failed on pause.c"; exit 1; }

# 5. The server binaries, at the lowest CPU and IO priority
mkdir -p "$TREE/.go/src/k8s.io"
ln -sfn "$TREE" "$TREE/.go/src/k8s.io/kubernetes"
say "building $WHAT with $(go version | cut -d' ' -f3) (about 8 minutes on 2 cores; log $WORK/build.log)"
start=$(date +%s)
(
    cd "$TREE/.go/src/k8s.io/kubernetes" &&
    export GOPATH="$TREE/.go" GOCACHE="$WORK/gocache" CGO_ENABLED=0 &&
    exec nice -n 19 ionice -c 3 make WHAT="$WHAT"
) >"$WORK/build.log" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
    sleep 30
    kill -0 $pid 2>/dev/null && say "  still building ($(( $(date +%s) - start )) s; $(tail -1 "$WORK/build.log" | cut -c1-100))"
done
wait $pid; rc=$?
if [ $rc != 0 ]; then
    say "the build failed (exit $rc); the last lines of $WORK/build.log:"; tail -20 "$WORK/build.log" | sed 's/^/    /'
    exit 1
fi
for b in $PROGRAMS; do
    f=$(ls "$TREE"/_output/local/bin/linux/*/$b 2>/dev/null | head -1)
    [ -x "$f" ] || { say "the build did not produce $b"; exit 1; }
    cp "$f" "$OUT/bin/$b"
done
echo "$DEB_VERSION built $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s" >"$STAMP"
say "built Kubernetes $UPSTREAM into $OUT/bin in $(( $(date +%s) - start )) s; removing the build tree"
rm -rf "$WORK"
exit 0
}

main "$@"
