#!/usr/bin/env bash
# Time Run All of each notebook in a fresh kernel that starts its own cluster, one notebook at
# a time, as the README's table does; prints the table's row. Beside other work:
#   scripts/busy.sh scripts/time-notebooks.sh
#   scripts/time-notebooks.sh notebooks/14_*.ipynb notebooks/15_*.ipynb
# KEEP=dir keeps the executed notebooks there (COURSE_LIB_SLIDE_TEXT=1 then shows, as an error
# under the cell, each figure whose text a room cannot read on a slide).
set -u
cd "$(dirname "$0")/.."
if [ -n "${KEEP:-}" ]; then
    out=$KEEP; mkdir -p "$out"
else
    out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
fi
[ $# -gt 0 ] || set -- notebooks/[0-9][0-9]_*.ipynb
head="| notebook |"; rule="|---|"; row="| Run All (s) |"
for nb in "$@"; do
    start=$(date +%s.%N)
    # nbconvert, its waits for a cell's reply in short polls (course_lib.runtime.kernel_replies)
    if .venv/bin/python -m course_lib.runtime.kernel_replies --to notebook --execute \
            --ExecutePreprocessor.timeout=600 \
            --output-dir "$out" "$nb" >"$out/log" 2>&1; then
        took=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1])))" \
               "$start" "$(date +%s.%N)")
    else
        took="failed"; tail -5 "$out/log" >&2
    fi
    n=$(basename "$nb" | cut -c1-2)
    echo "$n: $took s" >&2
    head="$head $n |"; rule="$rule---|"; row="$row $took |"
done
printf '%s\n%s\n%s\n' "$head" "$rule" "$row"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores, $(date +%F)"
