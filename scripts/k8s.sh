#!/usr/bin/env bash
# A real single-node Kubernetes cluster on this machine, without Docker or a registry.
#
#   scripts/k8s.sh build       build (once) the Kubernetes binaries, the pause image and the
#                              timerwheel image into the cache
#   scripts/k8s.sh up          build what is missing, start etcd, containerd, the control plane,
#                              kubelet and kube-proxy; wait for /readyz, node Ready and the default
#                              ServiceAccount. Idempotent: a healthy running cluster is left alone
#   scripts/k8s.sh load-image [spark]
#                              build (if the sources changed) and import timerwheel:dev (with
#                              spark: timerwheel-spark:dev) into the cluster's containerd
#   scripts/k8s.sh down        stop everything by recorded pid, remove pods' mounts, network
#                              namespaces, the bridge and the iptables chains, restore ip_forward,
#                              delete the cluster state
#   scripts/k8s.sh trust-registry HOST:PORT
#                              let the node's containerd pull from a plain-HTTP registry at HOST:PORT
#                              (scripts/registry.sh): a hosts.toml under containerd's registry
#                              config_path, read at each pull; a containerd started without that
#                              path (an older cluster) is restarted first, its pods running on
#   scripts/k8s.sh restart-component containerd|kubelet
#                              stop the component (TERM, KILL after a few seconds) and start it
#                              again, as a node's crash-and-restart does; the pods run on
#   scripts/k8s.sh status      exit 0 when the API server answers and the node is Ready
#   scripts/k8s.sh env         print KUBECONFIG=..., TW_KUBECTL=..., TW_K8S_HOST_IP=...
#   scripts/k8s.sh kubectl ... run the cached kubectl against the cluster
#
# What is built and from where (all pinned, see the versions below):
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl v1.34.4:
#     Go module proxy, through a wrapper module this script generates (k8s.io/kubernetes cannot be
#     built as a dependency without replacing its staging modules by their published v0.34.4)
#   pause: gcc -static of build/pause/linux/pause.c from the kubernetes module download
#   etcd, containerd, runc, CNI plugins, umoci, skopeo, debootstrap: Debian packages (apt-get)
#   timerwheel:dev: scripts/image.sh (debootstrap + the project's wheel, packed with umoci/skopeo)
# No CoreDNS: the stages reach Kafka and Redis by IP and the operator reaches the API server
# through the `kubernetes` Service's ClusterIP (kube-proxy), so nothing resolves names.
#
# Build outputs live in $TW_CACHE_DIR (default ~/.cache/timerwheel), keyed on the versions, and
# are written to temp names and renamed, so an interrupted build never leaves a half-filled cache.
# Cluster state (etcd data, PKI, kubeconfigs, logs, pids, containerd root) lives in .run/k8s/ of
# this checkout; sockets and containerd's state in /run/tw-k8s-<hash of the checkout>/.
#
# Environment: TW_CACHE_DIR, TW_K8S_START_TIMEOUT (s, default 120), TW_K8S_GO (default
# /usr/local/go/bin/go, else go on PATH), TW_K8S_NICE (default 10: builds share the machine).
set -euo pipefail

