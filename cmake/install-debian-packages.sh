#!/usr/bin/env bash
# bash cmake/install-debian-packages.sh PACKAGE...
#
# Installs those of the Debian packages that are not installed yet, as root or through sudo;
# does nothing (no apt-get update) when all are there. Used by examples/run-demo.sh and
# tests/run-tests.sh.
set -euo pipefail

if ! command -v dpkg >/dev/null 2>&1; then
  echo "recattn: no dpkg (not Debian): install by hand: $*" >&2
  exit 0
fi

missing=()
for pkg in "$@"; do
  if ! dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$pkg")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "recattn: missing packages (${missing[*]}); run as root or install sudo" >&2
    exit 1
  fi
  sudo=(sudo)
fi
echo "recattn: installing ${missing[*]}"
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
