#!/usr/bin/env bash
# System packages the test suite needs beyond the venv (idempotent; safe to run on every CI start).
#   nginx: tests/deploy/test_nginx.py runs deploy/nginx.conf in front of a local cluster.
# Without root or without network this prints why it skipped and exits 0: the tests that need a
# missing tool skip with a message saying so.
set -uo pipefail

have_nginx() { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; }

if have_nginx; then
    echo "ci-deps: nginx present ($( (nginx -v 2>&1 || /usr/sbin/nginx -v 2>&1) | head -n1))"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ci-deps: no apt-get here; skipping the nginx install (the nginx test will skip)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ci-deps: not root and no passwordless sudo; skipping the nginx install (the nginx test will skip)"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq; then
    echo "ci-deps: apt-get update failed (no network?); skipping the nginx install (the nginx test will skip)"
    exit 0
fi
# nginx-light would do, but Debian's plain package is the one the deploy docs name.
if ! $SUDO apt-get install -y -qq --no-install-recommends nginx >/dev/null; then
    echo "ci-deps: apt-get install nginx failed; the nginx test will skip"
    exit 0
fi
# Debian's package starts a system nginx on :80 where an init system runs; the tests start their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet nginx 2>/dev/null; then
    $SUDO systemctl stop nginx || true
fi
echo "ci-deps: installed $(/usr/sbin/nginx -v 2>&1 | head -n1)"
