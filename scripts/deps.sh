#!/bin/sh
# Install the Debian packages Gallop needs, only those that are missing.
# Usage: scripts/deps.sh [extra-package ...]
# Another apt-get or dpkg holding its lock (unattended upgrades, a second
# make) is waited for, up to LOCK_WAIT seconds, instead of failing at once.
set -e
PACKAGES="sbcl cl-hunchentoot cl-usocket cl-bordeaux-threads cl-plus-ssl cl-flexi-streams
          cl-chunga cl-fiveam cl-drakma cl-alexandria curl openssl libssl3 $*"
LOCK_WAIT=${LOCK_WAIT:-600}
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "Installing:$missing"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
APT="$SUDO apt-get -o DPkg::Lock::Timeout=$LOCK_WAIT"
# apt-get update takes the lists' lock, which DPkg::Lock::Timeout does not
# cover on every APT: while its error is the lock, wait and try again.
waited=0
until err=$($APT update -qq 2>&1 >/dev/null); do
  case "$err" in
    *"Could not get lock"*|*"Unable to lock"*)
      [ "$waited" -lt "$LOCK_WAIT" ] || { echo "$err" >&2; exit 1; }
      sleep 5; waited=$((waited + 5)) ;;
    *) echo "$err" >&2; exit 1 ;;
  esac
done
DEBIAN_FRONTEND=noninteractive $APT install -y -qq $missing >/dev/null
