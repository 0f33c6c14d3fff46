#!/usr/bin/env bash
# Install Debian's slurm-wlm (slurmctld, slurmd, client tools) and munge when they are missing.
# Exit status: 0 installed or already there; 3 apt could not install them (no network, not root, no apt).
set -uo pipefail

if command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v sbatch > /dev/null \
   && command -v munged > /dev/null; then
  exit 0
fi
if ! command -v apt-get > /dev/null || (( EUID != 0 )); then
  echo "install_slurm.sh: slurm-wlm/munge missing and apt-get unavailable (or not root)" >&2
  exit 3
fi
echo "install_slurm.sh: installing slurm-wlm and munge with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the packages' postinst must not start daemons (we run our own, without systemd)
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
rc=0
timeout 90 apt-get update -qq > /tmp/install_slurm.log 2>&1 \
  && timeout 180 apt-get install -y -qq --no-install-recommends slurm-wlm munge >> /tmp/install_slurm.log 2>&1 \
  || rc=$?
(( created_policy )) && rm -f "$policy"
if (( rc != 0 )); then
  echo "install_slurm.sh: apt-get failed (rc $rc); last lines of /tmp/install_slurm.log:" >&2
  tail -n 5 /tmp/install_slurm.log >&2
  exit 3
fi
# the packages may have started a system munged/slurm despite policy-rc.d on some images; we never rely on them
exit 0
