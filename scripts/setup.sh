#!/usr/bin/env bash
# Install everything batchfs needs on Debian 12 (as root, or with sudo): the Debian packages
# for FUSE (and, with --test, the peers and tools the test suite uses), then a virtualenv at
# .venv with batchfs installed in it. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-run}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

pkgs=(fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv curl ca-certificates)
if [ "$mode" = "--test" ]; then
    # s3fs and rclone are the peers the S3 tests mount; groff and systemd check docs and units
    pkgs+=(s3fs rclone groff-base systemd)
fi
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PY" -m venv .venv
fi
extras="parquet"
[ "$mode" = "--test" ] && extras="parquet,test"
stamp=".venv/.batchfs-installed-$extras-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -e "$stamp" ]; then
    echo "setup: installing batchfs[$extras] into .venv"
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e ".[$extras]"
    if [ "$mode" = "--test" ]; then
        # This exact version is a CPU build that is available locally; any other spec pulls GBs.
        .venv/bin/pip install -q "torch==2.13.0" || echo "setup: torch unavailable; torch tests will be skipped"
    fi
    rm -f .venv/.batchfs-installed-*
    touch "$stamp"
fi
# The man pages, beside the venv's bin: with the venv active (or .venv/bin on PATH), `man batchfs`,
# `man batchfs-server` and `man batchfs-manifest` find them (man-db looks in ../share/man of
# each PATH directory). Links: they follow the checkout.
for page in man/*.[158]; do
    sec=${page##*.}
    mkdir -p ".venv/share/man/man$sec"
    ln -sf "$PWD/$page" ".venv/share/man/man$sec/"
done
