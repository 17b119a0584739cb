#!/usr/bin/env bash
# Run a command beside two CPU-bound processes at normal priority, one per core of a 2-core
# machine, as a student's laptop or a shared CI runner is busy; stop them afterwards, whatever
# the command did. Prints the load average before and after, and the command's exit status.
#   scripts/busy.sh make test             # the whole suite under load
#   BUSY=4 scripts/busy.sh make test-notebooks
set -u
n=${BUSY:-2}
pids=()
for _ in $(seq "$n"); do
    python3 -c 'while True: pass' &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null' EXIT INT TERM
echo "busy.sh: $n CPU-bound processes (${pids[*]}); load average $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s)
"$@"
rc=$?
echo "busy.sh: exit $rc after $(( $(date +%s) - start )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit $rc
