#!/bin/sh
# Usage: run.sh BUILD REQUEST_DIR RESPONSE_DIR — builds BUILD on first use (a fresh clone has no
# binaries) with gfortran or $FC, then runs it. The binaries go to a cache folder outside the
# source tree, one per version of the source: $PRECISION_LAB_FORTRAN_BUILD, else
# ${XDG_CACHE_HOME:-$HOME/.cache}/precision-lab/fortran-<checksum of cnn.F90 and Makefile>.
# Build messages go to stderr.
set -e
here=$(cd "$(dirname "$0")" && pwd)
build=$1
shift
fc=${FC:-gfortran}
if ! command -v "$fc" >/dev/null 2>&1; then
  echo "examples/fortran: no Fortran compiler: '$fc' not found; install gfortran (e.g. apt-get install gfortran, or make system-deps) or set FC to your compiler" >&2
  exit 127
fi
checksum=$(cat "$here/cnn.F90" "$here/Makefile" | cksum | cut -d ' ' -f 1)
out=${PRECISION_LAB_FORTRAN_BUILD:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/precision-lab/fortran-$checksum}
mkdir -p "$out"
make -s -C "$here" FC="$fc" BUILD="$out" "$out/$build" >&2
exec "$out/$build" "$@"
