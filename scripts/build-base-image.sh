#!/usr/bin/env bash
# Build a local Debian bookworm base image for machines that cannot pull from a registry.
#
# Usage:
#   scripts/build-base-image.sh            # build reprotrain-base:bookworm unless it exists
#   scripts/build-base-image.sh --force    # rebuild it
#
# Then build the images on top of it:
#   export REPROTRAIN_BASE_IMAGE=reprotrain-base:bookworm REPROTRAIN_BUILD_FLAGS="--network host"
#   dvc repro      # or anything that calls reprotrain.containers.ensure_image
#
# Real users never need this: Dockerfile.cpu and Dockerfile.cuda default to the official
# python:3.11-slim-bookworm image. This script exists for CI machines that reach PyPI and a
# Debian mirror but no container registry. It needs root, mmdebstrap (or debootstrap) and a
# running Docker engine.
#
# mmdebstrap is preferred: it fetches the packages with apt in parallel and installs them in a few
# dpkg calls, about twice as fast as debootstrap's one wget and one dpkg call per package (on a
# 2-core CI machine: ~40 s against ~65 s). Both make the same minbase system. dpkg's
# force-unsafe-io skips the fsync after each file: a crash mid-build only means building again.
#
# Why the host's CA bundle is copied in: on such machines HTTPS often goes through a
# proxy whose CA the host trusts; pip inside the build must trust it too. The bundle lives in
# this local base only; the Dockerfiles never add it, so no image built from the official base
# carries it.
set -euo pipefail

IMAGE="${REPROTRAIN_LOCAL_BASE_TAG:-reprotrain-base:bookworm}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
force=0

for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h | --help)
            awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
            exit 0
            ;;
        *)
            echo "build-base-image: unknown argument '$arg' (allowed: --force, --help)" >&2
            exit 2
            ;;
    esac
done

say() { echo "build-base-image: $*" >&2; }

for tool in docker tar; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        say "'$tool' not found (install it: apt-get install docker.io mmdebstrap)"
        exit 1
    fi
done
if command -v mmdebstrap >/dev/null 2>&1; then
    bootstrap=mmdebstrap
elif command -v debootstrap >/dev/null 2>&1; then
    bootstrap=debootstrap
else
    say "neither mmdebstrap nor debootstrap found (install one: apt-get install mmdebstrap)"
    exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
    say "$bootstrap needs root (run with sudo)"
    exit 1
fi
if ! docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
    say "the Docker engine does not answer (start it: dockerd &, or systemctl start docker)"
    exit 1
fi

if [ "$force" -eq 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    say "$IMAGE already exists, skipping (use --force to rebuild)"
    exit 0
fi

rootfs="$(mktemp -d /tmp/reprotrain-base.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT

# python3-venv brings ensurepip's pip wheel: the images make their own venv, so no system pip.
packages=python3,python3-venv,ca-certificates
say "$bootstrap $SUITE (minbase + $packages) into $rootfs from $MIRROR"
start=$(date +%s)
if [ "$bootstrap" = mmdebstrap ]; then
    # merged-usr hook: /bin -> usr/bin with usr-is-merged, as debootstrap does, instead of the
    # usrmerge package (and the perl it pulls in).
    mmdebstrap --variant=minbase --include="$packages" --format=directory \
        --dpkgopt=force-unsafe-io --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        "$SUITE" "$rootfs" "$MIRROR" >&2
    rm -f "$rootfs/etc/dpkg/dpkg.cfg.d/99mmdebstrap" # the build's dpkg option, not the image's
else
    # In two stages, so that dpkg in the second one runs with force-unsafe-io.
    debootstrap --variant=minbase --include="$packages" --foreign "$SUITE" "$rootfs" "$MIRROR" >&2
    echo force-unsafe-io >"$rootfs/etc/dpkg/dpkg.cfg.d/reprotrain-build-unsafe-io"
    chroot "$rootfs" /debootstrap/debootstrap --second-stage >&2
    rm -f "$rootfs/etc/dpkg/dpkg.cfg.d/reprotrain-build-unsafe-io"
fi

if [ -f "$HOST_CA_BUNDLE" ]; then
    say "copying the host's CA bundle into the base (trusts this machine's HTTPS proxy)"
    cp "$HOST_CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
# pip (system and venv) reads /etc/pip.conf: point it at the bundle above, not certifi's copy.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"

# Shrink the image: package lists and caches are not needed at run time.
rm -rf "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/"*.bin "$rootfs/var/cache/apt/archives/"*.deb

say "importing $rootfs as $IMAGE"
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$IMAGE" >/dev/null

say "done in $(($(date +%s) - start)) s: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE")"
