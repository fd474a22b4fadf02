"""Tokenizers: bytes, tokenizer.json folders and the GGUF-embedded vocabulary, checked against transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.formats.locate import load_model
from harness.formats.tokenizer import ByteTokenizer, TokenizersTokenizer, gguf_tokenizer, load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from tests.ckpt_helpers import smollm2_gguf, write_gguf

SENTENCES = [
    "Hello world!",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "def f(x):\n    return x ** 2  # 1234567890",
    "Ünïcödé: naïve café, 日本語, emoji 🙂 and a mix'd contraction we'll see.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 6*8?"}]


# ---- bytes ---------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer(384)
    for text in SENTENCES:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.encode("é") == [0xC3, 0xA9]
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 384)


def test_byte_tokenizer_decode_skips_specials_and_replaces_broken_utf8() -> None:
    tok = ByteTokenizer(300)
    assert tok.decode([256, 104, 105, 257, 299]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"


def test_byte_tokenizer_needs_room_for_specials() -> None:
    with pytest.raises(ConfigError, match=r"vocab >= 258, got vocab=200"):
        ByteTokenizer(200)


def test_byte_tokenizer_plain_chat_format() -> None:
    text = ByteTokenizer(258).apply_chat_template(CHAT[:2])
    assert text == "system: Be brief.\nuser: What is 6*7?\nassistant: "


def test_synthetic_models_use_the_byte_tokenizer() -> None:
    tok = load_tokenizer(load_model("tiny-gqa"))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 384


# ---- tokenizer.json folders ----------------------------------------------------------------------------

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def train_tokenizer_folder(folder: Path, chat_template: Any) -> Path:
    """A small byte-level BPE trained here on the sample sentences, saved as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SENTENCES * 4, trainer)
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>",
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_hf_folder_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = train_tokenizer_folder(tmp_path / "tok", TEMPLATE)
    ours = load_tokenizer(dataclasses.replace(load_model("tiny-gqa"), source="hf", path=str(folder)))
    theirs = AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    for text in SENTENCES:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    expected = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == expected
    assert expected.startswith("<s>[system] Be brief.</s>\n") and expected.endswith("[assistant] ")


def test_hf_folder_special_tokens_written_as_objects(tmp_path: Path) -> None:
    """Older tokenizer_config.json files write special tokens as {"content": ...}; config.json ids as lists."""
    folder = train_tokenizer_folder(tmp_path / "tok", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token=None, eos_token={"__type": "AddedToken", "content": "</s>", "special": True})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": [0, 5]}))
    tok = load_tokenizer(dataclasses.replace(load_model("tiny-gqa"), source="hf", path=str(folder)))
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_hf_folder_named_templates_and_missing_template(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": TEMPLATE}]
    tok = load_tokenizer(dataclasses.replace(load_model("tiny-gqa"), source="hf",
                                             path=str(train_tokenizer_folder(tmp_path / "a", named))))
    assert tok.apply_chat_template(CHAT[:1]) == "<s>[system] Be brief.</s>\n[assistant] "
    plain = load_tokenizer(dataclasses.replace(load_model("tiny-gqa"), source="hf",
                                               path=str(train_tokenizer_folder(tmp_path / "b", None))))
    with pytest.raises(ConfigError, match=r"has no chat template"):
        plain.apply_chat_template(CHAT)


def test_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    spec = dataclasses.replace(load_model("tiny-gqa"), source="hf", path=str(tmp_path))
    with pytest.raises(ConfigError, match=rf"{tmp_path} has no tokenizer\.json"):
        load_tokenizer(spec)


# ---- GGUF ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizers() -> tuple[TokenizersTokenizer, Any]:
    path = smollm2_gguf()
    from transformers import AutoTokenizer

    ours = load_tokenizer(load_model("smollm2-135m"))
    assert isinstance(ours, TokenizersTokenizer)
    return ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_gguf_tokenizer_matches_transformers(smollm2_tokenizers: tuple[TokenizersTokenizer, Any]) -> None:
    ours, theirs = smollm2_tokenizers
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (1, 2, 49152)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    for text in SENTENCES:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("<|im_start|>user")[0] == 1  # control tokens stay whole


def test_gguf_tokenizer_from_the_conversion_cache_equals_a_fresh_parse(
        smollm2_tokenizers: tuple[TokenizersTokenizer, Any]) -> None:
    """load_tokenizer reads the converted tokenizer (harness/formats/gguf/cache.py), not the GGUF's 49k-entry
    metadata; it must be the same tokenizer as parsing the file now."""
    from harness.formats.gguf.cache import cache_folder
    from harness.formats.locate import checkpoint_path
    from harness.formats.tokenizer import parse_gguf_tokenizer

    ours, _ = smollm2_tokenizers
    path = checkpoint_path(load_model("smollm2-135m"))
    assert (cache_folder(path) / "tokenizer.json").is_file()
    fresh = parse_gguf_tokenizer(path)
    assert (fresh.bos_id, fresh.eos_id, fresh.vocab_size, fresh.chat_template) == \
        (ours.bos_id, ours.eos_id, ours.vocab_size, ours.chat_template)
    for text in [*SENTENCES, "<|im_start|>user\nhi<|im_end|>"]:
        assert fresh.encode(text) == ours.encode(text), text


def test_gguf_chat_template_matches_transformers(smollm2_tokenizers: tuple[TokenizersTokenizer, Any]) -> None:
    ours, theirs = smollm2_tokenizers
    for chat in (CHAT, CHAT[1:]):
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat) == expected
    prompt = ours.apply_chat_template(CHAT[1:2])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_gguf_without_a_supported_vocabulary(tmp_path: Path) -> None:
    spec = ModelSpec(name="small", heads=4, kv_heads=2, head_dim=8, hidden=32, layers=1, ffn=48, vocab=300)
    path = write_gguf(tmp_path / "m.gguf", spec, load_weights(spec), "llama")
    with pytest.raises(ConfigError, match=r"m\.gguf: tokenizer model None is not supported"):
        gguf_tokenizer(path)
