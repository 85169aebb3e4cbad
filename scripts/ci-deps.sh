#!/usr/bin/env bash
# System packages the test suite needs beyond the venv (idempotent; safe to run on every CI start).
#   g++:   the native kernel tests (engine/kernels/native_*, torch.compile's inductor) compile C++.
#   nginx: tests/deploy/test_nginx.py runs deploy/nginx.conf in front of a local cluster.
# Without root or without network this prints why it did not install them and exits 0: the tests
# that need a missing tool then skip naming it, or fail naming it under PDSERVE_REQUIRE_RESOURCES=1
# (.ci/run sets it), so CI never goes green with a resource missing.
set -uo pipefail

have_nginx() { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; }
have_cxx() { command -v "${CXX:-g++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || command -v c++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1; }

missing=()
have_cxx && echo "ci-deps: C++ compiler present" || missing+=(g++)
have_nginx && echo "ci-deps: nginx present ($( (nginx -v 2>&1 || /usr/sbin/nginx -v 2>&1) | head -n1))" \
    || missing+=(nginx)
[ ${#missing[@]} -eq 0 ] && exit 0

consequence="the tests that need ${missing[*]} will skip, or fail under PDSERVE_REQUIRE_RESOURCES=1"
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ci-deps: no apt-get here; not installing ${missing[*]} ($consequence)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ci-deps: not root and no passwordless sudo; not installing ${missing[*]} ($consequence)"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq; then
    echo "ci-deps: apt-get update failed (no network?); not installing ${missing[*]} ($consequence)"
    exit 0
fi
# nginx-light would do, but Debian's plain package is the one the deploy docs name.
if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    echo "ci-deps: apt-get install ${missing[*]} failed ($consequence)"
    exit 0
fi
# Debian's package starts a system nginx on :80 where an init system runs; the tests start their own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet nginx 2>/dev/null; then
    $SUDO systemctl stop nginx || true
fi
echo "ci-deps: installed ${missing[*]}"
