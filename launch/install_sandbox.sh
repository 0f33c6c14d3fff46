#!/usr/bin/env bash
# bubblewrap, the sandbox code_runner runs model-written code in (scaletrain/agent/tools/sandbox.py): installed with
# apt-get when it is missing and this runs as root; otherwise says how. Never fails the install: code_runner then
# refuses to run model code, naming why and the key that forces it.
set -u
command -v bwrap > /dev/null && exit 0
if ! command -v apt-get > /dev/null || (( EUID != 0 )); then
  echo "install_sandbox.sh: bubblewrap (bwrap) is missing and cannot be installed here (needs root and apt-get);" \
       "code_runner refuses to run model code until it is: apt-get install bubblewrap" >&2
  exit 0
fi
echo "install_sandbox.sh: installing bubblewrap (code_runner's sandbox) with apt-get ..." >&2
log=$(mktemp)
export DEBIAN_FRONTEND=noninteractive
install() { timeout 180 apt-get install -y -qq --no-install-recommends bubblewrap >> "$log" 2>&1; }
# the package lists of a fresh image may be missing or stale: refresh them only when the first try fails
if ! install && ! { timeout 120 apt-get update -qq >> "$log" 2>&1 && install; }; then
  echo "install_sandbox.sh: apt-get could not install bubblewrap; last lines of $log:" >&2
  tail -n 5 "$log" >&2
fi
exit 0
