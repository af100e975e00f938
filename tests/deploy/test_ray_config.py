"""gear_ray's parts that need no Ray: the per-node configuration, the TOML it writes, the choice of nodes, and its
place in the layering (above gear_server and gear_client, through their public names only)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from gear_ray.config import ConfigError, config_document, node_document, render_toml, select_nodes
from gear_server.config import load_config, parse_config
from tests.support.paths import ROOT

EXAMPLES = [ROOT / "deploy" / "gear-server.example.toml", ROOT / "deploy" / "sharding" / "gear-shard.toml",
            ROOT / "deploy" / "slurm" / "gear-shard.toml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_toml_written_reads_back_as_the_same_document(path, tmp_path):
    document = config_document(path)
    text = render_toml(document)
    assert tomllib.loads(text) == document
    (tmp_path / "out.toml").write_text(text)
    assert load_config(tmp_path / "out.toml").server == parse_config(document).server


def test_awkward_values_survive_the_round_trip():
    document = {"port": 1, "instance_name": 'a "quoted"\\ name\twith\ncontrol', "max_workers": 4,
                "tables": [{"name": "t", "sampler": {"prioritized": {"priority_exponent": 0.5}}, "max_size": 3,
                            "rate_limiter": {"explicit": {"samples_per_insert": 1.0, "min_size_to_sample": 1,
                                                          "min_diff": float("-inf"), "max_diff": 1e300}},
                            "signature": {"a b": {"dtype": "float32", "shape": [-1, 2]}}}],
                "logging": {"loggers": {"grpc.server": "WARNING"}}}
    assert tomllib.loads(render_toml(document)) == document


def test_each_node_gets_its_port_and_folders_and_always_restores(tmp_path):
    document = config_document(EXAMPLES[0])
    node = node_document(document, port=8123, checkpoint_dir=str(tmp_path / "ckpt"), shm_dir=str(tmp_path / "shm"))
    settings = parse_config(node)
    assert settings.server.port == 8123 and settings.server.shm_dir == str(tmp_path / "shm")
    assert settings.checkpoint.dir == str(tmp_path / "ckpt")
    assert settings.checkpoint.restore and settings.checkpoint.on_stop
    assert settings.checkpoint.interval_s == document["checkpoint"]["interval_s"]  # the operator's choice kept
    assert document["port"] == 8000  # the shared document is not changed
    bare = node_document({"tables": document["tables"]}, port=0, checkpoint_dir="/c")
    assert parse_config(bare).checkpoint.dir == "/c"


def test_a_bad_config_is_refused_with_the_key_named(tmp_path):
    with pytest.raises(ConfigError, match="max_size"):
        config_document('[[tables]]\nname = "t"\nmax_size = 0\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        config_document("port = = 1\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        config_document(str(tmp_path / "missing.toml"))
    with pytest.raises(TypeError):
        config_document(42)


NODES = [
    {"NodeID": "n3", "Alive": True, "Resources": {"CPU": 8, "GPU": 8}, "Labels": {"pool": "learners"}},
    {"NodeID": "n1", "Alive": True, "Resources": {"CPU": 8, "GPU": 4, "gear": 1}, "Labels": {"pool": "replay"}},
    {"NodeID": "n2", "Alive": True, "Resources": {"CPU": 8}, "Labels": {"pool": "replay"}},
    {"NodeID": "n4", "Alive": False, "Resources": {"CPU": 8, "GPU": 8, "gear": 1}, "Labels": {"pool": "replay"}},
]


def test_nodes_are_chosen_by_gpus_resource_labels_or_id():
    assert select_nodes(NODES) == ["n1", "n3"]  # alive nodes with GPUs, in a stable order
    assert select_nodes(NODES, resource="gear") == ["n1"]
    assert select_nodes(NODES, labels={"pool": "replay"}) == ["n1", "n2"]
    assert select_nodes(NODES, node_ids=["n2", "n3"]) == ["n2", "n3"]
    with pytest.raises(ValueError, match="no alive Ray node with id"):
        select_nodes(NODES, node_ids=["n4"])
    with pytest.raises(ValueError, match="resource 'tpu'"):
        select_nodes(NODES, resource="tpu")
    with pytest.raises(ValueError, match="GPUs"):
        select_nodes([n for n in NODES if "GPU" not in n["Resources"]])


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) of every import in a file (name None for ``import module``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.module, alias.name) for alias in node.names]
    return out


def test_gear_ray_stands_above_server_and_client_through_public_names():
    for path in sorted((ROOT / "gear_ray").glob("*.py")):
        for module, name in _imports(path):
            if module.split(".")[0] in ("gear_contract", "gear_kernels", "gear_server", "gear_client"):
                assert not any(part.startswith("_") for part in module.split(".")), f"{path.name}: {module}"
                assert not (name or "").startswith("_"), f"{path.name}: {module}.{name}"
                assert module.split(".")[0] in ("gear_server", "gear_client"), f"{path.name}: {module}"
    for top in ("gear_contract", "gear_kernels", "gear_server", "gear_client"):
        for path in sorted((ROOT / top).rglob("*.py")):
            assert not any(m.split(".")[0] == "gear_ray" for m, _ in _imports(path)), path
