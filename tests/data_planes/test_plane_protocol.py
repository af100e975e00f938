"""Every data plane implements its Plane protocol: the sampler talks to planes only through them."""

from __future__ import annotations

import inspect

import pytest

from gear_client.data_planes import plane as plane_protocols
from gear_client.data_planes import sampler as sampler_module
from gear_client.data_planes.inline import InlinePlane
from gear_client.data_planes.nixl import NixlPlane
from gear_client.data_planes.plane import Plane, ReadingPlane, SamplingPlane
from gear_client.data_planes.rdma import RdmaPlane
from gear_client.data_planes.shm import ShmPlane
from gear_client.data_planes.stream import StreamPlane


def members(protocol: type) -> dict[str, inspect.Signature]:
    """The methods a protocol asks for (its own and its bases'), with their signatures."""
    out = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and callable(value):
                out[name] = inspect.signature(value)
    return out


@pytest.mark.parametrize(("protocol", "cls", "kind"), [(ReadingPlane, ShmPlane, "shm"),
                                                       (ReadingPlane, RdmaPlane, "rdma"),
                                                       (ReadingPlane, NixlPlane, "nixl"),
                                                       (ReadingPlane, StreamPlane, "stream"),
                                                       (SamplingPlane, InlinePlane, "inline")])
def test_each_plane_implements_its_protocol_with_the_same_parameters(protocol, cls, kind):
    assert Plane in protocol.__mro__
    wanted = members(protocol)
    assert {"cancel", "close"} <= set(wanted)
    for name, signature in wanted.items():
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(signature.parameters), f"{cls.__name__}.{name}{got} vs {signature}"
    assert cls.kind == kind
    assert "layout" in inspect.get_annotations(Plane)


def test_the_sampler_uses_no_getattr_and_no_sentinel_objects():
    source = inspect.getsource(sampler_module)
    assert "getattr(" not in source and "= object()" not in source
    assert "Any" not in inspect.getsource(plane_protocols)
