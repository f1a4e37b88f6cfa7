#!/bin/sh
# Run nox from a tools venv of its own (.tools/venv: nox and uv), made on first use.
#
# Why not `python3 -m pip install nox uv`: on Debian 12 / Ubuntu 24.04 the system python3 is
# externally managed (PEP 668) and pip refuses to install into it; a fresh Ubuntu has neither
# pip nor the venv module. A venv is never externally managed, and where the venv module is
# missing this script installs it (python3-venv) when it runs as root with apt, or says how.
#
#   sh tools/nox.sh -s build-env      the main job: build and verify envspecs/default.yaml
#   sh tools/nox.sh -s tests          every test
set -eu
cd "$(dirname "$0")/.."
TOOLS=.tools/venv
PY="${PYTHON:-python3}"

say() { printf 'tools/nox.sh: %s\n' "$*" >&2; }

# A box with uv alone (no usable python3, or one without its venv module): uv makes the venv,
# finding a Python 3.10+ or fetching one where it may.
if ! "$TOOLS/bin/python" -c 'import nox, uv' >/dev/null 2>&1 && command -v uv >/dev/null 2>&1; then
    rm -rf "$TOOLS"
    want="$PY"
    if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        want=">=3.10"
    fi
    if uv venv --quiet --python "$want" "$TOOLS" >/dev/null 2>&1 \
        && uv pip install --quiet --python "$TOOLS/bin/python" nox uv; then
        say "made $TOOLS with uv (nox and uv installed)"
    else
        rm -rf "$TOOLS"
    fi
fi

if ! "$TOOLS/bin/python" -c 'import nox, uv' >/dev/null 2>&1; then
    if ! command -v "$PY" >/dev/null 2>&1; then
        say "no $PY on PATH and no uv: install Python 3.10 or newer (Debian/Ubuntu: apt-get install python3) or uv"
        exit 1
    fi
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        say "$PY is $("$PY" -c 'import sys; print(sys.version.split()[0])'); nox here needs 3.10 or newer (set PYTHON=...)"
        exit 1
    fi
    rm -rf "$TOOLS"
    if ! "$PY" -m venv "$TOOLS" >/dev/null 2>&1; then
        rm -rf "$TOOLS"
        minor="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "$PY has no working venv module: installing python3-venv with apt-get"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$minor-venv" >/dev/null 2>&1 \
                || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            "$PY" -m venv "$TOOLS"
        else
            say "$PY cannot make a venv (its venv/ensurepip module is missing);"
            say "on Debian/Ubuntu: sudo apt-get install python$minor-venv, then run this again"
            exit 1
        fi
    fi
    say "installing nox and uv into $TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check nox uv
fi
exec "$TOOLS/bin/python" -m nox "$@"