NAME=k8s
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KUBE_VERSION=1.34.4
STAGING_VERSION=0.${KUBE_VERSION#1.}
PAUSE_VERSION=3.10
# Bump when the build steps below change in a way that changes the binaries.
RECIPE=1
CACHE="${TW_CACHE_DIR:-$HOME/.cache/timerwheel}"
KCACHE="$CACHE/k8s/v$KUBE_VERSION-r$RECIPE"
BIN="$KCACHE/bin"
GO="${TW_K8S_GO:-}"
NICE="${TW_K8S_NICE:-10}"
START_TIMEOUT="${TW_K8S_START_TIMEOUT:-120}"
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
DEBS=(etcd-server etcd-client containerd runc containernetworking-plugins iptables conntrack
    umoci skopeo debootstrap openssl gcc libc6-dev)

find_go() {
    [[ -n "$GO" ]] && { [[ -x "$GO" ]] || die "TW_K8S_GO=$GO is not an executable"; return 0; }
    if [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
    elif command -v go >/dev/null; then GO="$(command -v go)"
    else die "missing Go (>= 1.24): install it at /usr/local/go or set TW_K8S_GO"; fi
}

need_debs() {
    local missing=() p
    for p in "${DEBS[@]}"; do
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "missing Debian packages ${missing[*]}: install them (apt-get install ${missing[*]})"
    apt_install "${missing[@]}" || die "could not install ${missing[*]} with apt-get"
}

go_env() {
    export GOMODCACHE="$CACHE/go/mod" GOCACHE="$CACHE/go/build" GOFLAGS=-buildvcs=false GOTOOLCHAIN=local
}

# The wrapper module: requires k8s.io/kubernetes and replaces each staging module (k8s.io/api,
# client-go, ...) with its published v0.X.Y. Made in a temp dir and renamed.
make_wrapper() {
    local w="$KCACHE/kwrap" tmp gomod m
    [[ -f "$w/.complete" ]] && return 0
    tmp="$w.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    log "downloading k8s.io/kubernetes v$KUBE_VERSION from the Go module proxy"
    gomod="$(cd "$tmp" && "$GO" mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" \
        | "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); print(d.get("GoMod") or ""); sys.exit(1 if d.get("Error") else 0)')" \
        || die "the Go module proxy did not serve k8s.io/kubernetes@v$KUBE_VERSION (GOPROXY=$("$GO" env GOPROXY))"
    {
        printf 'module timerwheel.local/kwrap\n\ngo 1.24.0\n\nrequire k8s.io/kubernetes v%s\n\nreplace (\n' "$KUBE_VERSION"
        # sample-cli-plugin / sample-controller are not served by the proxy and nothing needs them
        grep -oE '^\s*k8s.io/\S+ => ./staging' "$gomod" | awk '{print $1}' | grep -v sample- |
            while read -r m; do printf '\t%s => %s v%s\n' "$m" "$m" "$STAGING_VERSION"; done
        printf ')\n'
    } >"$tmp/go.mod"
    {
        printf '//go:build tools\n\npackage kwrap\n\nimport (\n'
        for m in "${COMPONENTS[@]}"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$m"; done
        printf ')\n'
    } >"$tmp/tools.go"
    (cd "$tmp" && nice -n "$NICE" "$GO" mod tidy) >"$tmp.log" 2>&1 \
        || { tail -20 "$tmp.log" >&2; die "go mod tidy of the kubernetes wrapper failed (log above)"; }
    rm -f "$tmp.log"
    touch "$tmp/.complete"
    rm -rf "$w"
    mv "$tmp" "$w"
}

build_binaries() {
    local missing=() c ld p out minor
    # what interrupted builds left (we hold the build lock: no other build runs)
    rm -rf "$KCACHE"/*.tmp.*
    for c in "${COMPONENTS[@]}"; do [[ -x "$BIN/$c" ]] || missing+=("$c"); done
    [[ -x "$BIN/pause" ]] || missing+=(pause)
    ((${#missing[@]} == 0)) && return 0
    find_go
    go_env
    make_wrapper
    mkdir -p "$BIN"
    minor="$(echo "$KUBE_VERSION" | cut -d. -f2)"
    # Version stamps, else the server reports v0.0.0-master and charts' kubeVersion checks fail.
    ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld="$ld -X $p.gitVersion=v$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
        ld="$ld -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    out="$KCACHE/bin.tmp.$$"
    rm -rf "$out"
    mkdir -p "$out"
    for c in "${missing[@]}"; do
        [[ "$c" == pause ]] && continue
        log "building $c v$KUBE_VERSION (cold: ~10-25 min for the first, minutes for the rest)"
        local t0=$SECONDS
        (cd "$KCACHE/kwrap" && nice -n "$NICE" "$GO" build -trimpath -ldflags "$ld" -o "$out/$c" "k8s.io/kubernetes/cmd/$c") \
            >"$out/$c.log" 2>&1 || { tail -30 "$out/$c.log" >&2; rm -rf "$out"; die "go build of $c failed (log above)"; }
        mv "$out/$c" "$BIN/$c"
        log "built $c in $((SECONDS - t0))s"
    done
    if [[ ! -x "$BIN/pause" ]]; then
        local src="$GOMODCACHE/k8s.io/kubernetes@v$KUBE_VERSION/build/pause/linux/pause.c"
        [[ -f "$src" ]] || die "no $src in the module cache"
        gcc -Os -static -DVERSION="$PAUSE_VERSION" -o "$out/pause" "$src" 2>"$out/pause.log" \
            || { cat "$out/pause.log" >&2; rm -rf "$out"; die "gcc -static of pause.c failed (is libc6-dev installed?)"; }
        mv "$out/pause" "$BIN/pause"
    fi
    rm -rf "$out"
}

# Everything up and load-image need. The image (mostly downloads: debootstrap, pip) builds in the
# background while Go compiles, so a cold start pays for the longer of the two only.
IMAGE_PID=""
build_all() {
    need_debs
    mkdir -p "$CACHE"
    local img_log="$CACHE/image-build.log"
    nice -n "$NICE" "$PYTHON_HOST" "$ROOT/scripts/image.py" build --tag "$IMAGE" >"$img_log.out" 2>"$img_log" &
    IMAGE_PID=$!
    trap '[[ -n "$IMAGE_PID" ]] && kill -TERM "$IMAGE_PID" 2>/dev/null; true' EXIT
    build_binaries
    if ! wait "$IMAGE_PID"; then
        IMAGE_PID=""
        tail -n 30 "$img_log" >&2
        die "building the $IMAGE image failed (scripts/image.py build; log $img_log)"
    fi
    IMAGE_PID=""
}

cmd_build() {
    build_all
}

# --- the cluster ----------------------------------------------------------------------------------

IMAGE=timerwheel:dev
SPARK_IMAGE=timerwheel-spark:dev
PYTHON_HOST=python3 # image.py and the helpers need only the standard library
# the node's name: the host name as a DNS label (lower case, [a-z0-9-])
NODE="$(hostname | tr '[:upper:]' '[:lower:]' | tr -c 'a-z0-9.\n-' '-' | cut -c1-63)"
# The runtime directory (sockets, containerd state, CNI IPAM): short and per checkout.
RUNDIR="/run/tw-k8s-$(echo -n "$ROOT" | sha256sum | cut -c1-8)"
SOCK="$RUNDIR/containerd.sock"
PKI="$STATE/pki"
KUBECONFIG_FILE="$STATE/admin.kubeconfig"
BRIDGE=twk8s0
POD_CIDR=10.217.0.0/16
SERVICE_CIDR=10.96.0.0/12
# etcd, apiserver, kubelet, controller-manager, scheduler, kube-proxy ports: one cluster a machine
PORTS=(2379 2380 6443 10250 10248 10257 10259 10249 10256)

# The machine's own address that pods reach through the bridge's gateway (and kubelet's node IP):
# the source address of the default route, else the first global address. Never an outside one.
host_ip() {
    local ip
    ip="$(ip -4 -o route get 1.1.1.1 2>/dev/null | grep -oE 'src [0-9.]+' | cut -d' ' -f2)" || true
    [[ -n "$ip" ]] || ip="$(ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1)"
    [[ -n "$ip" ]] || die "no global IPv4 address on this machine for the node (ip -4 addr shows none)"
    echo "$ip"
}

kubectl_() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

# pid recorded for component $1 while it runs and its command line still names $2
comp_pid() {
    local f="$STATE/pids/$1.pid" pid
    [[ -f "$f" ]] || return 1
    pid="$(cat "$f")"
    [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
    echo "$pid"
}

# start component $1 (log and pid under .run/k8s), command in the rest
launch() {
    local name="$1"
    shift
    mkdir -p "$STATE/logs" "$STATE/pids"
    setsid nohup "$@" >>"$STATE/logs/$name.log" 2>&1 </dev/null 8>&- 9>&- &
    local pid=$! i
    echo "$pid" >"$STATE/pids/$name.pid"
    # The child runs this script, then setsid, then nohup, then the command, all under one pid;
    # during each exec its command line reads as empty for a moment. A check while nohup is
    # exec'ing the command took the component for exited twice in CI (kube-proxy, with an empty
    # log): wait until argv[0] is the command itself (no exec is left), or the child is gone.
    for ((i = 0; i < 600; i++)); do
        [[ -r "/proc/$pid/cmdline" ]] || return 0
        [[ "$({ tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1; } 2>/dev/null)" == "$1" ]] && return 0
        sleep 0.05
    done
}

# Whether the launched component $1 has ended (its pid gone or a zombie); then ENDED says how:
# "exit status N" or "killed by signal N" when it is this shell's child. A component that still
# runs has not ended, whatever its command line reads for a moment.
ENDED=""
comp_ended() {
    local pid state status
    pid="$(cat "$STATE/pids/$1.pid" 2>/dev/null)" || { ENDED="no pid recorded"; return 0; }
    state="$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)"
    [[ -n "$state" && "$state" != Z ]] && return 1
    wait "$pid" 2>/dev/null
    status=$?
    if ((status == 127)); then ENDED="ended"
    elif ((status > 128)); then ENDED="killed by signal $((status - 128))"
    else ENDED="exit status $status"; fi
    return 0
}

# wait until "$2..." succeeds; $1 names what we wait for; fail naming the component's log
wait_for() {
    local what="$1" comp="$2" pattern="$3" deadline=$((SECONDS + START_TIMEOUT))
    shift 3
    until "$@" >/dev/null 2>&1; do
        if ! comp_pid "$comp" "$pattern" >/dev/null && comp_ended "$comp"; then
            tail -n 25 "$STATE/logs/$comp.log" >&2 2>/dev/null || true
            die "$comp exited before $what ($ENDED; log: ${STATE#"$ROOT"/}/logs/$comp.log)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 25 "$STATE/logs/$comp.log" >&2 2>/dev/null || true
            die "no $what within ${START_TIMEOUT}s (log: ${STATE#"$ROOT"/}/logs/$comp.log)"
        fi
        sleep 0.5
    done
}

make_pki() {
    local ip="$1"
    [[ -f "$PKI/.complete" && "$(cat "$PKI/ip" 2>/dev/null)" == "$ip" ]] && return 0
    rm -rf "$PKI"
    mkdir -p "$PKI"
    (
        cd "$PKI"
        openssl genrsa -out ca.key 2048
        openssl req -x509 -new -key ca.key -subj /CN=timerwheel-k8s-ca -days 3650 -out ca.crt
        openssl genrsa -out sa.key 2048
        openssl rsa -in sa.key -pubout -out sa.pub
        mk() { # name CN O [SANs]
            openssl genrsa -out "$1.key" 2048
            openssl req -new -key "$1.key" -subj "/CN=$2${3:+/O=$3}" -out "$1.csr"
            {
                echo "basicConstraints=CA:FALSE"
                echo "keyUsage=digitalSignature,keyEncipherment"
                echo "extendedKeyUsage=serverAuth,clientAuth"
                [[ -n "${4:-}" ]] && echo "subjectAltName=$4"
            } >"$1.ext"
            openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
                -extfile "$1.ext" -out "$1.crt"
        }
        mk apiserver kube-apiserver "" "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,DNS:$NODE,IP:127.0.0.1,IP:10.96.0.1,IP:$ip"
        mk apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
        mk admin admin system:masters
        mk controller-manager system:kube-controller-manager ""
        mk scheduler system:kube-scheduler ""
        mk kube-proxy system:kube-proxy ""
        mk kubelet "system:node:$NODE" system:nodes "DNS:$NODE,DNS:localhost,IP:127.0.0.1,IP:$ip"
    ) >"$STATE/logs/pki.log" 2>&1 || { tail -5 "$STATE/logs/pki.log" >&2; die "openssl could not make the certificates"; }
    local c
    for c in admin controller-manager scheduler kube-proxy kubelet; do
        cat >"$STATE/$c.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: timerwheel
  cluster: {server: "https://127.0.0.1:6443", certificate-authority: "$PKI/ca.crt"}
users:
- name: $c
  user: {client-certificate: "$PKI/$c.crt", client-key: "$PKI/$c.key"}
contexts:
- name: timerwheel
  context: {cluster: timerwheel, user: $c, namespace: default}
current-context: timerwheel
EOF
    done
    echo "$ip" >"$PKI/ip"
    touch "$PKI/.complete"
}

start_etcd() {
    comp_pid etcd "$STATE/etcd-data" >/dev/null && return 0
    launch etcd /usr/bin/etcd --name tw --data-dir "$STATE/etcd-data" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster tw=http://127.0.0.1:2380 --quota-backend-bytes 2147483648 \
        --listen-metrics-urls ""
    wait_for "etcd health" etcd "$STATE/etcd-data" env ETCDCTL_API=3 etcdctl --endpoints http://127.0.0.1:2379 endpoint health
}

start_containerd() {
    comp_pid containerd "$STATE/containerd/config.toml" >/dev/null && return 0
    mkdir -p "$RUNDIR" "$STATE/containerd" "$STATE/cni"
    cat >"$STATE/containerd/config.toml" <<EOF
version = 2
root = "$STATE/containerd/root"
state = "$RUNDIR/containerd-state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[debug]
  address = "$RUNDIR/containerd-debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "timerwheel.local/pause:$PAUSE_VERSION"
  # Root here may lack CAP_SYS_RESOURCE: runc then cannot lower the pause container's
  # oom_score_adj (-998) and fails "can't get final child's PID from pipe: EOF". Clamp instead.
  restrict_oom_score_adj = true
  # (the plugin's own keys before its sub-tables: a key after a [table] header belongs to that table)
  # per-registry settings (trust-registry writes HOST:PORT/hosts.toml there), read at each pull
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$STATE/containerd/certs.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
EOF
    cat >"$STATE/cni/10-timerwheel.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "timerwheel",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$RUNDIR/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
EOF
    launch containerd /usr/bin/containerd --config "$STATE/containerd/config.toml"
    wait_for "containerd on $SOCK" containerd "$STATE/containerd/config.toml" ctr -a "$SOCK" version
}

# The pause image: the static pause binary as the whole root file system.
import_pause() {
    local tar="$KCACHE/pause-$PAUSE_VERSION.tar" work oci
    ctr -a "$SOCK" -n k8s.io images ls -q | grep -qx "timerwheel.local/pause:$PAUSE_VERSION" && return 0
    if [[ ! -f "$tar" ]]; then
        work="$(mktemp -d "$KCACHE/pause.tmp.XXXXXX")"
        oci="$work/oci"
        {
            umoci init --layout "$oci" &&
                umoci new --image "$oci:pause" &&
                umoci unpack --image "$oci:pause" "$work/bundle" &&
                cp "$BIN/pause" "$work/bundle/rootfs/pause" &&
                umoci repack --image "$oci:pause" "$work/bundle" &&
                umoci config --image "$oci:pause" --config.entrypoint /pause --config.user 65535:65535 &&
                skopeo copy --quiet "oci:$oci:pause" "docker-archive:$work/pause.tar:timerwheel.local/pause:$PAUSE_VERSION" &&
                mv "$work/pause.tar" "$tar"
        } >"$STATE/logs/pause-image.log" 2>&1 || {
            tail -5 "$STATE/logs/pause-image.log" >&2
            rm -rf "$work"
            die "packing the pause image with umoci/skopeo failed"
        }
        rm -rf "$work"
    fi
    ctr -a "$SOCK" -n k8s.io images import "$tar" >/dev/null || die "ctr could not import $tar"
}

start_control_plane() {
    local ip="$1"
    if ! comp_pid kube-apiserver "$PKI/apiserver.crt" >/dev/null; then
        launch kube-apiserver "$BIN/kube-apiserver" \
            --etcd-servers=http://127.0.0.1:2379 \
            --advertise-address="$ip" --bind-address=0.0.0.0 --secure-port=6443 \
            --service-cluster-ip-range=$SERVICE_CIDR \
            --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
            --client-ca-file="$PKI/ca.crt" \
            --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
            --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
            --kubelet-certificate-authority="$PKI/ca.crt" \
            --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
            --service-account-issuer=https://kubernetes.default.svc.cluster.local \
            --authorization-mode=Node,RBAC --allow-privileged=true \
            --enable-admission-plugins=NodeRestriction
    fi
    wait_for "API server /readyz" kube-apiserver "$PKI/apiserver.crt" kubectl_ get --raw /readyz
    comp_pid kube-controller-manager "$STATE/controller-manager.kubeconfig" >/dev/null ||
        launch kube-controller-manager "$BIN/kube-controller-manager" \
            --kubeconfig="$STATE/controller-manager.kubeconfig" \
            --authentication-kubeconfig="$STATE/controller-manager.kubeconfig" \
            --authorization-kubeconfig="$STATE/controller-manager.kubeconfig" \
            --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
            --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
            --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
            --service-cluster-ip-range=$SERVICE_CIDR --controllers='*,-nodeipam'
    comp_pid kube-scheduler "$STATE/scheduler.kubeconfig" >/dev/null ||
        launch kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$STATE/scheduler.kubeconfig" \
            --authentication-kubeconfig="$STATE/scheduler.kubeconfig" \
            --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
            --bind-address=127.0.0.1 --leader-elect=false
}

node_ready() {
    [[ "$(kubectl_ get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

start_kubelet() {
    local ip="$1"
    mkdir -p "$STATE/kubelet" "$STATE/pod-logs" "$STATE/manifests"
    cat >"$STATE/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failCgroupV1: false   # this machine has cgroup v1; 1.35 would refuse it
failSwapOn: false
containerRuntimeEndpoint: "unix://$SOCK"
tlsCertFile: "$PKI/kubelet.crt"
tlsPrivateKeyFile: "$PKI/kubelet.key"
podCIDR: $POD_CIDR
clusterDomain: cluster.local
podLogsDir: "$STATE/pod-logs"
staticPodPath: "$STATE/manifests"
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%", nodefs.inodesFree: "2%"}
serializeImagePulls: false
oomScoreAdj: 0   # root here may lack CAP_SYS_RESOURCE: cannot go below 0
EOF
    comp_pid kubelet "$STATE/kubelet-config.yaml" >/dev/null ||
        launch kubelet "$BIN/kubelet" --config="$STATE/kubelet-config.yaml" \
            --kubeconfig="$STATE/kubelet.kubeconfig" --root-dir="$STATE/kubelet" \
            --hostname-override="$NODE" --node-ip="$ip" --v=1
    wait_for "node $NODE Ready" kubelet "$STATE/kubelet-config.yaml" node_ready
}

start_kube_proxy() {
    cat >"$STATE/kube-proxy-config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$STATE/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: $POD_CIDR
hostnameOverride: $NODE
oomScoreAdj: 0               # root here may lack CAP_SYS_RESOURCE
conntrack: {maxPerCore: 0}   # leave nf_conntrack_max alone
EOF
    comp_pid kube-proxy "$STATE/kube-proxy-config.yaml" >/dev/null ||
        launch kube-proxy "$BIN/kube-proxy" --config="$STATE/kube-proxy-config.yaml"
    # the kubernetes Service's ClusterIP answers once kube-proxy wrote its rules
    wait_for "kube-proxy rules for the kubernetes Service" kube-proxy "$STATE/kube-proxy-config.yaml" kubernetes_service_routed
}

kubernetes_service_routed() { iptables -t nat -S KUBE-SERVICES 2>/dev/null | grep -q -- '-d 10.96.0.1/32 .*--dport 443'; }

healthy() {
    [[ -x "$BIN/kubectl" && -f "$KUBECONFIG_FILE" ]] || return 1
    local c
    for c in etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
        [[ -f "$STATE/pids/$c.pid" ]] && kill -0 "$(cat "$STATE/pids/$c.pid")" 2>/dev/null || return 1
    done
    kubectl_ get --raw /readyz >/dev/null 2>&1 && node_ready
}

check_ports() {
    local p pid
    for p in "${PORTS[@]}"; do
        pid="$(ss -Hltnp "sport = :$p" 2>/dev/null | grep -oE 'pid=[0-9]+' | head -1 | cut -d= -f2)" || true
        [[ -z "$pid" ]] && continue
        die "port $p is taken by pid $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160)): another Kubernetes cluster (or etcd) runs on this machine; one at a time: stop it first"
    done
}

cmd_up() {
    local t0=$SECONDS ip
    if healthy; then
        write_env
        return 0
    fi
    if [[ -d "$STATE/pids" ]]; then
        log "a cluster of this checkout is half up: taking it down first"
        cmd_down
    fi
    build_all
    check_ports
    ip="$(host_ip)"
    mkdir -p "$STATE/logs" "$STATE/pids" "$RUNDIR"
    # what the bridge CNI changes and down puts back
    [[ -f "$STATE/ip_forward.orig" ]] || sysctl -n net.ipv4.ip_forward >"$STATE/ip_forward.orig"
    make_pki "$ip"
    start_etcd
    start_containerd
    import_pause
    start_control_plane "$ip"
    start_kubelet "$ip"
    start_kube_proxy
    wait_for "default ServiceAccount" kube-controller-manager "$STATE/controller-manager.kubeconfig" \
        kubectl_ get serviceaccount default -n default
    write_env
    log "cluster up in $((SECONDS - t0))s: node $NODE ($ip), Kubernetes v$KUBE_VERSION; $(head -1 "$ENV_FILE")"
}

write_env() {
    {
        echo "KUBECONFIG=$KUBECONFIG_FILE"
        echo "TW_KUBECTL=$BIN/kubectl"
        echo "TW_K8S_HOST_IP=$(cat "$PKI/ip")"
        echo "TW_K8S_IMAGE=$IMAGE"
    } >"$ENV_FILE"
}

# Stop $1 (recorded pid, command line still naming $2): TERM, then KILL after ${3:-15} s.
stop_comp() {
    local pid i
    pid="$(comp_pid "$1" "$2")" || { rm -f "$STATE/pids/$1.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < ${3:-15} * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$STATE/pids/$1.pid"
}

# A network namespace is ours when its eth0's host-side veth is attached to our bridge.
our_netns() {
    local n="$1" peer
    peer="$(ip -n "$n" -o link show eth0 2>/dev/null | sed -n 's/.*eth0@if\([0-9]*\).*/\1/p')"
    [[ -n "$peer" ]] && ip -o link show 2>/dev/null | grep -E "^$peer: " | grep -q "master $BRIDGE "
}

cmd_down() {
    local t0=$SECONDS c s m n ipt t
    # nothing of ours to stop or undo (chains or bridges of another cluster are not ours)
    [[ -d "$STATE" || -d "$RUNDIR" ]] || { rm -f "$ENV_FILE"; return 0; }
    # 1) pods first, while kubelet runs: it stops them through CRI and CNI (veths, IPs, rules)
    if [[ -x "$BIN/kubectl" && -f "$KUBECONFIG_FILE" ]] && kubectl_ get --raw /readyz >/dev/null 2>&1; then
        kubectl_ delete deploy,sts,ds,rs,job,pod --all -A --grace-period=1 --wait=false >/dev/null 2>&1 || true
        for ((c = 0; c < 60; c++)); do
            [[ -z "$(kubectl_ get pods -A -o name 2>/dev/null)" ]] && break
            sleep 1
        done
    fi
    # all at once: each takes a second or two to shut down gracefully
    for c in kube-proxy kubelet kube-scheduler kube-controller-manager kube-apiserver; do
        stop_comp "$c" "$STATE/" &
    done
    wait
    # 2) what is left of the containers: tasks through our containerd, then its shims (they carry
    #    our socket's path on their command line), then containerd and etcd
    if [[ -S "$SOCK" ]]; then
        for t in $(ctr -a "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$SOCK" -n k8s.io tasks kill -s KILL "$t" >/dev/null 2>&1 || true; done
        sleep 1
        for t in $(ctr -a "$SOCK" -n k8s.io tasks ls -q 2>/dev/null); do ctr -a "$SOCK" -n k8s.io tasks delete -f "$t" >/dev/null 2>&1 || true; done
    fi
    # its containers are gone; containerd 1.6 can sit on a TERM for long (CRI shutdown)
    stop_comp containerd "$STATE/containerd/config.toml" 3
    for s in /proc/[0-9]*; do
        if [[ -r "$s/cmdline" ]] && tr '\0' ' ' <"$s/cmdline" 2>/dev/null | grep -q "^/usr/bin/containerd-shim-runc-v2 .*-address $SOCK "; then
            kill -KILL "${s#/proc/}" 2>/dev/null || true
        fi
    done
    stop_comp etcd "$STATE/etcd-data"
    # 3) mounts under our state and runtime dirs, our pods' network namespaces, the bridge
    for ((c = 0; c < 3; c++)); do
        awk '{print $2}' /proc/mounts | { grep -E "^($STATE|$RUNDIR)/" || true; } | sort -r |
            while read -r m; do umount -l "$m" 2>/dev/null || true; done
    done
    for n in /run/netns/cni-*; do
        [[ -e "$n" ]] || continue
        our_netns "$(basename "$n")" && ip netns delete "$(basename "$n")" 2>/dev/null
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
    # 4) iptables: the CNI-* chains of the bridge/portmap plugins and kubelet's / kube-proxy's KUBE-*
    for ipt in iptables ip6tables; do
        command -v "$ipt" >/dev/null || continue
        for t in filter nat mangle; do
            { "$ipt" -t "$t" -S 2>/dev/null || true; } | { grep -E '^-A [A-Z]+ .*-j (CNI|KUBE)-' || true; } |
                { grep -vE '^-A (CNI|KUBE)-' || true; } | sed 's/^-A/-D/' |
                while read -r r; do eval "$ipt -t $t $r" 2>/dev/null || true; done
            for c in $("$ipt" -t "$t" -S 2>/dev/null | awk '/^-N (CNI|KUBE)-/{print $2}'); do "$ipt" -t "$t" -F "$c" 2>/dev/null || true; done
            for c in $("$ipt" -t "$t" -S 2>/dev/null | awk '/^-N (CNI|KUBE)-/{print $2}'); do "$ipt" -t "$t" -X "$c" 2>/dev/null || true; done
        done
    done
    [[ -f "$STATE/ip_forward.orig" ]] && sysctl -qw "net.ipv4.ip_forward=$(cat "$STATE/ip_forward.orig")"
    # 5) the QoS cgroups kubelet made (empty once the pods are gone)
    { find /sys/fs/cgroup/*/kubepods -depth -type d 2>/dev/null || true; } | while read -r d; do rmdir "$d" 2>/dev/null || true; done
    # 6) the state; never through a mount point left behind
    if awk '{print $2}' /proc/mounts | grep -qE "^($STATE|$RUNDIR)/"; then
        die "mounts are left under $STATE or $RUNDIR ($(awk '{print $2}' /proc/mounts | grep -E "^($STATE|$RUNDIR)/" | head -1)): not deleting the state"
    fi
    rm -rf --one-file-system "$STATE" "$RUNDIR" "$ENV_FILE"
    log "cluster down in $((SECONDS - t0))s"
}

cmd_load_image() {
    # no argument: the stage image; "spark": the Spark jobs' image (services/spark/Dockerfile)
    local which="${1:-}" archive t0=$SECONDS image="$IMAGE" marker="$STATE/image-loaded"
    local build=("$PYTHON_HOST" "$ROOT/scripts/image.py" build)
    case "$which" in
    "") ;;
    spark)
        image=$SPARK_IMAGE marker="$STATE/image-loaded-spark"
        build+=(--dockerfile "$ROOT/services/spark/Dockerfile")
        ;;
    *) die "load-image: unknown image '$which' (none for $IMAGE, or spark for $SPARK_IMAGE)" ;;
    esac
    healthy || die "no cluster running: run 'scripts/k8s.sh up' first"
    need_debs
    archive="$("${build[@]}" --tag "$image")" || die "building the $image image failed (message above)"
    # the archive's name is keyed on its content: the same one is imported once per cluster
    if [[ "$(cat "$marker" 2>/dev/null)" == "$archive" ]] &&
        ctr -a "$SOCK" -n k8s.io images ls -q | grep -qx "docker.io/library/$image"; then
        log "$image is loaded and up to date"
        return 0
    fi
    ctr -a "$SOCK" -n k8s.io images import "$archive" >/dev/null || die "ctr could not import $archive"
    echo "$archive" >"$marker"
    log "$image loaded in $((SECONDS - t0))s (pods use image: $image, imagePullPolicy: Never)"
}

# Stop containerd or the kubelet and start it again (the chaos e2e): the pods' containers run on
# meanwhile (their shims do not need containerd), as on a node whose runtime or kubelet restarts.
cmd_restart_component() {
    local comp="$1" t0=$SECONDS
    healthy || die "no healthy cluster of this checkout to restart $comp in: run 'scripts/k8s.sh up'"
    case "$comp" in
    containerd)
        stop_comp containerd "$STATE/containerd/config.toml" 3
        start_containerd
        ;;
    kubelet)
        stop_comp kubelet "$STATE/kubelet-config.yaml"
        start_kubelet "$(cat "$PKI/ip")"
        ;;
    esac
    log "$comp restarted in $((SECONDS - t0))s"
}

# A plain-HTTP registry at $1 (HOST:PORT) for the node's containerd. containerd reads the hosts
# directory at each pull, so only a containerd started before config_path existed is restarted.
cmd_trust_registry() {
    local registry="$1" dir
    healthy || die "no healthy cluster of this checkout: run 'scripts/k8s.sh up'"
    dir="$STATE/containerd/certs.d/$registry"
    mkdir -p "$dir"
    printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
        "$registry" "$registry" >"$dir/hosts.toml.tmp"
    mv "$dir/hosts.toml.tmp" "$dir/hosts.toml"
    if ! grep -qF "config_path = \"$STATE/containerd/certs.d\"" "$STATE/containerd/config.toml"; then
        log "containerd runs without a registry config_path: restarting it (the pods run on)"
        stop_comp containerd "$STATE/containerd/config.toml" 3
        start_containerd
    fi
    log "containerd pulls from http://$registry"
}

main() {
    local verb="${1:-}"
    mkdir -p "$RUN"
    case "$verb" in
    env)
        [[ -f "$ENV_FILE" ]] || die "no cluster started: run 'scripts/k8s.sh up'"
        cat "$ENV_FILE"
        return 0
        ;;
    status)
        healthy && { echo "running: node $NODE Ready, Kubernetes v$KUBE_VERSION"; return 0; }
        echo "not running"
        return 1
        ;;
    kubectl)
        shift
        [[ -x "$BIN/kubectl" ]] || die "no kubectl built yet: run 'scripts/k8s.sh build' or 'up'"
        exec "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"
        ;;
    up | down | build | load-image) ;;
    restart-component)
        [[ "${2:-}" == containerd || "${2:-}" == kubelet ]] ||
            die "usage: scripts/k8s.sh restart-component containerd|kubelet"
        ;;
    trust-registry)
        [[ "${2:-}" =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || die "usage: scripts/k8s.sh trust-registry HOST:PORT"
        ;;
    *) die "usage: scripts/k8s.sh up|down|status|env|build|load-image|restart-component|trust-registry|kubectl ..." ;;
    esac
    [[ $(id -u) == 0 ]] || die "scripts/k8s.sh $verb needs root (containerd, kubelet, iptables, chroot)"
    mkdir -p "$CACHE"
    # builds share the cache with other checkouts (down builds nothing)
    if [[ "$verb" != down && "$verb" != restart-component && "$verb" != trust-registry ]]; then
        exec 8>"$CACHE/k8s-build.lock"
        flock 8
    fi
    # the cluster of this checkout: one up / down / load-image at a time (build does not touch it)
    if [[ "$verb" != build ]]; then
        exec 9>"$RUN/k8s.lock"
        flock 9
    fi
    case "$verb" in
    build) cmd_build ;;
    up) cmd_up ;;
    down) cmd_down ;;
    load-image) cmd_load_image "${2:-}" ;;
    restart-component) cmd_restart_component "$2" ;;
    trust-registry) cmd_trust_registry "$2" ;;
    esac
}

main "$@"
