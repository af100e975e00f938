"""``gear-server``: run the replay daemon in the foreground.

    gear-server --config deploy/gear-server.example.toml [--port N] [--bind-address A] [--log-level L]
                [--metrics-port N] [--checkpoint-dir DIR] [--token-file F] [--allow-insecure]

Several daemons on one host need their own port, metrics port and checkpoint
directory each (a directory in use by a live daemon is refused to another);
the flags override the file so one file serves them all (docs/SHARDING.md).
A non-loopback address with neither token nor TLS is refused (exit 2) unless
``[auth] allow_insecure = true`` or ``--allow-insecure`` says so.

Logs to stderr, stops cleanly on SIGTERM/SIGINT (segments unlinked), exit 0.
Exit 2: bad configuration; exit 1: the daemon could not start (e.g. port taken).

Two more inputs serve ``gear_client.Server``, which runs the daemon as a child
process: ``--config-proto PATH`` (a serialized gear.v1.ServerConfig) and
``--control-fd FD`` (a socket: the config arrives on it, length-prefixed, when
no other config is given; the daemon answers ``port N`` or ``error TEXT`` and
stops when the socket closes, so it never outlives its parent).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import struct
import sys
import threading

from gear_contract._proto import replay_pb2 as pb
from gear_server.config import ConfigError, DaemonSettings, load_config
from gear_server.errors import CheckpointConfigConflict

log = logging.getLogger("gear_server.cli")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
_LENGTH = struct.Struct("!Q")
MAX_CONFIG_BYTES = 64 << 20


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _port(text: str) -> int:
    """--port: an integer in [0, 65535] (argparse says what is wrong and exits 2 otherwise)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not in [0, 65535]")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gear-server", description="Run the gear replay daemon.")
    parser.add_argument("--config", help="TOML configuration file (see deploy/gear-server.example.toml)")
    parser.add_argument("--config-proto", help=argparse.SUPPRESS)
    parser.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=_port, help="override the config's port (0: any free port)")
    parser.add_argument("--bind-address", help="override the config's bind_address")
    parser.add_argument("--metrics-port", type=_port,
                        help="serve /metrics on this port (overrides [metrics] port; turns metrics on)")
    parser.add_argument("--checkpoint-dir", help="override [checkpoint] dir (a relative path: from the working "
                                                 "directory)")
    parser.add_argument("--token-file", help="override [auth] token_file: every call must carry this bearer token")
    parser.add_argument("--allow-insecure", action="store_true",
                        help="serve a non-loopback address with neither token nor TLS ([auth] allow_insecure)")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        help="DEBUG, INFO (default), WARNING, ERROR or CRITICAL")
    args = parser.parse_args(argv)
    if args.config and args.config_proto:
        parser.error("give --config or --config-proto, not both")
    if not (args.config or args.config_proto or args.control_fd is not None):
        parser.error("--config FILE is required")
    return args


def read_config_message(sock: socket.socket) -> pb.ServerConfig:
    """A length-prefixed serialized ServerConfig from the control socket."""
    header = _recv_exactly(sock, _LENGTH.size)
    (size,) = _LENGTH.unpack(header)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config message of {size} bytes is too large")
    return pb.ServerConfig.FromString(_recv_exactly(sock, size))


def send_config_message(sock: socket.socket, config: pb.ServerConfig) -> None:
    data = config.SerializeToString()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConfigError("the control socket closed before the config arrived")
        out += part
    return bytes(out)


