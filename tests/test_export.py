"""`harness export`: the folder loads in transformers with the embedded engine's logits and token ids,
and loads back into the embedded engine with the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights, weights_hash

TEXTS = ["The capital of France is", "héllo wörld\n\tdef f(x): return x"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny-gqa"
    assert main(["export", "--model", "tiny-gqa", "--out", str(out)]) == 0
    return out


def test_export_loads_back_into_the_embedded_engine(exported: Path) -> None:
    original, loaded = load_model("tiny-gqa"), load_model(str(exported))
    assert loaded.source == "hf"
    assert weights_hash(load_weights(loaded)) == weights_hash(load_weights(original))
    ours, theirs = load_tokenizer(original), load_tokenizer(loaded)
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text)
        assert theirs.decode(ours.encode(text) + [258, 257]) == text
    assert (theirs.bos_id, theirs.eos_id) == (ours.bos_id, ours.eos_id)


def test_transformers_matches_the_embedded_engine(exported: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = load_model("tiny-gqa")
    engine = Engine(spec, load_weights(spec), ParallelState.single())
    tokenizer = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        ours = engine.prefill_logits([ids])[0]  # [T, V]
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]  # [T, V]
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)


def test_export_refuses_a_non_empty_folder(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--model", "tiny-gqa", "--out", str(exported)]) == 2
    assert "is not empty" in capsys.readouterr().err
