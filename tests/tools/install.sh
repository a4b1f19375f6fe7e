#!/bin/sh
# The system tools the tests need, from Debian's packages: installs the missing ones (one
# `apt-get update` first), says nothing when all are there. `make test` runs it before pytest.
# Without root or apt-get it lists what is missing and the tests that need it skip, with the
# reason shown; in CI (CI=true) a missing tool is an error here, and its tests' skips fail.
set -eu

# command  package  (one line each; a package may provide several commands)
TOOLS="
chromium      chromium
prometheus    prometheus
promtool      prometheus
wrk           wrk
faketime      faketime
redis-server  redis-server
openssl       openssl
cc            gcc
valgrind      valgrind
callgrind_control valgrind
"

missing=""
packages=""
for pair in $(echo "$TOOLS" | awk 'NF == 2 {print $1 ":" $2}'); do
    command=${pair%%:*}
    package=${pair#*:}
    if ! command -v "$command" >/dev/null 2>&1; then
        missing="$missing $command"
        case " $packages " in *" $package "*) ;; *) packages="$packages $package" ;; esac
    fi
done
# uwsgi builds from source against the venv's Python: it needs Python.h.
python=${PYTHON:-python3}
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
if [ -n "$include" ] && [ ! -f "$include/Python.h" ]; then
    missing="$missing Python.h"
    packages="$packages python3-dev"
fi

[ -z "$packages" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "==> test tools missing:$missing (as root: apt-get install$packages); their tests will skip" >&2
    [ "${CI:-}" = true ] && exit 1
    exit 0
fi
echo "==> test tools: apt-get install$packages (for$missing)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086 # one word per package
apt-get install -y -qq --no-install-recommends $packages >/dev/null