def _settings(args: argparse.Namespace, control: socket.socket | None) -> DaemonSettings:
    if args.config:
        settings = load_config(args.config)
    elif args.config_proto:
        with open(args.config_proto, "rb") as f:
            settings = DaemonSettings.from_server_config(pb.ServerConfig.FromString(f.read()))
        settings.source = args.config_proto
    else:
        settings = DaemonSettings.from_server_config(read_config_message(control))
        settings.source = "control socket"
    if not args.config:  # the Python Server's daemon: Reverb's API has no credentials, and serves as Reverb's does
        settings.auth = reverb_server_auth()
    if args.port is not None:
        settings.server.port = args.port
    if args.bind_address:
        settings.server.bind_address = args.bind_address
    if args.token_file is not None or args.allow_insecure:
        from gear_server.ops.auth import AuthSettings

        auth = settings.auth or AuthSettings()
        if args.token_file is not None:
            auth = dataclasses.replace(auth, token=None, token_file=args.token_file)
        if args.allow_insecure:
            auth = dataclasses.replace(auth, allow_insecure=True)
        auth.check()
        settings.auth = auth
    if args.metrics_port is not None:
        from gear_server.ops.metrics import MetricsSettings

        settings.metrics = dataclasses.replace(settings.metrics or MetricsSettings(), enabled=True,
                                               port=args.metrics_port)
    if args.checkpoint_dir is not None:
        if not args.checkpoint_dir:
            raise ConfigError("--checkpoint-dir must be a non-empty path")
        from gear_server.checkpoint.settings import CheckpointSettings

        settings.checkpoint = dataclasses.replace(settings.checkpoint or CheckpointSettings(),
                                                  dir=args.checkpoint_dir)
    return settings


def reverb_server_auth():
    """The auth of a daemon started by the Python ``Server`` (Reverb's API: no token, no TLS, every interface,
    as Reverb's server): the opt-out of the exposure check, stated here once."""
    from gear_server.ops.auth import AuthSettings

    return AuthSettings(allow_insecure=True)


def _configure_logging(settings: DaemonSettings | None, level: str | None) -> None:
    try:
        from gear_server.ops.logs import LoggingSettings, configure_logging
    except ImportError:
        logging.basicConfig(stream=sys.stderr, level=(level or "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return
    logging_settings = (settings.logging if settings is not None else None) or LoggingSettings()
    if level:
        logging_settings = LoggingSettings(level=level.upper(), format=logging_settings.format,
                                           loggers=logging_settings.loggers,
                                           client_error_summary_s=logging_settings.client_error_summary_s)
    configure_logging(logging_settings)


def _watch_control(control: socket.socket, daemon) -> None:
    """Stop the daemon when the parent closes the control socket (or dies)."""
    def run():
        try:
            while True:
                data = control.recv(4096)
                if not data or b"stop" in data:
                    break
        except OSError:
            pass
        log.info("control socket closed: stopping")
        daemon.request_stop()

    threading.Thread(target=run, name="gear-control", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    control = socket.socket(fileno=args.control_fd) if args.control_fd is not None else None

    def report(line: str) -> None:
        if control is not None:
            try:
                control.sendall((line.replace("\n", " ") + "\n").encode())
            except OSError:
                pass

    _configure_logging(None, args.log_level)
    try:
        settings = _settings(args, control)
        _configure_logging(settings, args.log_level)
    except (ConfigError, ValueError, OSError) as e:
        print(f"gear-server: configuration error: {e}", file=sys.stderr)
        report(f"error configuration: {e}")
        return EXIT_CONFIG

    from gear_server.daemon import Daemon

    daemon = Daemon(settings)
    if settings.source:
        log.info("configuration from %s", settings.source)

    def on_started(d) -> None:
        report(f"port {d.port}")
        if control is not None:
            _watch_control(control, d)

    try:
        daemon.serve(install_signal_handlers=True, on_started=on_started)
    except (CheckpointConfigConflict, ConfigError) as e:  # a configuration error: restarting would not fix it
        log.error("cannot start: %s", e)
        report(f"error configuration: {e}")
        return EXIT_CONFIG
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        report(f"error {e}")
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 (a bug: report it to the parent, with its traceback in the log)
        log.exception("the daemon failed")
        report(f"error {type(e).__name__}: {e}")
        return EXIT_FAILED
    finally:
        if control is not None:
            control.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
