#!/usr/bin/env bash
# Install PicoMQ into .venv and serve it on the local-disk default: ./serve.sh [gunicorn args]
# Listens on 127.0.0.1:4437 (PICOMQ_BIND to change) and stores streams in ./data
# (PICOMQ_STORAGE_URL to change); every PICOMQ_* setting is listed in README.md.
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
echo "PicoMQ: http://${PICOMQ_BIND:-127.0.0.1:4437}/v1/stream/<path>  (data: ${PICOMQ_STORAGE_URL:-./data})"
exec .venv/bin/gunicorn -c gunicorn.conf.py wsgi:app "$@"
