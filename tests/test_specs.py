"""Spec parsing: topology names and YAML catalogs, model specs, suites."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.checks.catalog import sections as registered_sections
from harness.checks.settings import load_suite
from harness.core.errors import ConfigError
from harness.formats.locate import load_model
from harness.specs.model import ModelSpec, model_from_dict, shipped_models
from harness.specs.suite import Suite, shipped_suites
from harness.specs.topology import Topology, load_catalog, parse_topology_name

# ----------------------------------------------------------------------------- topologies


@pytest.mark.parametrize("name,tp,dcp,speculator,canonical", [
    ("tp1", 1, 1, "none", "tp1"),
    ("tp4", 4, 1, "none", "tp4"),
    ("tp4dcp4", 4, 4, "none", "tp4dcp4"),
    ("tp8dcp2-mtp", 8, 2, "mtp", "tp8dcp2-mtp"),
    ("tp4-draft", 4, 1, "draft", "tp4-draft"),
    ("tp4dcp1", 4, 1, "none", "tp4"),
    ("tp12dcp3-draft", 12, 3, "draft", "tp12dcp3-draft"),
])
def test_topology_names(name: str, tp: int, dcp: int, speculator: str, canonical: str) -> None:
    topo = parse_topology_name(name)
    assert (topo.tp, topo.dcp, topo.speculator) == (tp, dcp, speculator)
    assert topo.name == name
    assert topo.canonical_name == canonical
    assert topo.world_size == tp
    assert topo.to_dict() == {"name": name, "tp": tp, "dcp": dcp, "speculator": speculator, "world_size": tp}
    assert parse_topology_name(canonical).canonical_name == canonical


def test_topology_without_speculator_and_default_name() -> None:
    topo = parse_topology_name("tp4dcp2-mtp").without_speculator()
    assert topo == Topology(tp=4, dcp=2)
    assert topo.name == "tp4dcp2" and topo.speculator == "none"


@pytest.mark.parametrize("name", ["", "tp", "dp4", "tp4dcp", "TP4", "tp4_dcp2", "tp-4", "tp4dcp2mtp", "tp4 dcp2"])
def test_bad_topology_names_name_the_grammar(name: str) -> None:
    grammar = r"tp<N>\[dcp<M>\[i<K>\|c\]\[q\]\]\[dp<D>\]\[ep<E>\]\[-draft\|-mtp\]"
    with pytest.raises(ConfigError, match=r"bad topology name .*expected " + grammar):
        parse_topology_name(name)


def test_bad_speculator_suffix_suggests() -> None:
    with pytest.raises(ConfigError, match=r"-drfat is not -draft or -mtp \(did you mean 'draft'\?\)"):
        parse_topology_name("tp4-drfat")
    with pytest.raises(ConfigError, match="-none is not -draft or -mtp"):
        parse_topology_name("tp4-none")


@pytest.mark.parametrize("name,message", [
    ("tp0", "tp=0 must be >= 1"),
    ("tp4dcp0", "dcp=0 must be >= 1"),
    ("tp4dcp3", r"dcp=3 does not divide tp=4; valid dcp values: \[1, 2, 4\]"),
    ("tp6dcp4-mtp", r"dcp=4 does not divide tp=6; valid dcp values: \[1, 2, 3, 6\]"),
])
def test_invalid_topology_numbers(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_topology_name(name)


@pytest.mark.parametrize("name,tp,dcp,ep,speculator,canonical", [
    ("tp4ep4", 4, 1, 4, "none", "tp4ep4"),
    ("tp4dcp2ep4", 4, 2, 4, "none", "tp4dcp2ep4"),
    ("tp4ep2-mtp", 4, 1, 2, "mtp", "tp4ep2-mtp"),
    ("tp2ep1", 2, 1, 1, "none", "tp2"),
])
def test_expert_parallel_topology_names(name: str, tp: int, dcp: int, ep: int, speculator: str,
                                        canonical: str) -> None:
    topo = parse_topology_name(name)
    assert (topo.tp, topo.dcp, topo.ep, topo.speculator, topo.world_size) == (tp, dcp, ep, speculator, tp)
    assert topo.canonical_name == canonical
    assert Topology.from_dict(topo.to_dict()) == topo
    assert ("ep" in topo.to_dict()) == (ep > 1)  # topologies without EP keep their dict
    assert topo.without_speculator().ep == ep


@pytest.mark.parametrize("name,message", [
    ("tp4ep3", r"ep=3 does not divide the world \(tp=4\); valid ep values: \[1, 2, 4\]"),
    ("tp4ep0", "ep=0 must be >= 1"),
    ("tp2dcp2ep4-mtp", r"ep=4 does not divide the world \(tp=2\)"),
])
def test_invalid_expert_parallel(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_topology_name(name)


def test_topology_dataclass_validates_itself() -> None:
    with pytest.raises(ConfigError, match="dcp=3 does not divide tp=8"):
        Topology(tp=8, dcp=3)
    with pytest.raises(ConfigError, match=r"speculator='mpt' is not one of none, draft, mtp \(did you mean 'mtp'\?\)"):
        Topology(tp=2, speculator="mpt")
    with pytest.raises(ConfigError, match="tp must be an integer"):
        Topology(tp="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tp must be an integer"):
        Topology(tp=True)  # type: ignore[arg-type]


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_catalog_topologies_and_sets_from_yaml(tmp_path: Path) -> None:
    _write(tmp_path, "a.yaml", """
