#!/bin/sh
# Install the Debian packages Gallop needs, only those that are missing.
# Usage: scripts/deps.sh [extra-package ...]
set -e
PACKAGES="sbcl cl-hunchentoot cl-usocket cl-bordeaux-threads cl-plus-ssl cl-flexi-streams
          cl-chunga cl-fiveam cl-drakma cl-alexandria curl openssl libssl3 $*"
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "Installing:$missing"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
