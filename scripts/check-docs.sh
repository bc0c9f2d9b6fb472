#!/bin/sh
# The two front pages stay short: README.md within 300 lines (what Gallop is,
# install, quick starts, settings, migration, limits; details in doc/) and
# BENCHMARKS.md within 500 (the current tables and the method).
cd "$(dirname "$0")/.." || exit 1
status=0
check() {
  lines=$(wc -l < "$1")
  if [ "$lines" -gt "$2" ]; then
    echo "check-docs: $1 is $lines lines, over its $2" >&2
    status=1
  else
    echo "check-docs: $1 is $lines lines, within $2"
  fi
}
check README.md 300
check BENCHMARKS.md 500
exit $status
