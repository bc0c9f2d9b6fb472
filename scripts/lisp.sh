#!/bin/sh
# Run SBCL with ASDF finding this checkout's systems and Debian's cl-* packages.
# Usage: scripts/lisp.sh --eval FORM ...
cd "$(dirname "$0")/.." || exit 1
exec sbcl --noinform --non-interactive --no-userinit \
  --eval '(require :asdf)' \
  --eval '(push (uiop:getcwd) asdf:*central-registry*)' \
  --eval '(setf *compile-verbose* nil *compile-print* nil)' \
  "$@"
