#!/usr/bin/env bash
# Headless Chromium for the lookup page's browser tests (tests/test_compat_page.py) and its benchmark
# (bench/bench_compat_page.py): Debian's `chromium` and `chromium-driver`, driven by selenium (a
# requirement of the project's virtual environment). Installs only what is missing; nothing else is
# downloaded, and the tests never fetch a browser at run time.
#   bash tools/install_browser.sh
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)

if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: ${missing[*]} missing and no apt-get here: install Chromium and its chromedriver" \
             "(same version) so that \`chromium\` and \`chromedriver\` are on PATH" >&2
        exit 2
    fi
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
    echo "== installing ${missing[*]} (Debian packages)"
    "${sudo[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# Debian's wrapper script prints a harmless shell warning on some hosts; only the version line matters.
echo "== $(chromium --version 2>/dev/null | tail -1); $(chromedriver --version | head -1)"
