#!/usr/bin/env bash
# Install gear-server as a systemd service: a system user, a virtualenv with the
# daemon, the config under /etc/gear, the unit, then (optionally) start it.
# docs/OPERATIONS.md walks through it. Run as root: `sudo make install-service`
# or `sudo deploy/install-service.sh --start`. Safe to run again: an existing
# config or token is never overwritten; the virtualenv and unit are refreshed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX=/opt/gear
CONFIG_DIR=/etc/gear
UNIT_DIR=/etc/systemd/system
SERVICE_USER=gear
ROOT=""
GEAR_SERVER=""
PYTHON="${PYTHON:-python3}"
START=0
GENERATE_TOKEN=0
PIP_ARGS=()

usage() {
    cat <<EOF
usage: $0 [options]
  --prefix DIR        where the virtualenv and docs go (default $PREFIX)
  --config-dir DIR    where gear-server.toml goes (default $CONFIG_DIR)
  --unit-dir DIR      where the unit goes (default $UNIT_DIR)
  --user NAME         the service's system user and group (default $SERVICE_USER)
  --python PATH       Python 3.11+ used to build the virtualenv (default \$PYTHON or python3)
  --pip-arg ARG       pass ARG to pip (repeatable; e.g. --pip-arg --no-index --pip-arg --find-links=/wheels)
  --gear-server PATH  use this gear-server executable instead of building a virtualenv
  --generate-token    write a random bearer token to CONFIG_DIR/token (mode 0640, group USER) and put
                      it in force ([auth] token_file in the config; an existing token setting is kept)
  --start             enable and start the service now
  --root DIR          stage every file under DIR (packaging, tests): no user, no systemctl;
                      needs --gear-server (a virtualenv cannot be moved)
EOF
}

die() { echo "install-service: $*" >&2; exit 1; }
say() { echo "install-service: $*"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        --config-dir) CONFIG_DIR="$2"; shift 2 ;;
        --unit-dir) UNIT_DIR="$2"; shift 2 ;;
        --user) SERVICE_USER="$2"; shift 2 ;;
        --python) PYTHON="$2"; shift 2 ;;
        --pip-arg) PIP_ARGS+=("$2"); shift 2 ;;
        --gear-server) GEAR_SERVER="$2"; shift 2 ;;
        --generate-token) GENERATE_TOKEN=1; shift ;;
        --start) START=1; shift ;;
        --root) ROOT="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option $1" ;;
    esac
done

