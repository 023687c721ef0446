#!/bin/bash
# Open a bench leaderboard.html in headless Chromium (Debian: apt-get install chromium) and save a full-page
# screenshot, to check that the self-contained page renders without a network.
#
#   benchmarks/screenshot_leaderboard.sh bench/fd-mnist/leaderboard.html leaderboard.png [width height]
set -euo pipefail
PAGE=$(realpath "${1:?leaderboard.html}")
OUT=$(realpath -m "${2:-leaderboard.png}")
WIDTH=${3:-1500}
HEIGHT=${4:-2400}
BROWSER=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$BROWSER" ]; then
    echo "error: no Chromium found; install it (Debian/Ubuntu: apt-get install chromium)" >&2
    exit 2
fi
# --no-sandbox: containers often run as root; the page is a local file with no scripts.
"$BROWSER" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size="$WIDTH,$HEIGHT" \
    --screenshot="$OUT" "file://$PAGE" 2>/dev/null
echo "screenshot: $OUT"
