#!/bin/sh
# Container entry point of every hivepath image: checks the required environment variables, turns
# the coordinator's variables into flags, then execs the installed `hivepath` command (so signals
# reach it directly; run containers with --init / `init: true` so zombies are reaped too).
# The token needs no flag: every command reads HIVEPATH_TOKEN, then HIVEPATH_TOKEN_FILE, itself.
#
# A missing required variable stops the container with one line naming it (exit 2).
# With HIVEPATH_SPOT set (aws, gcp or auto), `peer join` and `archive` run under the spot-notice
# supervisor (python -m peer.node.spot), which sends the peer SIGTERM (drain, checkpoint, exit 0) when
# the cloud posts a preemption notice.
set -eu

die() {
  echo "hivepath: error: $1" >&2
  exit 2
}

need() {
  eval "value=\${$1:-}"
  [ -n "$value" ] || die "$1 is not set: $2"
}

need_token() {
  if [ -z "${HIVEPATH_TOKEN:-}" ] && [ -z "${HIVEPATH_TOKEN_FILE:-}" ]; then
    die "HIVEPATH_TOKEN is not set: set it (or HIVEPATH_TOKEN_FILE) to the run's token"
  fi
  if [ -n "${HIVEPATH_TOKEN_FILE:-}" ] && [ ! -r "$HIVEPATH_TOKEN_FILE" ]; then
    die "HIVEPATH_TOKEN_FILE=$HIVEPATH_TOKEN_FILE cannot be read: mount the token file there"
  fi
}

# HIVEPATH_ANNOUNCE_MADDRS=auto: announce this container's own IPv4 addresses at the fixed port of
# HIVEPATH_HOST_MADDRS, so other containers are never handed a loopback address to dial.
resolve_announce() {
  [ "${HIVEPATH_ANNOUNCE_MADDRS:-}" = "auto" ] || return 0
  port=$(printf '%s' "${HIVEPATH_HOST_MADDRS:-}" | sed -n 's|.*/tcp/\([1-9][0-9]*\).*|\1|p')
  [ -n "$port" ] || die "HIVEPATH_ANNOUNCE_MADDRS=auto needs a fixed port in HIVEPATH_HOST_MADDRS, e.g. /ip4/0.0.0.0/tcp/7710"
  addrs=""
  for ip in $(hostname -I 2>/dev/null); do
    case "$ip" in
      *:*|127.*) ;;
      *) addrs="$addrs /ip4/$ip/tcp/$port" ;;
    esac
  done
  [ -n "$addrs" ] || die "HIVEPATH_ANNOUNCE_MADDRS=auto found no IPv4 address of this container; set the multiaddrs yourself"
  HIVEPATH_ANNOUNCE_MADDRS="${addrs# }"
  export HIVEPATH_ANNOUNCE_MADDRS
}

maybe_spot() {
  resolve_announce
  if [ -n "${HIVEPATH_SPOT:-}" ] && [ "${HIVEPATH_SPOT}" != "none" ]; then
    exec python -m peer.node.spot -- hivepath "$@"
  fi
  exec hivepath "$@"
}

case "${1:-}" in
  coordinator)
    if [ "${2:-}" = "serve" ]; then
      shift 2
      need_token
      need HIVEPATH_RUN_CONFIG "point it at the run's run.toml (the image ships /etc/hivepath/run.toml)"
      [ -r "$HIVEPATH_RUN_CONFIG" ] || die "HIVEPATH_RUN_CONFIG=$HIVEPATH_RUN_CONFIG cannot be read: mount run.toml there"
      need HIVEPATH_DB "set it to the SQLite file on the /data volume, e.g. /data/state.db"
      set -- coordinator serve --run-config "$HIVEPATH_RUN_CONFIG" --db "$HIVEPATH_DB" \
        --port "${HIVEPATH_PORT:-7700}" --http-port "${HIVEPATH_HTTP_PORT:-7701}" "$@"
      if [ -n "${HIVEPATH_TLS_CERT:-}" ]; then
        need HIVEPATH_TLS_KEY "set it to the private key of HIVEPATH_TLS_CERT"
        set -- "$@" --tls-cert "$HIVEPATH_TLS_CERT" --tls-key "$HIVEPATH_TLS_KEY"
      fi
    fi
    exec hivepath "$@"
    ;;
  peer)
    if [ "${2:-}" = "join" ]; then
      need HIVEPATH_COORDINATOR "set it to the coordinator's HOST:PORT"
      need_token
      maybe_spot "$@"
    fi
    exec hivepath "$@"
    ;;
  archive)
    need HIVEPATH_COORDINATOR "set it to the coordinator's HOST:PORT"
    need_token
    need HIVEPATH_ARCHIVE_DIR "set it to a directory on the /data volume, e.g. /data/archive"
    maybe_spot "$@"
    ;;
  *)
    exec hivepath "$@"
    ;;
esac