topologies:
  ref: {tp: 1}
  wide: {tp: 8, dcp: 2, speculator: mtp}
  short: tp4dcp4
sets:
  small: [ref, tp2, short]
  nightly: [small, wide, tp4dcp4]
""")
    _write(tmp_path, "b.yaml", "sets:\n  other: [tp3, tp9dcp3]\n")
    _write(tmp_path, "ignored.yml", "this: [is not read\n")
    cat = load_catalog((tmp_path,))
    assert set(cat.topologies) == {"ref", "wide", "short"}
    assert cat.topologies["wide"] == Topology(tp=8, dcp=2, speculator="mtp", name="wide")
    assert cat.topologies["wide"].canonical_name == "tp8dcp2-mtp"
    assert (cat.topologies["short"].tp, cat.topologies["short"].dcp, cat.topologies["short"].name) == (4, 4, "short")
    assert cat.sets == {"small": ("ref", "tp2", "short"), "nightly": ("small", "wide", "tp4dcp4"),
                        "other": ("tp3", "tp9dcp3")}

    # Sets expand recursively, in order; a configuration given twice (by any name) runs once.
    names = [t.name for t in cat.resolve("nightly")]
    assert names == ["ref", "tp2", "short", "wide"]
    assert [t.name for t in cat.resolve("tp4,tp4dcp1,ref,tp1")] == ["tp4", "ref"]
    names = [t.name for t in cat.resolve("tp2, small,tp2,other ,small")]
    assert names == ["tp2", "ref", "short", "tp3", "tp9dcp3"]
    # Plain grammar names work without being listed.
    assert [t.canonical_name for t in cat.resolve("tp8dcp8-draft")] == ["tp8dcp8-draft"]


def test_catalog_resolve_all(tmp_path: Path) -> None:
    _write(tmp_path, "t.yaml", "sets:\n  pair: [tp2, tp4]\n")
    cat = load_catalog((tmp_path,))
    assert [t.name for t in cat.resolve("all", all_names=("pair", "tp8", "tp4"))] == ["tp2", "tp4", "tp8"]
    assert [t.name for t in cat.resolve("tp1,all", all_names=("tp2",))] == ["tp1", "tp2"]
    with pytest.raises(ConfigError, match="--topo all needs a suite"):
        cat.resolve("all")


@pytest.mark.parametrize("expr,message", [
    ("", "empty topology list"),
    (" , ", "empty topology list"),
    ("pairr", r"unknown topology or set 'pairr' \(did you mean 'pair'\?\)"),
    ("tp4,nope", r"unknown topology or set 'nope'.*a set: pair"),
    ("tp4dcp3", "dcp=3 does not divide tp=4"),
])
def test_catalog_resolve_errors(tmp_path: Path, expr: str, message: str) -> None:
    _write(tmp_path, "t.yaml", "sets:\n  pair: [tp2, tp4]\n")
    with pytest.raises(ConfigError, match=message):
        load_catalog((tmp_path,)).resolve(expr)


@pytest.mark.parametrize("text,message", [
    ("topologies:\n  x: {tp: 4, dcpp: 2}\n", r"topology x: unknown key 'dcpp' \(did you mean 'dcp'\?\)"),
    ("topologies:\n  x: {dcp: 2}\n", "topology x: missing required key 'tp'"),
    ("topologies:\n  x: {tp: 4, dcp: 3}\n", "dcp=3 does not divide tp=4"),
    ("topologies:\n  x: tp4dcp\n", "bad topology name 'tp4dcp'"),
    ("set:\n  a: [tp2]\n", r"unknown key 'set' \(did you mean 'sets'\?\); valid keys: sets, topologies"),
    ("sets:\n  a: tp2\n", "set 'a' must be a list of topology names"),
    ("sets:\n  a: [tp2, 4]\n", "set 'a' must be a list of topology names"),
    ("sets:\n  a: [tp2, tp4dpc2]\n", "unknown topology or set 'tp4dpc2'"),
    ("sets:\n  a: [tp2, a]\n", "topology set 'a' includes itself"),
    ("sets:\n  a: [tp2, b]\n  b: [a]\n", "topology set '[ab]' includes itself"),
    ("sets:\n  a: [tp2, all]\n", "--topo all needs a suite"),
    ("- tp2\n", "expected a mapping"),
    ("sets: [tp2\n", "invalid YAML"),
])
def test_catalog_yaml_errors(tmp_path: Path, text: str, message: str) -> None:
    _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match=message):
        load_catalog((tmp_path,))


def test_catalog_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.yaml", "topologies:\n  x: {tp: 4, dpc: 2}\n")
    with pytest.raises(ConfigError) as info:
        load_catalog((tmp_path,))
    assert str(info.value).startswith(f"{path}: topology x: unknown key 'dpc'")


def test_shipped_catalog_sets_resolve() -> None:
    cat = load_catalog()
    assert [t.name for t in cat.resolve("dcp-nightly")] == ["tp4dcp2", "tp4dcp4", "tp8dcp2", "tp8dcp4", "tp4dcp2i4",
                                                       "tp4dcp2c", "tp8dcp8"]
    assert "tp8dcp8" in [t.name for t in cat.resolve("mla-nightly")]
    assert cat.topologies["reference"].canonical_name == "tp1"
    for name in cat.sets:
        assert cat.resolve(name)


# ----------------------------------------------------------------------------- models

TINY = {"heads": 8, "kv_heads": 2, "head_dim": 16, "hidden": 128, "layers": 2, "ffn": 288, "vocab": 384}


@pytest.mark.parametrize("name,heads,kv", [
    ("tiny-gqa", 8, 2), ("tiny-kv6", 24, 6), ("tiny-mqa", 8, 1), ("tiny-9h3kv", 9, 3)])
def test_required_shipped_models(name: str, heads: int, kv: int) -> None:
    model = load_model(name)
    assert (model.name, model.heads, model.kv_heads) == (name, heads, kv)
    assert model.source == "synthetic"


@pytest.mark.parametrize("name", sorted(shipped_models()))
def test_every_shipped_model_loads(name: str) -> None:
    model = load_model(name)
    assert isinstance(model, ModelSpec) and model.name == name
    assert model.heads % model.kv_heads == 0
    shape = model.attention_shape
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.layers) == (
        model.heads, model.kv_heads, model.head_dim, model.layers)
    assert shape.dtype_bytes == {"float32": 4, "bfloat16": 2, "float16": 2}[model.dtype]
    assert model.speculator_shape.layers == model.speculator_layers  # an MLA model's: latent attention layers
    assert model.speculator_shape.heads == model.heads
    assert set(model.to_dict()) >= {"heads", "kv_heads", "head_dim", "hidden", "layers", "ffn", "vocab",
                                    "rope_theta", "norm_eps", "tied_embeddings", "qkv_bias", "dtype"}


def test_model_from_yaml_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "my-model.yaml",
                  "heads: 12\nkv_heads: 4\nhead_dim: 8\nhidden: 96\nlayers: 1\nffn: 64\nvocab: 300\n"
                  "dtype: bfloat16\ntied_embeddings: true\n")
    model = load_model(str(path))
    assert model.name == "my-model" and model.heads == 12 and model.kv_heads == 4
    assert model.dtype == "bfloat16" and model.dtype_bytes == 2 and model.tied_embeddings
    assert model.with_dtype("float32").dtype_bytes == 4


def test_model_unknown_name_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'tiny-gq' \(did you mean 'tiny-gqa'\?\)"):
        load_model("tiny-gq")
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize("changes,message", [
    ({"heads": 9, "kv_heads": 2}, "heads=9 is not divisible by kv_heads=2"),
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"kv_heads": 0}, "kv_heads=0 must be >= 1"),
    ({"heads": True}, "heads must be an integer"),
    ({"vocab": "384"}, "vocab must be an integer"),
    ({"dtype": "bfloat"}, r"dtype='bfloat' is not one of float32, bfloat16, float16 \(did you mean 'bfloat16'\?\)"),
    ({"dtype": "float23"}, r"\(did you mean 'float32'\?\)"),
    ({"source": "hf"}, "source=hf needs a path"),
    ({"source": "package"}, "source=package needs a package name"),
    ({"source": "gguff", "path": "x.gguf"}, r"\(did you mean 'gguf'\?\)"),
    ({"rope_theta": 0}, "must be > 0"),
    ({"kv_head": 2}, r"unknown key 'kv_head' \(did you mean 'kv_heads'\?\)"),
    ({"num_layers": 2}, r"unknown key 'num_layers'"),
])
def test_model_spec_validation(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_from_dict("test", {**TINY, **changes}, name="m")


def test_model_missing_key() -> None:
    data = dict(TINY)
    del data["vocab"]
    with pytest.raises(ConfigError, match="missing required key 'vocab'"):
        model_from_dict("test", data, name="m")


def test_model_yaml_unknown_key_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "m.yaml", "".join(f"{k}: {v}\n" for k, v in TINY.items()) + "hiden: 3\n")
    with pytest.raises(ConfigError, match=r"m\.yaml: unknown key 'hiden' \(did you mean 'hidden'\?\)"):
        load_model(str(path))


# ----------------------------------------------------------------------------- suites

SUITE = """
name: s
version: 1
models: [tiny-gqa]
topologies: [tp2, tp4dcp2]
prompts: ["hello"]
checks:
  layout: {}
  logits: {}
