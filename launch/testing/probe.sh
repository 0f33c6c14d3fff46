#!/usr/bin/env bash
# Can this machine host the one-machine SLURM test cluster (launch/testing/slurm_cluster.sh)?
# Tries for real what the cluster needs: root, a network namespace (ip netns add/del of a throwaway one),
# UTS + mount + PID namespaces (unshare), and device nodes (mknod, for the fake GPUs).
# Prints "ok" or the reason on stdout; exit 0 when it can, 1 when it cannot.
set -uo pipefail

no() { echo "$*"; exit 1; }

(( EUID == 0 )) || no "not root (needs CAP_SYS_ADMIN and CAP_NET_ADMIN for namespaces)"
command -v ip > /dev/null || no "no \`ip\` (iproute2)"
command -v unshare > /dev/null || no "no \`unshare\` (util-linux)"
ns=stslurm-probe-$$
ip netns add "$ns" 2> /dev/null || no "\`ip netns add\` failed (no CAP_NET_ADMIN/CAP_SYS_ADMIN, e.g. an unprivileged container)"
ip netns del "$ns" 2> /dev/null
unshare --uts --mount --pid --fork --mount-proc true 2> /dev/null \
  || no "\`unshare --uts --mount --pid\` failed (no CAP_SYS_ADMIN, or namespaces disabled)"
dev=$(mktemp -u /tmp/stslurm-probe-dev.XXXXXX)
mknod "$dev" c 1 3 2> /dev/null || no "mknod failed (no CAP_MKNOD)"
rm -f "$dev"
echo ok
