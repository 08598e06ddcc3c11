#!/usr/bin/env bash
# Makes a stand-in for the official python:3.11-slim-bookworm image where Docker Hub cannot be reached: Debian
# bookworm (mmdebstrap minbase) with Debian's python3.11 and its headers, slimmed the way debian:bookworm-slim is, and
# a virtual environment at /usr/local so that python, python3 and pip are in /usr/local/bin and install into
# /usr/local/lib/python3.11/site-packages as in the official image. Needs root, mmdebstrap and a Docker engine.
# Usage: scripts/docker-base-image.sh [TAG]   (default local/python:3.11-slim-bookworm)
# An existing TAG is kept (a new import changes the base's ID and so voids the build cache); REBUILD=1 makes it again.
# MIRROR (default: this machine's Debian mirror) and ROOTFS (the bootstrapped folder, kept for REBUILD) override.
# mmdebstrap rather than debootstrap: apt downloads the packages in parallel and installs them in one run, from
# bookworm, bookworm-updates and bookworm-security at once (so no upgrade afterwards), without the documentation.
set -euo pipefail

tag=${1:-local/python:3.11-slim-bookworm}
rootfs=${ROOTFS:-/var/tmp/ringserve-base-rootfs}
mirror=${MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

if [ "${REBUILD:-0}" != 1 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag exists (REBUILD=1 makes it again)"
  exit 0
fi

# dpkg settings of the Debian images, in place before the first package is installed: no documentation, manuals or
# translations, no static libpython (the official image has none either), no fsync per file.
dpkg_cfg=$(mktemp)
trap 'rm -f "$dpkg_cfg"' EXIT
cat > "$dpkg_cfg" <<'CONF'
force-unsafe-io
path-exclude /usr/share/doc/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
path-include /usr/share/doc/*/copyright
path-include /usr/share/locale/locale.alias
path-exclude /usr/lib/python3.11/config-3.11-x86_64-linux-gnu/libpython3.11.a
CONF
if [ ! -x "$rootfs/usr/bin/python3" ]; then
  rm -rf "$rootfs"
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include=ca-certificates,netbase,tzdata,python3,python3-venv,python3.11-dev \
    --dpkgopt="$dpkg_cfg" --aptopt='Acquire::Languages "none"' \
    bookworm "$rootfs" "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb ${mirror%/debian}/debian-security bookworm-security main"
fi
rm -f "$dpkg_cfg"
trap - EXIT

# The apt settings of the Debian images (the dpkg ones came with mmdebstrap): no services started by package scripts,
# no apt caches kept.
printf '#!/bin/sh\nexit 101\n' > "$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true";'
cat > "$rootfs/etc/apt/apt.conf.d/docker-clean" <<CONF
DPkg::Post-Invoke { $clean };
APT::Update::Post-Invoke { $clean };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::GzipIndexes "true";
Apt::AutoRemove::SuggestsImportant "false";
CONF
find "$rootfs/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
find "$rootfs/usr/share/info" "$rootfs/usr/share/man" -mindepth 1 -not -type d -delete
find "$rootfs/usr/share/locale" -mindepth 1 -not -type d -not -name locale.alias -delete
rm -f "$rootfs/usr/lib/python3.11/config-3.11-x86_64-linux-gnu/libpython3.11.a"

rm -f "$rootfs/etc/apt/sources.list"
cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: ${mirror}
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${mirror%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES

# This machine's extra certificate authorities (a TLS-inspecting proxy, for one), so that apt and pip in image builds
# reach their archives the way the host does; pip is pointed at the system bundle, which holds them.
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
fi
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"

mountpoint -q "$rootfs/proc" || mount -t proc proc "$rootfs/proc"
trap 'umount "$rootfs/proc" 2>/dev/null || true' EXIT
in_root() {
  chroot "$rootfs" /usr/bin/env -i HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
    PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
in_root update-ca-certificates
[ -x "$rootfs/usr/local/bin/pip" ] || in_root python3 -m venv /usr/local
# pip and setuptools at the versions the official python:3.11 images carry
in_root pip install --no-cache-dir --disable-pip-version-check --no-compile pip==24.0 setuptools==79.0.1 'wheel<0.46'

rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/root/.cache "$rootfs"/tmp/* "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
find "$rootfs/usr/local" -depth -type d -name __pycache__ -exec rm -rf '{}' +
: > "$rootfs/etc/resolv.conf"  # Docker provides it, and the hostname, at run time
: > "$rootfs/etc/hostname"
umount "$rootfs/proc"
trap - EXIT

docker rmi "$tag" >/dev/null 2>&1 || true
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$tag" >/dev/null
docker run --rm "$tag" sh -ec 'test "$(command -v python)" = /usr/local/bin/python; python --version; pip --version'
docker image inspect "$tag" --format "$tag: {{.Size}} bytes"
