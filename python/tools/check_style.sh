#!/usr/bin/env bash
# The project's style checks (HOUSE_STYLE.md "Tooling"), all of them, from the checkout:
#
#   bash python/tools/check_style.sh          # check: exit 1 and the offending files if any
#   bash python/tools/check_style.sh --fix    # rewrite the files instead
#
# Python: ruff lint and ruff format (ruff.toml). C++ and CUDA: clang-format (.clang-format,
# Google style) over cc/ and cuda/. Both tools come from .venv (configure.sh installs the
# pinned versions), so every machine formats alike. tests/test_style.py runs the check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bin=.venv/bin
fix=0
[ "${1:-}" = "--fix" ] && fix=1
python_dirs=(tf_ttemb tests python)
mapfile -t cpp_files < <(git ls-files 'cc/*.cc' 'cc/*.h' 'cuda/*.cu' 'cuda/*.cuh' 'cuda/*.h' \
  'python/gpu_harness/*.cu' 'python/gpu_harness/*.cuh' 'python/gpu_harness/*.h' 2>/dev/null)
for tool in ruff clang-format; do
  if [ ! -x "$bin/$tool" ]; then
    echo "check_style: $bin/$tool not found; bash configure.sh installs the pinned tools" >&2
    exit 3
  fi
done
status=0
if [ $fix = 1 ]; then
  "$bin/ruff" check --fix -q "${python_dirs[@]}" || status=1
  "$bin/ruff" format -q "${python_dirs[@]}"
  [ ${#cpp_files[@]} -eq 0 ] || "$bin/clang-format" -i "${cpp_files[@]}"
else
  "$bin/ruff" check -q "${python_dirs[@]}" || { echo "ruff check: see above"; status=1; }
  "$bin/ruff" format --check -q "${python_dirs[@]}" || {
    echo "ruff format: these files would change:"; "$bin/ruff" format --check "${python_dirs[@]}" | head -20
    status=1
  }
  if [ ${#cpp_files[@]} -gt 0 ]; then
    "$bin/clang-format" --dry-run -Werror "${cpp_files[@]}" 2>/tmp/clang_format_check.$$ || {
      echo "clang-format: these files would change:"
      grep -oE '^[^: ]+\.(cc|h|cu|cuh):' /tmp/clang_format_check.$$ | sort -u | head -20
      status=1
    }
    rm -f /tmp/clang_format_check.$$
  fi
fi
exit $status
