#!/usr/bin/env bash
# Install and start a Docker engine on a CI machine, and build the local base image the project's
# images are built FROM there (no image registry is reachable). Idempotent: every step is skipped
# when its result already exists. Prints how long each step took.
#
#   deploy/ci/docker-setup.sh            # engine + base image + torch wheel in build/docker-wheels/
#
# Environment:
#   HIVEPATH_BASE_IMAGE   tag of the local base image (default local/hivepath-base:bookworm)
#   DOCKERD_LOG           where dockerd writes its log (default /tmp/hivepath-dockerd.log)
#
# The Debian mirror is read at run time from this machine's apt sources and never written anywhere.
# This machine's locally added CA certificates are installed into the base image (so pip inside a
# container trusts the same registry certificates as the host); the project's Dockerfiles themselves
# never do that: they build from public bases for real users.
set -euo pipefail

BASE_IMAGE="${HIVEPATH_BASE_IMAGE:-local/hivepath-base:bookworm}"
DOCKERD_LOG="${DOCKERD_LOG:-/tmp/hivepath-dockerd.log}"
REPO_ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WHEEL_DIR="$REPO_ROOT/build/docker-wheels"
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

step_start=0
begin() { step_start=$(date +%s%N); echo "== docker-setup: $*"; }
done_step() {
  local ms=$(( ($(date +%s%N) - step_start) / 1000000 ))
  printf '== docker-setup: %s took %d.%03d s\n' "$1" $((ms / 1000)) $((ms % 1000))
}

# 1. packages
begin "packages"
if command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null; then
  echo "   already installed"
else
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
fi
done_step "packages"

# 2. engine
begin "engine"
if docker info >/dev/null 2>&1; then
  echo "   dockerd already answering"
else
  $SUDO sh -c "nohup dockerd >'$DOCKERD_LOG' 2>&1 & echo \$! >/tmp/hivepath-dockerd.pid"
  for _ in $(seq 1 300); do
    if docker info >/dev/null 2>&1; then break; fi
    sleep 0.1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see $DOCKERD_LOG" >&2; exit 1; }
  echo "   dockerd pid $(cat /tmp/hivepath-dockerd.pid)"
fi
done_step "engine"

# 3. base image
begin "base image $BASE_IMAGE"
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "   already built"
else
  mirror=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' "$f")
    [ -n "$mirror" ] && break
  done
  if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
    mirror=$(awk '/^deb / && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
  fi
  [ -n "$mirror" ] || { echo "no Debian mirror found in the apt sources" >&2; exit 1; }
  rootfs=$(mktemp -d /tmp/hivepath-rootfs.XXXXXX)
  $SUDO debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,curl \
    bookworm "$rootfs" "$mirror" >/tmp/hivepath-debootstrap.log 2>&1 \
    || { echo "debootstrap failed; see /tmp/hivepath-debootstrap.log" >&2; exit 1; }
  if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    $SUDO cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    $SUDO chroot "$rootfs" update-ca-certificates >/dev/null
  fi
  $SUDO rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
  $SUDO tar -C "$rootfs" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV LANG=C.UTF-8' \
    - "$BASE_IMAGE" >/dev/null
  $SUDO rm -rf "$rootfs"
fi
done_step "base image"

# 4. the CPU torch wheel for the peer image's build context
begin "torch wheel"
mkdir -p "$WHEEL_DIR"
if ls "$WHEEL_DIR"/torch-2.13.0*.whl >/dev/null 2>&1; then
  echo "   already in build/docker-wheels"
else
  local_wheel=$(ls /opt/wheels/torch-2.13.0*cp311*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$local_wheel" ]; then
    cp "$local_wheel" "$WHEEL_DIR/"
  else
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      torch==2.13.0 -d "$WHEEL_DIR"
  fi
fi
done_step "torch wheel"
echo "== docker-setup: ready (base image $BASE_IMAGE)"
