#!/usr/bin/env bash
# Print the path of a headless-capable Chromium, installing Debian's `chromium` (apt-get) if missing.
#
#   launchers/scripts/chromium_path.sh        # prints e.g. /usr/bin/chromium as its last line
#
# The tests that check pages in a real browser (the MLflow UI opening on dpsweep's runs, the
# self-contained report.html) use it, as mlflow_server_up.sh installs PostgreSQL. Installing needs
# root and Debian's package registry; a second run with Chromium present takes no time.
set -euo pipefail

log() { printf '[chromium_path] %s\n' "$*" >&2; }

for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null; then
        command -v "$name"
        exit 0
    fi
done
log "installing chromium (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium >&2
command -v chromium
