#!/bin/sh
# Usage: run.sh BUILD REQUEST_DIR RESPONSE_DIR — builds examples/fortran/build/BUILD on first use
# (a fresh clone has no binaries), then runs it. Build messages go to stderr.
set -e
here=$(cd "$(dirname "$0")" && pwd)
build=$1
shift
make -s -C "$here" "build/$build" >&2
exec "$here/build/$build" "$@"
