#!/usr/bin/env bash
# The whole test suite under each torch release autoplan supports, each in a fresh virtual
# environment, one release at a time; writes benchmarks/results/torch_matrix.md.
#
#   tools/torch_matrix.sh [RELEASE ...]
#
# A RELEASE is a series ("2.11": its newest patch release on the index) or an exact version
# ("2.13.0"); by default 2.11, 2.13.0 (the one CI runs) and 2.15. The table keeps its rows
# for releases not named, so they can be run one at a time. Environments are made under
# $TORCH_MATRIX_VENVS (default /work/venvs), one per version, replaced on every run; each has
# autoplan installed from this checkout (editable, with the test extra), so it tests this code.
# Releases other than 2.13.0 come from the index as CUDA builds (several GB with their CUDA
# libraries); the suite runs on the CPU all the same.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venvs=${TORCH_MATRIX_VENVS:-/work/venvs}
table=benchmarks/results/torch_matrix.md
# pip's configuration on a machine may cap torch (a constraints file); the matrix installs
# exactly the release it names, so it reads no configuration file
export PIP_CONFIG_FILE=/dev/null
unset PYTHONPATH # the suite imports autoplan as installed in the environment under test

newest() { # newest version of series $1 on the index
    pip index versions torch 2>/dev/null |
        sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' |
        grep -E "^${1//./\\.}\.[0-9]+$" | head -1
}

releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(2.11 2.13.0 2.15)
rows=()
for release in "${releases[@]}"; do
    version=$release
    [[ $release =~ ^[0-9]+\.[0-9]+$ ]] && version=$(newest "$release")
    [ -n "$version" ] || { echo "no torch $release on the index" >&2; exit 1; }
    env=$venvs/torch-$version
    log=$env.log
    echo "== torch $version: $env (log $log)"
    rm -rf "$env"
    python3 -m venv "$env"
    "$env/bin/python" -m pip install -q --upgrade pip
    "$env/bin/pip" install -q "torch==$version"
    "$env/bin/pip" install -q -e "$root[test]"
    installed=$("$env/bin/python" -c 'import torch; print(torch.__version__)')
    start=$(date +%s)
    status=0
    "$env/bin/python" -m pytest -p no:cacheprovider >"$log" 2>&1 || status=$?
    seconds=$(($(date +%s) - start))
    summary=$(tail -1 "$log") # pytest's closing line: "2 failed, 450 passed, 1 skipped in ..."
    count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0; }
    echo "   $summary (exit $status)"
    rows+=("| $installed | $(count passed) | $(count failed) | $(count error) | $(count skipped) | $((seconds / 60)) min $((seconds % 60)) s | $(date -u +%Y-%m-%d) |")
done

# rows of releases not run this time stay, so that releases can be run one by one
if [ -f "$table" ]; then
    while IFS= read -r row; do
        ran=no
        for new in "${rows[@]}"; do [ "${new%% | *}" = "${row%% | *}" ] && ran=yes; done
        [ $ran = yes ] || rows+=("$row")
    done < <(grep -E '^\| [0-9]' "$table")
fi
mapfile -t rows < <(printf '%s\n' "${rows[@]}" | sort -t'|' -k2,2V)
{
    echo "# The test suite under each supported torch release"
    echo
    echo "\`tools/torch_matrix.sh\` ($(nproc) cores, $(python3 --version)): each release in a fresh"
    echo "virtual environment, \`python -m pytest\` over the whole suite. CI runs 2.13.0 alone."
    echo
    echo "| torch | passed | failed | errors | skipped | wall time | date |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    printf '%s\n' "${rows[@]}"
} >"$table"
cat "$table"
