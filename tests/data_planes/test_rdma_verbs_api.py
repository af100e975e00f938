"""gear_contract.rdma_verbs against both pyverbs APIs (fake modules shaped like each), QP depths, SL and traffic class.

pyverbs < 59 keeps its constants in ``pyverbs.enums`` (module attributes);
rdma-core 59 removed that module: ``pyverbs.libibverbs_enums`` holds one enum
class per C enum (``ibv_qp_type.IBV_QPT_RC``), anonymous enums as module
attributes (``IBV_LINK_LAYER_ETHERNET``). The values below are libibverbs'.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from gear_contract import addressing as ad
from gear_contract import rdma_verbs as verbs
from gear_contract._proto import replay_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
VALUES = {"IBV_PORT_ACTIVE": 4, "IBV_LINK_LAYER_ETHERNET": 2, "IBV_GID_TYPE_SYSFS_ROCE_V2": 1,
          "IBV_ACCESS_LOCAL_WRITE": 1, "IBV_ACCESS_REMOTE_READ": 4, "IBV_QPT_RC": 2, "IBV_WC_SUCCESS": 0,
          "IBV_WR_RDMA_READ": 4, "IBV_SEND_SIGNALED": 2}
ENUM_CLASSES = {"ibv_port_state": ["IBV_PORT_ACTIVE"], "ibv_gid_type_sysfs": ["IBV_GID_TYPE_SYSFS_ROCE_V2"],
                "ibv_access_flags": ["IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ"],
                "ibv_qp_type": ["IBV_QPT_RC"], "ibv_wc_status": ["IBV_WC_SUCCESS"],
                "ibv_wr_opcode": ["IBV_WR_RDMA_READ"], "ibv_send_flags": ["IBV_SEND_SIGNALED"]}
EXPECTED = {"port_active": 4, "link_layer_ethernet": 2, "gid_type_roce_v2": 1, "access_local_write": 1,
            "access_remote_read": 4, "qpt_rc": 2, "wc_success": 0, "wr_rdma_read": 4, "send_signaled": 2}


def _new_enums_module() -> types.ModuleType:
    """Shaped like pyverbs.libibverbs_enums (rdma-core >= 59): IntEnum classes, anonymous enums flat."""
    module = types.ModuleType("pyverbs.libibverbs_enums")
    for class_name, names in ENUM_CLASSES.items():
        setattr(module, class_name, enum.IntEnum(class_name, {n: VALUES[n] for n in names}))
    module.IBV_LINK_LAYER_ETHERNET = VALUES["IBV_LINK_LAYER_ETHERNET"]
    return module


def _old_enums_module() -> types.ModuleType:
    module = types.ModuleType("pyverbs.enums")
    for name, value in VALUES.items():
        setattr(module, name, value)
    return module


def _install(monkeypatch, new: types.ModuleType | None, old: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, "pyverbs", types.ModuleType("pyverbs"))
    # A None entry makes "import x" raise ImportError, as for a module the package does not have.
    monkeypatch.setitem(sys.modules, verbs.NEW_ENUMS_MODULE, new)
    monkeypatch.setitem(sys.modules, verbs.OLD_ENUMS_MODULE, old)


def _fields(e: verbs.VerbsEnums) -> dict[str, int]:
    return {name: getattr(e, name) for name in EXPECTED}


def test_enums_resolve_from_pyverbs_59_libibverbs_enums(monkeypatch):
    _install(monkeypatch, _new_enums_module(), None)
    resolved = verbs.resolve_enums()
    assert resolved.source == "pyverbs.libibverbs_enums" and _fields(resolved) == EXPECTED


def test_enums_resolve_from_older_pyverbs_enums(monkeypatch):
    _install(monkeypatch, None, _old_enums_module())
    resolved = verbs.resolve_enums()
    assert resolved.source == "pyverbs.enums" and _fields(resolved) == EXPECTED


def test_a_pyverbs_without_either_module_or_a_constant_is_reported_too_old(monkeypatch):
    _install(monkeypatch, None, None)
    with pytest.raises(verbs.PyverbsTooOldError, match="no enum module") as info:
        verbs.resolve_enums()
    assert "too old" in verbs._import_failure(info.value)
    incomplete = _new_enums_module()
    del incomplete.ibv_send_flags
    _install(monkeypatch, incomplete, None)
    with pytest.raises(verbs.PyverbsTooOldError, match="lacks IBV_SEND_SIGNALED"):
        verbs.resolve_enums()


def test_a_missing_pyverbs_is_reported_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)
    with pytest.raises(ModuleNotFoundError) as info:
        verbs.resolve_enums()
    assert verbs._import_failure(info.value).startswith("pyverbs missing")


# A pyverbs 59 package on disk: the new enum module, no pyverbs.enums, and the classes
# gear_contract.rdma_verbs imports, recording what they are built with (no device, no libibverbs).
_FAKE_PYVERBS = {
    "__init__.py": "",
    "pyverbs_error.py": "class PyverbsError(Exception):\n    pass\n",
    "device.py": "class Context:\n    def __init__(self, **kw):\n        raise RuntimeError('no device')\n"
                 "def get_device_list():\n    return []\n",
    "addr.py": textwrap.dedent("""
        class _Record:
            def __init__(self, **kw):
                self.__dict__.update(kw)
        class GID(_Record):
            pass
        class GlobalRoute(_Record):
            pass
        class AHAttr(_Record):
            pass
    """),
    "qp.py": textwrap.dedent("""
        class QPAttr:
            def __init__(self, **kw):
                self.__dict__.update(kw)
        class QP: pass
        class QPCap: pass
        class QPInitAttr: pass
    """),
    "cq.py": "class CQ: pass\n", "mr.py": "class MR: pass\n", "pd.py": "class PD: pass\n",
    "wr.py": "class SGE: pass\nclass SendWR: pass\n",
}

_CHECK = """
import json
from gear_contract import addressing as ad
from gear_contract import rdma_verbs as verbs
from gear_contract._proto import replay_pb2 as pb
from gear_server.data_planes.rdma_server import RdmaServer
from gear_server.data_planes.settings import DataPlaneSettings
local = ad.PortInfo("mlx5_0", 1, "Ethernet", 0, bytes(10) + b"\\xff\\xff" + bytes(4), 3, 5, 1 << 30,
                    max_qp_rd_atom=16, max_qp_init_rd_atom=4, service_level=3, traffic_class=106)
