"""The daemon as a program: TOML config, `gear-server --config FILE`, clean stop on signals."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import gear_client as reverb
from gear_server.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "gear-server.example.toml"
PROMPT_S = 20.0


def test_example_config_describes_its_tables():
    settings = load_config(EXAMPLE)
    server = settings.server
    assert server.bind_address == "127.0.0.1" and server.port == 8000 and server.shm_dir == "/dev/shm"
    tables = {t.name: t for t in server.tables}
    assert set(tables) == {"replay", "uniform", "queue"}
    replay = tables["replay"]
    assert replay.sampler.prioritized.priority_exponent == 0.6 and replay.remover.fifo
    assert replay.rate_limiter.samples_per_insert == 4.0 and replay.rate_limiter.min_size_to_sample == 1000
    assert (replay.rate_limiter.min_diff, replay.rate_limiter.max_diff) == (3600.0, 4400.0)
    assert [leaf.name for leaf in replay.signature.leaves] == ["action", "observation", "reward"]
    assert list(replay.signature.leaves[1].shape) == [-1, 64]
    queue = tables["queue"]
    assert queue.sampler.fifo and queue.max_times_sampled == 1 and queue.rate_limiter.max_diff == 1000


BASE = 'port = 0\n[[tables]]\nname = "t"\nmax_size = 10\n'


@pytest.mark.parametrize("text,words", [
    ('prot = 1\n' + BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = { min_size = 1 }\n', "prot"),
    ('[[tables]]\nname = "t"\nsampler = "uniform"\nremover = "fifo"\nrate_limiter = { min_size = 1 }\n', "max_size"),
    (BASE + 'sampler = "random"\nremover = "fifo"\nrate_limiter = { min_size = 1 }\n', "random"),
    (BASE + 'sampler = "prioritized"\nremover = "fifo"\nrate_limiter = { min_size = 1 }\n', "priority_exponent"),
    (BASE + 'sampler = { prioritized = { priority_exponent = -1.0 } }\nremover = "fifo"\n'
            'rate_limiter = { min_size = 1 }\n', "priority_exponent"),
    (BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = { min_size = 0 }\n', "min_size_to_sample"),
    (BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = { sample_to_insert_ratio = '
            '{ samples_per_insert = 1.0, min_size_to_sample = 10, error_buffer = 0.5 } }\n', "error_buffer"),
    (BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = { leaky = 3 }\n', "leaky"),
    (BASE + 'preset = "queue"\nsampler = "uniform"\n', "sampler"),
    (BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = "queue"\nwindow = 3\n', "window"),
    (BASE + 'sampler = "uniform"\nremover = "fifo"\nrate_limiter = "queue"\n'
            '[tables.signature]\nobs = { dtype = "float33", shape = [-1] }\n', "float33"),
    (BASE + 'preset = "queue"\n' + BASE.replace("port = 0\n", "") + 'preset = "stack"\n', "two tables"),
    ('port = 0\n', "tables"),
    (BASE.replace("port = 0", "port = 70000") + 'preset = "queue"\n', "port"),
    ('port = 0\n[[tables\n', "invalid TOML"),
    (BASE + 'preset = "queue"\n[limits]\nmax_stream = 10\n', "max_stream"),
    (BASE + 'preset = "queue"\n[limits]\nmax_streams = 0\n', "max_streams"),
    (BASE + 'preset = "queue"\n[limits]\nmax_buffered_bytes = "4G"\n', "max_buffered_bytes"),
])
def test_config_mistakes_are_named(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words.lower() in str(e.value).lower(), str(e.value)


def test_limits_section_is_read():
    settings = parse_config({"port": 0, "tables": [{"name": "t", "max_size": 10, "preset": "queue"}],
                             "limits": {"max_streams": 10, "max_stream_buffer_bytes": 1 << 20}})
    assert settings.limits.max_streams == 10 and settings.limits.max_stream_buffer_bytes == 1 << 20
    assert settings.limits.max_health_streams == 256  # the default of a key left out


def test_config_forms_of_selectors_and_rate_limiters():
    settings = parse_config({"tables": [
        {"name": "a", "max_size": 8, "sampler": "max_heap", "remover": "min_heap",
         "rate_limiter": {"explicit": {"samples_per_insert": 2.0, "min_size_to_sample": 3, "min_diff": -5.0,
                                       "max_diff": 7.0}}},
        {"name": "b", "max_size": 8, "sampler": "lifo", "remover": "fifo", "max_times_sampled": 2,
         "rate_limiter": {"sample_to_insert_ratio": {"samples_per_insert": 1.0, "min_size_to_sample": 1,
                                                      "error_buffer": [-2.0, 2.0]}}},
        {"name": "c", "max_size": 8, "preset": "stack", "initial_max_length": 16},
    ]})
    a, b, c = settings.server.tables
    assert a.sampler.heap.min_heap is False and a.remover.heap.min_heap is True
    assert (a.rate_limiter.samples_per_insert, a.rate_limiter.min_diff, a.rate_limiter.max_diff) == (2.0, -5.0, 7.0)
    assert b.sampler.lifo and b.max_times_sampled == 2 and (b.rate_limiter.min_diff, b.rate_limiter.max_diff) == (-2, 2)
    assert c.sampler.lifo and c.remover.lifo and c.rate_limiter.max_diff == 8 and c.initial_max_length == 16
    assert settings.server.bind_address == "[::]" and settings.server.instance_name == "gear"


# ------------------------------------------------------------------ the program

def _config(tmp_path: Path, shm_dir: str, port: int = 0) -> Path:
    path = tmp_path / "gear.toml"
    path.write_text(textwrap.dedent(f"""\
        bind_address = "127.0.0.1"
        port = {port}
        shm_dir = "{shm_dir}"
        instance_name = "cli"

        [[tables]]
        name = "replay"
        sampler = {{ prioritized = {{ priority_exponent = 1.0 }} }}
        remover = "fifo"
        max_size = 100
        rate_limiter = {{ min_size = 1 }}
        [tables.signature]
        obs = {{ dtype = "float32", shape = [-1, 2] }}
        """))
    return path


@pytest.fixture
def shm_dir():
    path = f"/dev/shm/gear-cli-{uuid.uuid4().hex[:10]}"
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gear_server", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _wait_for_port(process: subprocess.Popen, log: list[str]) -> int:
    deadline = time.monotonic() + PROMPT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline()
            if not line:
                break
            log.append(line)
            match = re.search(r"serving .* on .*:(\d+) \(pid", line)
            if match:
                return int(match.group(1))
    raise AssertionError("the daemon did not report serving:\n" + "".join(log))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_gear_server_serves_its_config_and_stops_cleanly_on_signals(tmp_path, shm_dir, sig):
    process = _start(["--config", str(_config(tmp_path, shm_dir))])
    log: list[str] = []
    try:
        port = _wait_for_port(process, log)
        client = reverb.Client(f"127.0.0.1:{port}", data_planes=())
        client.insert({"obs": np.ones((3, 2), np.float32)[0]}, {"replay": 1.0})
        (sample,) = client.sample("replay", 1, emit_timesteps=False, unpack_as_table_signature=True)
        np.testing.assert_array_equal(sample.data["obs"], np.ones((1, 2), np.float32))
        assert len(os.listdir(shm_dir)) == 1
        client.close()
        process.send_signal(sig)
        out, _ = process.communicate(timeout=PROMPT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log.append(out)
    text = "".join(log)
    assert process.returncode == 0, text
    assert f"received {signal.Signals(sig).name}" in text and "stopped in" in text
    assert os.listdir(shm_dir) == []


def test_gear_server_exits_2_on_a_bad_config(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[tables]]\nname = "t"\nmax_size = -1\npreset = "queue"\n')
    out = subprocess.run([sys.executable, "-m", "gear_server", "--config", str(path)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 2
    assert "max_size" in out.stderr and "configuration error" in out.stderr


@pytest.mark.parametrize(("flags", "words"), [(["--port", "99999"], "not in [0, 65535]"),
                                              (["--port", "http"], "not a port number"),
                                              (["--log-level", "LOUD"], "invalid choice: 'LOUD'")])
def test_gear_server_exits_2_on_a_bad_flag_and_names_it(tmp_path, flags, words):
    path = tmp_path / "ok.toml"
    path.write_text('[[tables]]\nname = "t"\nmax_size = 10\npreset = "queue"\n')
    out = subprocess.run([sys.executable, "-m", "gear_server", "--config", str(path), *flags], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr


def test_gear_server_exits_1_when_its_port_is_taken(tmp_path, shm_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        path = _config(tmp_path, shm_dir, port=s.getsockname()[1])
        out = subprocess.run([sys.executable, "-m", "gear_server", "--config", str(path)], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1, out.stderr
    assert "cannot bind" in out.stderr
    assert os.listdir(shm_dir) == []


def test_gear_server_command_is_installed():
    script = Path(sys.executable).parent / "gear-server"
    if not script.exists():
        pytest.skip("the gear-server script is not installed in this environment")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--config" in out.stdout
