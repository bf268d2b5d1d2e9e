#!/bin/bash
# One device call's plan runner: `bash bench/gpu/plans/run.sh NAME` after `source bench/gpu/setup.sh`
# runs bench/gpu/plans/NAME.plan line by line (each line: SECONDS COMMAND..., run under `timeout`,
# split by the shell's words: the plans are ours, in the repo), writes each line's exit status and
# wall time to rcs.txt, the machine's facts to host.txt and gpu.txt, all in /root/runs/NAME
# (exported as R: plans name their output paths under it), and tars that folder to $OUT/NAME.tgz
# after every line (the device returns 8 files at most, and a call cut off by its limit still
# returns what $OUT holds). A line's failure does not stop the next.
set -u
name=${1:?plan name}
plan=bench/gpu/plans/$name.plan
[ -f "$plan" ] || { echo "no $plan" >&2; exit 2; }
export R=/root/runs/$name
mkdir -p "$R"
{ git rev-parse HEAD; git status --short; } > "$R/commit.txt" 2>&1
{ uname -r; grep -H . /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled
  grep -E ' (/|/run|/run/snapguard|/run/snapguard-spill|/dev/shm|/var/tmp) ' /proc/mounts; nproc; free -g; } > "$R/host.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
while read -r secs cmd; do
  case "$secs" in ''|'#'*) continue;; esac
  t0=$(date +%s)
  log=$R/$(echo "$cmd" | md5sum | cut -c1-8).log
  timeout -k 10 "$secs" bash -c "$cmd" < /dev/null > "$log" 2>&1
  rc=$?
  echo "rc=$rc $(( $(date +%s) - t0 ))s $cmd" | tee -a "$R/rcs.txt"
  tail -3 "$log"
  grep -E '^(thp_file|thp_fault)' /proc/vmstat > "$R/vmstat-thp.txt"
  tar -C /root/runs -czf "$OUT/$name.tgz.new" "$name" && mv "$OUT/$name.tgz.new" "$OUT/$name.tgz"
done < "$plan"
