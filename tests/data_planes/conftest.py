"""Fixtures of the data-plane tests: a network namespace joined to this one by a veth pair ("another host")."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager

import pytest

STEP_S = 20


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=STEP_S)


@pytest.fixture
def namespace(veth):
    """(namespace name, the host side's address): processes run there with ``ip netns exec``."""
    return veth[0], veth[1]


@pytest.fixture
def veth():
    """(namespace name, host side's address, namespace side's address, host interface, namespace interface)."""
    with _veth_pair(os.getpid() % 100000) as pair:
        yield pair


@pytest.fixture(scope="module")
def module_veth():
    """A veth pair as ``veth`` shared by a module's tests: UCX remembers the interfaces of the first context
    a process makes, so a process's NIXL agents must all use one pair that stays up."""
    with _veth_pair((os.getpid() + 50000) % 100000) as pair:
        yield pair


@contextmanager
def _veth_pair(tag: int):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and ip(8)")
    ns, host_if, ns_if = f"gearns{tag}", f"gv{tag}a", f"gv{tag}b"
    net = f"10.{200 + tag % 50}.{tag % 250}"
    host_ip, ns_ip = f"{net}.1", f"{net}.2"
    setup = [
        ("ip", "netns", "add", ns),
        ("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if),
        ("ip", "link", "set", ns_if, "netns", ns),
        ("ip", "addr", "add", f"{host_ip}/30", "dev", host_if),
        ("ip", "link", "set", host_if, "up"),
        ("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if),
        ("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"),
        ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"),
    ]
    try:
        for cmd in setup:
            done = _run(*cmd)
            if done.returncode != 0:
                pytest.skip(f"cannot set up a network namespace here ({' '.join(cmd)}: {done.stderr.strip()})")
        yield ns, host_ip, ns_ip, host_if, ns_if
    finally:
        _run("ip", "link", "del", host_if)
        _run("ip", "netns", "del", ns)
