#!/usr/bin/env bash
# Builds the platform wheel dist/tf_ttemb-<version>-py3-none-linux_x86_64.whl.
#
#   bash build_wheel.sh
#   pip install dist/tf_ttemb-*.whl            # into any venv with the same TensorFlow
#   pip install 'dist/tf_ttemb-0.1.0-py3-none-linux_x86_64.whl[demo]'   # + matplotlib
#
# Steps (offline; nothing is downloaded beyond what configure.sh installs):
#   1. bash configure.sh: .venv, .bazelrc, the op library and tf_ttemb/_build_info.json
#      (incremental: seconds when nothing changed).
#   2. bazel build //:wheel, with --config=cuda exactly when the build info says the
#      library has CUDA kernels (so Bazel reuses configure.sh's library instead of
#      building another one); //:wheel runs python/tools/build_wheel.py.
#   3. The wheel is copied to dist/ and its path printed.
#
# The wheel requires tensorflow==<the version of .venv that it was built against>
# (TensorFlow keeps no C++ ABI across releases; `import tf_ttemb` also checks it), runs
# on CPUs with the vector extensions of this machine's build (see `python -m tf_ttemb
# info`), and works on any Python >= 3.10 that the pinned TensorFlow supports.
#
# Without Bazel, on the library configure.sh already built (what tests/test_wheel.py does):
#   python3 python/tools/build_wheel.py --out-dir dist
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
say() { printf 'build_wheel: %s\n' "$*"; }

bash configure.sh

CUDA="$(.venv/bin/python -c 'import json, sys
print(int(bool(json.load(open(sys.argv[1]))["cuda"])))' tf_ttemb/_build_info.json)"
BAZEL_ARGS=(build)
[ "$CUDA" = 1 ] && BAZEL_ARGS+=(--config=cuda)
BAZEL_ARGS+=(//:wheel)
say "bazel ${BAZEL_ARGS[*]}"
if ! bazel "${BAZEL_ARGS[@]}" >>.bazel-build.log 2>&1; then
  tail -n 30 .bazel-build.log >&2
  say "error: bazel build //:wheel failed; full log in .bazel-build.log" >&2
  exit 1
fi

mkdir -p dist
# The newest wheel under bazel-bin is this build's (older versions' may linger there).
built="$(ls -t bazel-bin/tf_ttemb-*.whl | head -n 1)"
dest="dist/$(basename "$built")"
cp -f "$built" "$dest.tmp"
chmod 0644 "$dest.tmp"
mv -f "$dest.tmp" "$dest"
say "wrote $dest ($(du -h "$dest" | cut -f1))"