for dir in "$PREFIX" "$CONFIG_DIR" "$UNIT_DIR"; do
    [[ "$dir" == /* ]] || die "paths must be absolute: $dir"
done
if [[ -z "$ROOT" && $EUID -ne 0 ]]; then
    die "run as root (sudo make install-service), or stage the files with --root DIR"
fi
if [[ -n "$ROOT" && -z "$GEAR_SERVER" ]]; then
    die "--root needs --gear-server PATH (a virtualenv cannot be moved after it is built)"
fi
if [[ -n "$ROOT" && $START -eq 1 ]]; then
    die "--start cannot be used with --root"
fi

# 1. The system user that runs the daemon (no login, no home of its own: the
#    unit's StateDirectory /var/lib/gear holds its state).
if [[ -z "$ROOT" ]]; then
    if getent passwd "$SERVICE_USER" >/dev/null; then
        say "user $SERVICE_USER exists"
    else
        useradd --system --user-group --home-dir /var/lib/gear --no-create-home \
            --shell /usr/sbin/nologin --comment "gear replay daemon" "$SERVICE_USER"
        say "created system user $SERVICE_USER"
    fi
fi

# 2. The daemon in its own virtualenv (a copy of this checkout, not an editable install).
if [[ -z "$GEAR_SERVER" ]]; then
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found: install Python 3.11 or newer"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is older than 3.11"
    "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PYTHON cannot build virtualenvs: apt-get install python3-venv (Debian/Ubuntu)"
    say "building $PREFIX/venv"
    "$PYTHON" -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/python" -m pip install --quiet --upgrade pip ${PIP_ARGS[@]+"${PIP_ARGS[@]}"}
    "$PREFIX/venv/bin/python" -m pip install --quiet --upgrade ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "$REPO"
    GEAR_SERVER="$PREFIX/venv/bin/gear-server"
fi
[[ -x "$ROOT$GEAR_SERVER" || -x "$GEAR_SERVER" ]] || die "$GEAR_SERVER is not an executable"

# 3. Configuration: readable by the service's group, writable by root only.
install -d -m 0755 "$ROOT$CONFIG_DIR"
config="$ROOT$CONFIG_DIR/gear-server.toml"
if [[ -e "$config" ]]; then
    say "keeping the existing $CONFIG_DIR/gear-server.toml"
else
    install -m 0640 "$REPO/deploy/gear-server.example.toml" "$config"
    [[ -n "$ROOT" ]] || chgrp "$SERVICE_USER" "$config"
    say "installed $CONFIG_DIR/gear-server.toml (from deploy/gear-server.example.toml): edit its tables"
fi
if [[ $GENERATE_TOKEN -eq 1 ]]; then
    token="$ROOT$CONFIG_DIR/token"
    if [[ -e "$token" ]]; then
        say "keeping the existing $CONFIG_DIR/token"
    else
        (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$token")
        chmod 0640 "$token"
        [[ -n "$ROOT" ]] || chgrp "$SERVICE_USER" "$token"
        say "wrote a random bearer token to $CONFIG_DIR/token"
    fi
    # The token is in force: [auth] token_file names it (an operator's own token or token_file line is kept).
    if grep -Eq '^[[:space:]]*(token|token_file)[[:space:]]*=' "$config"; then
        say "keeping the token setting of $CONFIG_DIR/gear-server.toml"
    elif grep -Eq '^#[[:space:]]*token_file[[:space:]]*=' "$config"; then
        sed -i -E "0,/^#[[:space:]]*token_file[[:space:]]*=.*/s##token_file = \"$CONFIG_DIR/token\"#" "$config"
        say "token in force: token_file = \"$CONFIG_DIR/token\" in [auth] (clients: GEAR_TOKEN_FILE or token=)"
    elif grep -Eq '^\[auth\]' "$config"; then
        sed -i -E "0,/^\[auth\]/s##[auth]\ntoken_file = \"$CONFIG_DIR/token\"#" "$config"
        say "token in force: token_file = \"$CONFIG_DIR/token\" in [auth] (clients: GEAR_TOKEN_FILE or token=)"
    else
        printf '\n[auth]\ntoken_file = "%s/token"\n' "$CONFIG_DIR" >> "$config"
        say "token in force: token_file = \"$CONFIG_DIR/token\" in [auth] (clients: GEAR_TOKEN_FILE or token=)"
    fi
fi

# 4. The operations documentation next to the daemon (the unit's Documentation=).
install -d -m 0755 "$ROOT$PREFIX/doc"
for doc in OPERATIONS.md SECURITY.md CHECKPOINT_FORMAT.md; do
    if [[ -e "$REPO/docs/$doc" ]]; then
        install -m 0644 "$REPO/docs/$doc" "$ROOT$PREFIX/doc/$doc"
    fi
done

# 5. The unit, rendered for these paths.
install -d -m 0755 "$ROOT$UNIT_DIR"
unit="$ROOT$UNIT_DIR/gear-server.service"
rendered="$(mktemp)"
trap 'rm -f "$rendered"' EXIT
sed -e "s#^ExecStart=.*#ExecStart=$GEAR_SERVER --config $CONFIG_DIR/gear-server.toml#" \
    -e "s#^User=.*#User=$SERVICE_USER#" \
    -e "s#^Group=.*#Group=$SERVICE_USER#" \
    -e "s#^Documentation=.*#Documentation=file://$PREFIX/doc/OPERATIONS.md#" \
    "$REPO/deploy/gear-server.service" > "$rendered"
install -m 0644 "$rendered" "$unit"
say "installed $UNIT_DIR/gear-server.service"

# 6. Check it where the tool exists.
if command -v systemd-analyze >/dev/null && [[ -x "$GEAR_SERVER" ]]; then
    systemd-analyze verify "$unit" || die "systemd-analyze verify rejected $unit"
    say "systemd-analyze verify: ok"
fi

# 7. Hand it to systemd.
if [[ -z "$ROOT" ]]; then
    if [[ -d /run/systemd/system ]]; then
        systemctl daemon-reload
        if [[ $START -eq 1 ]]; then
            systemctl enable --now gear-server.service
            say "started: systemctl status gear-server; journalctl -u gear-server -f"
        else
            say "next: edit $CONFIG_DIR/gear-server.toml, then systemctl enable --now gear-server"
        fi
    else
        say "systemd is not running here: the unit is installed but not loaded"
    fi
fi