peer = local.endpoint([0x33], [9])
av = ad.address_vector(local, peer)
attr = verbs.rts_attr(1, verbs.E.access_remote_read, 0x33, 9, 5, av, 4, ad.rd_atomic(local, peer),
                      dest_rd_atomic=ad.responder_depth(local))
print(json.dumps({
    "reason": verbs.unavailable_reason(), "source": verbs.E.source,
    "open": RdmaServer.open(DataPlaneSettings()),
    "max_rd_atomic": attr.max_rd_atomic, "max_dest_rd_atomic": attr.max_dest_rd_atomic,
    "sl": attr.ah_attr.sl, "traffic_class": attr.ah_attr.gr.traffic_class, "sgid": attr.ah_attr.gr.sgid_index,
}))
"""


def test_with_a_pyverbs_59_layout_rdma_is_offered_when_a_device_is_there(tmp_path):
    """Today's rdma-core: the module imports (no silent ImportError); without a device the reason says so."""
    package = tmp_path / "pyverbs"
    package.mkdir()
    for name, text in _FAKE_PYVERBS.items():
        (package / name).write_text(text)
    (package / "libibverbs_enums.py").write_text(
        "import enum\n" + "".join(f"{c} = enum.IntEnum({c!r}, {{{', '.join(f'{n!r}: {VALUES[n]}' for n in ns)}}})\n"
                                  for c, ns in ENUM_CLASSES.items())
        + f"IBV_LINK_LAYER_ETHERNET = {VALUES['IBV_LINK_LAYER_ETHERNET']}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))))
    env = {k: v for k, v in env.items() if not k.startswith("GEAR_RDMA_")}
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["reason"] is None and r["source"] == "pyverbs.libibverbs_enums"
    assert r["open"] == [None, "no RDMA device"]
    # The requester issues what its device may initiate (4), the responder serves what it advertised (16).
    assert (r["max_rd_atomic"], r["max_dest_rd_atomic"]) == (4, 16)
    assert (r["sl"], r["traffic_class"], r["sgid"]) == (3, 106, 3)


def test_requester_depth_is_bounded_by_max_qp_init_rd_atom():
    local = ad.PortInfo("mlx5_0", 1, "IB", 3, bytes(16), 0, 5, 1 << 30, max_qp_rd_atom=16, max_qp_init_rd_atom=2)
    peer = pb.RdmaEndpoint(max_rd_atomic=8)
    assert ad.rd_atomic(local, peer) == 2  # not min(max_qp_rd_atom, 8) = 8: the device would refuse it
    assert ad.responder_depth(local) == 16 and local.endpoint([1], [1]).max_rd_atomic == 16
    assert ad.rd_atomic(ad.PortInfo("m", 1, "IB", 3, bytes(16), 0, 5, 1, max_qp_init_rd_atom=16), peer) == 8


def test_service_level_and_traffic_class_come_from_the_port_and_are_checked(monkeypatch):
    local = ad.PortInfo("mlx5_0", 1, "IB", 3, bytes(16), 0, 5, 1 << 30, service_level=5, traffic_class=96)
    av = ad.address_vector(local, pb.RdmaEndpoint(link_layer="IB", lid=9))
    assert (av.sl, av.traffic_class, av.is_global) == (5, 96, False)
    monkeypatch.setenv(verbs.ENV_SERVICE_LEVEL, "16")
    with pytest.raises(ValueError, match="GEAR_RDMA_SL=16"):
        verbs.probe()
    monkeypatch.setenv(verbs.ENV_SERVICE_LEVEL, "3")
    monkeypatch.setenv(verbs.ENV_TRAFFIC_CLASS, "lossless")
    with pytest.raises(ValueError, match="GEAR_RDMA_TRAFFIC_CLASS"):
        verbs.probe()
