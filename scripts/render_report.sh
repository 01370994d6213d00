#!/usr/bin/env bash
# Render an eval report in headless Chromium and write a full-page PNG, to check it displays.
# Needs the Debian package `chromium` (apt-get install -y chromium).
#   scripts/render_report.sh path/to/report.html [out.png]
set -euo pipefail
html=${1:?usage: scripts/render_report.sh REPORT.html [OUT.png]}
out=${2:-${html%.html}.png}
exec python -m dilforge_eval.render "$html" "$out"
