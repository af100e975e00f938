"""RDMA addressing choices (IB LID, RoCE GID), endpoint validation, and the verbs module without hardware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gear_contract import addressing as ad
from gear_contract._proto import replay_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")

IPV4_GID = bytes(10) + b"\xff\xff" + bytes([192, 168, 7, 2])
LINK_LOCAL = bytes.fromhex("fe800000000000000202c9fffe000001")
OTHER_SUBNET = bytes.fromhex("fec00000000000010202c9fffe000009")


def port(link: str = ad.LINK_IB, gid: bytes = LINK_LOCAL, gid_index: int = 0, lid: int = 3, mtu: int = 5,
         max_rd: int = 16, msg: int = 1 << 30) -> ad.PortInfo:
    return ad.PortInfo("mlx5_0", 1, link, lid, gid, gid_index, mtu, msg, max_qp_rd_atom=max_rd)


def remote(link: str = ad.LINK_IB, gid: bytes = LINK_LOCAL, lid: int = 9, mtu: int = 5, qps: int = 2,
           max_rd: int = 8, msg: int = 1 << 31) -> pb.RdmaEndpoint:
    return pb.RdmaEndpoint(device="mlx5_1", port=1, link_layer=link, lid=lid, gid=gid, gid_index=0, mtu=mtu,
                           qp_nums=list(range(0x40, 0x40 + qps)), psns=[5] * qps, max_rd_atomic=max_rd,
                           max_msg_size=msg)


def test_gid_text_and_bytes_round_trip():
    text = ad.gid_to_str(LINK_LOCAL)
    assert text == "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
    assert ad.gid_to_bytes(text) == LINK_LOCAL
    assert ad.gid_to_bytes("::ffff:192.168.7.2") == IPV4_GID
    assert ad.is_ipv4_mapped(IPV4_GID) and not ad.is_ipv4_mapped(LINK_LOCAL)
    assert ad.is_zero_gid(bytes(16)) and ad.is_zero_gid(LINK_LOCAL[:8] + bytes(8))
    with pytest.raises(ValueError):
        ad.gid_to_bytes(b"short")


def test_gid_choice_prefers_roce_v2_ipv4_and_skips_zero_entries():
    entries = [
        ad.GidEntry(0, LINK_LOCAL, ad.GID_TYPE_ROCE_V1),
        ad.GidEntry(1, LINK_LOCAL, ad.GID_TYPE_ROCE_V2),
        ad.GidEntry(2, IPV4_GID, ad.GID_TYPE_ROCE_V1),
        ad.GidEntry(3, IPV4_GID, ad.GID_TYPE_ROCE_V2),
        ad.GidEntry(4, bytes(16), ad.GID_TYPE_ROCE_V2),
    ]
    assert ad.choose_gid_index(entries, ad.LINK_ETHERNET) == 3
    assert ad.choose_gid_index(entries[:3], ad.LINK_ETHERNET) == 1
    assert ad.choose_gid_index(entries, ad.LINK_IB) == 0
    assert ad.choose_gid_index([entries[4]], ad.LINK_ETHERNET) == -1


def test_infiniband_on_one_subnet_routes_by_lid():
    av = ad.address_vector(port(), remote(lid=9))
    assert (av.is_global, av.dlid, av.port) == (False, 9, 1)


def test_infiniband_across_subnets_or_without_lid_uses_a_global_route():
    av = ad.address_vector(port(), remote(gid=OTHER_SUBNET))
    assert av.is_global and av.dgid == OTHER_SUBNET and av.dlid == 9
    assert ad.address_vector(port(), remote(lid=0)).is_global


def test_roce_always_uses_the_peer_gid_and_our_gid_index():
    av = ad.address_vector(port(ad.LINK_ETHERNET, IPV4_GID, gid_index=3, lid=0),
                           remote(ad.LINK_ETHERNET, IPV4_GID[:-1] + b"\x09", lid=0))
    assert av.is_global and av.sgid_index == 3 and av.dgid[-1] == 9
    with pytest.raises(ValueError, match="no usable RoCE GID"):
        ad.address_vector(port(ad.LINK_ETHERNET, bytes(16), gid_index=-1), remote(ad.LINK_ETHERNET, IPV4_GID))
    with pytest.raises(ValueError, match="link layers differ"):
        ad.address_vector(port(ad.LINK_IB), remote(ad.LINK_ETHERNET, IPV4_GID))


def test_transfer_parameters_take_the_smaller_side():
    local = port(mtu=5, max_rd=16, msg=1 << 30)
    peer = remote(mtu=3, max_rd=4, msg=1 << 31)
    assert ad.path_mtu(local, peer) == 3
    assert ad.rd_atomic(local, peer) == 4
    assert ad.max_message(local, peer) == 1 << 30


@pytest.mark.parametrize("mutate, message", [
    (lambda e: setattr(e, "link_layer", "Token ring"), "link layer"),
    (lambda e: e.ClearField("qp_nums"), "no queue pairs"),
    (lambda e: e.psns.append(1), "one PSN per queue pair"),
    (lambda e: e.qp_nums.__setitem__(0, 1 << 24), "24-bit"),
    (lambda e: setattr(e, "mtu", 9), "MTU"),
    (lambda e: setattr(e, "gid", b"\x01" * 4), "16 bytes"),
])
def test_bad_endpoints_are_refused_with_a_reason(mutate, message):
    endpoint = remote()
    mutate(endpoint)
    with pytest.raises(ValueError, match=message):
        ad.validate_endpoint(endpoint)


def test_roce_endpoint_needs_a_gid_and_qp_count_must_match():
    with pytest.raises(ValueError, match="RoCE endpoint without a GID"):
        ad.validate_endpoint(remote(ad.LINK_ETHERNET, gid=bytes(16)))
    with pytest.raises(ValueError, match="expected 4"):
        ad.validate_endpoint(remote(qps=2), expected_qps=4)


def test_port_endpoint_carries_what_the_peer_needs():
    ep = port(ad.LINK_ETHERNET, IPV4_GID, gid_index=3, lid=0).endpoint([0x11, 0x12], [1, 2])
    assert list(ep.qp_nums) == [0x11, 0x12] and list(ep.psns) == [1, 2]
    assert ep.gid == IPV4_GID and ep.gid_index == 3 and ep.max_rd_atomic == 16 and ep.max_msg_size == 1 << 30
    ad.validate_endpoint(ep)


# ------------------------------------------------------------ verbs without hardware --

_PROBE = """
import json
from gear_contract import rdma_verbs as verbs, addressing
out = {"reason": verbs.unavailable_reason(), "devices": verbs.device_names(), "probe": verbs.probe()}
try:
    verbs.Device(addressing.PortInfo("mlx5_0", 1, "IB", 1, bytes(16), 0, 5, 1 << 30))
    out["device"] = "opened"
