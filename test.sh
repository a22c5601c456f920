#!/usr/bin/env bash
# Lint and test PicoMQ: ./test.sh [pytest arguments], e.g. ./test.sh -m "not conformance".
# Creates .venv and installs the pinned dependencies first; the conformance suite also
# needs node and npm (installed here with apt-get when running as root on Debian).
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
    else
        echo "test.sh: node and npm not found; the conformance test will fail." >&2
        echo "test.sh: install Node.js 18 or newer with npm (Debian: sudo apt-get install nodejs npm)." >&2
    fi
fi

# The web inspector's test drives Debian's Chromium (through Node's playwright-core);
# the deploy test runs the shipped nginx site.
missing_packages=""
[ -x /usr/bin/chromium ] || missing_packages="chromium"
[ -x /usr/sbin/nginx ] || missing_packages="$missing_packages nginx"
if [ -n "$missing_packages" ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        apt-get update
        # shellcheck disable=SC2086 # one word per package
        DEBIAN_FRONTEND=noninteractive apt-get install -y $missing_packages
    else
        echo "test.sh: not installed:$missing_packages; the inspector or deploy test will fail." >&2
        echo "test.sh: install them (Debian: sudo apt-get install chromium nginx)." >&2
    fi
fi

.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