"""


@pytest.mark.parametrize("name", ["dcp", "tp", "gqa-odd"])
def test_shipped_suites_load_and_resolve(name: str) -> None:
    assert name in shipped_suites()
    suite = load_suite(name)
    assert suite.name == name and suite.version >= 1
    assert suite.models and suite.topologies and suite.prompts
    assert set(suite.checks) <= set(registered_sections())
    catalog = load_catalog()
    topos = catalog.resolve(",".join(suite.topologies))
    assert topos and len({t.name for t in topos}) == len(topos)
    assert [t.tp for t in catalog.resolve(suite.reference)] == [1]
    assert catalog.resolve("all", all_names=suite.topologies) == topos
    for model in suite.models:
        assert load_model(model).name == model


def test_dcp_suite_covers_the_sglang_cell() -> None:
    topos = load_catalog().resolve(",".join(load_suite("dcp").topologies))
    assert "tp4dcp4" in [t.canonical_name for t in topos]


def test_suite_from_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "mine.yaml", SUITE)
    suite = load_suite(str(path))
    assert isinstance(suite, Suite)
    assert suite.name == "s" and suite.models == ("tiny-gqa",) and suite.topologies == ("tp2", "tp4dcp2")
    assert suite.reference == "tp1" and suite.seeds == (0,)
    assert suite.check_settings("logits") == {} and suite.check_settings("gsm8k") == {}
    path2 = _write(tmp_path, "noname.yaml", SUITE.replace("name: s\n", ""))
    assert load_suite(str(path2)).name == "noname"


@pytest.mark.parametrize("old,new,message", [
    ("  logits: {}", "  logit: {}", r"unknown check 'logit' \(did you mean 'logits'\?\); valid checks: inputs, layout"),
    ("topologies:", "topology:", r"unknown key 'topology' \(did you mean 'topologies'\?\)"),
    ("version: 1", "version: 0", "version=0 must be >= 1"),
    ("models: [tiny-gqa]", "models: tiny-gqa", "models must be a list"),
    ("models: [tiny-gqa]", "models: []", "models is empty"),
    ('prompts: ["hello"]', "prompts: []", "needs prompts or gsm8k settings"),
    ("  logits: {}", "  logits: 3", "settings of check 'logits' must be a mapping"),
    ("version: 1\n", "", "missing required key 'version'"),
])
def test_suite_errors(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in SUITE
    path = _write(tmp_path, "bad.yaml", SUITE.replace(old, new))
    with pytest.raises(ConfigError, match=message):
        load_suite(str(path))


def test_unknown_suite_suggests() -> None:
    with pytest.raises(ConfigError, match=r"unknown suite 'dpc' \(did you mean 'dcp'\?\)"):
        load_suite("dpc")