except (verbs.VerbsUnavailableError, verbs.VerbsError) as exc:
    out["device"] = type(exc).__name__
print(json.dumps(out, default=str))
"""


def _probe(extra_path: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_without_pyverbs_rdma_is_simply_not_offered():
    result = _probe(None)
    if result["reason"] is None:
        pytest.skip("pyverbs is importable in this environment")
    assert "pyverbs" in result["reason"]
    assert result["devices"] == [] and result["probe"] is None
    assert result["device"] == "VerbsUnavailableError"


@pytest.mark.skipif(not DEBIAN_PYVERBS.is_dir(), reason="the distribution's python3-pyverbs is not installed")
def test_real_pyverbs_without_a_device_reports_none(tmp_path):
    """Debian's python3-pyverbs linked into a path the way docs/DATA_PLANES.md installs it."""
    (tmp_path / "pyverbs").symlink_to(DEBIAN_PYVERBS)
    result = _probe(str(tmp_path))
    if result["reason"] is not None:
        pytest.skip(f"the distribution's pyverbs does not import here: {result['reason']}")
    if result["devices"]:
        pytest.skip(f"this machine has RDMA devices: {result['devices']}")
    assert result["probe"] is None
    assert result["device"] == "VerbsError"  # ibv_open_device of a device that is not there


_BUILD = """
import json
import numpy as np
from gear_contract._proto import replay_pb2 as pb
from gear_contract import addressing as ad
from gear_contract import rdma_verbs as verbs
ranges = np.array([[0, 0, 4096], [8192, 4096, 4096], [65536, 8192, 100]])
wrs = verbs.read_chain(7, ranges, verbs.Region(0x10000, 1 << 20, 11, 0),
                       pb.RdmaRegion(addr=0x7f0000, rkey=42, length=1 << 30))
local = ad.PortInfo("mlx5_0", 1, "Ethernet", 0, bytes(10) + b"\\xff\\xff" + bytes(4), 3, 5, 1 << 30)
peer = local.endpoint([0x33], [9])
av = ad.address_vector(local, peer)
attr = verbs.rts_attr(1, verbs.E.access_remote_read, 0x33, 9, 5, av, 4, 8)
ib = verbs.ah_attr(ad.AddressVector(1, False, 17, bytes(16), 0))
print(json.dumps({
    "wr_ids": [w.wr_id for w in wrs], "opcodes": [w.opcode == verbs.E.wr_rdma_read for w in wrs],
    "signalled": [bool(w.send_flags & verbs.E.send_signaled) for w in wrs], "sges": [w.num_sge for w in wrs],
    "qp": [attr.path_mtu, attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.max_rd_atomic, attr.max_dest_rd_atomic,
           attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.qp_access_flags == verbs.E.access_remote_read],
    "roce_ah": [attr.ah_attr.is_global, attr.ah_attr.sgid_index, attr.ah_attr.dgid, attr.ah_attr.port_num],
    "ib_ah": [ib.is_global, ib.dlid],
}))
"""


@pytest.mark.skipif(not DEBIAN_PYVERBS.is_dir(), reason="the distribution's python3-pyverbs is not installed")
def test_verbs_objects_build_with_the_real_pyverbs(tmp_path):
    """Work requests, queue-pair attributes and address handles need no device: build them with pyverbs."""
    (tmp_path / "pyverbs").symlink_to(DEBIAN_PYVERBS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))))
    out = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    if out.returncode != 0 and "No module named 'pyverbs" in out.stderr:
        pytest.skip("the distribution's pyverbs does not import here")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["wr_ids"] == [0, 0, 7] and all(r["opcodes"]) and r["sges"] == [1, 1, 1]
    assert r["signalled"] == [False, False, True]  # selective signalling: the chain's last only
    assert r["qp"] == [4, 0x33, 9, 5, 8, 8, 14, 7, 7, True]
    assert r["roce_ah"] == [1, 3, "0000:0000:0000:0000:0000:ffff:0000:0000", 1]
    assert r["ib_ah"] == [0, 17]
