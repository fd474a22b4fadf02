"""Tokenizers: bytes for synthetic models, tokenizer.json for Hugging Face folders, the vocabulary in a GGUF.

encode() never adds special tokens; decode() drops special tokens (BOS/EOS/control), so generated
text reads the same from every tokenizer kind. apply_chat_template() returns the prompt text with the
assistant turn opened (add_generation_prompt=True).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Sequence

from harness.core.errors import ConfigError
from harness.formats.gguf.file import field, open_gguf
from harness.formats.hf.config import read_json
from harness.formats.locate import checkpoint_path
from harness.specs.model import ModelSpec

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_VOCAB_MIN = 258
GGUF_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
GGUF_TOKEN_USER_DEFINED = 4
# llama.cpp pre-tokenizer names whose split is GPT-2's regex (what ByteLevel(use_regex=True) does)
GGUF_GPT2_PRE_TOKENIZERS: tuple[str, ...] = ("default", "gpt2", "smollm")


class Tokenizer(Protocol):
    eos_id: int | None
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


def plain_chat(messages: list[dict[str, str]]) -> str:
    """A template-free chat prompt: 'role: content' lines, then an open assistant turn."""
    lines = [f"{message['role']}: {message['content']}\n" for message in messages]
    return "".join(lines) + "assistant: "


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS 256, EOS 257; ids above 257 exist in the model but decode to nothing."""

    def __init__(self, vocab: int) -> None:
        if vocab < BYTE_VOCAB_MIN:
            raise ConfigError(f"the byte tokenizer needs vocab >= {BYTE_VOCAB_MIN}, got vocab={vocab}")
        self.vocab_size = vocab
        self.bos_id: int | None = BYTE_BOS
        self.eos_id: int | None = BYTE_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_BOS).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return plain_chat(messages)


def _raise_exception(message: str) -> None:
    raise ConfigError(f"chat template: {message}")


def render_chat_template(template: str, messages: list[dict[str, str]], special: dict[str, str]) -> str:
    """Render a Hugging Face style Jinja chat template with the assistant turn opened."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)
    except TemplateError as exc:
        raise ConfigError(f"chat template failed to render: {exc}") from exc


class TokenizersTokenizer:
    """A `tokenizers.Tokenizer` with special ids and an optional Jinja chat template."""

    def __init__(self, backend: Any, eos_id: int | None, bos_id: int | None,
                 chat_template: str | None, source: str) -> None:
        self.backend = backend
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.source = source

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=True))

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else str(self.backend.id_to_token(token_id) or "")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise ConfigError(f"{self.source} has no chat template")
        special = {"bos_token": self._token(self.bos_id), "eos_token": self._token(self.eos_id)}
        return render_chat_template(self.chat_template, messages, special)


# ---- Hugging Face folders ------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    """A token id from config.json, which may hold a list of them."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _special_id(backend: Any, key: str, tok_config: dict[str, Any], config: dict[str, Any]) -> int | None:
    """tokenizer_config.json's `{key}_token`, else config.json's `{key}_token_id`."""
    content = _token_content(tok_config.get(f"{key}_token"))
    token_id = backend.token_to_id(content) if content else None
    return token_id if token_id is not None else _first_id(config.get(f"{key}_token_id"))


def _hf_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def hf_tokenizer(folder: Path) -> TokenizersTokenizer:
    """The tokenizer.json of a Hugging Face folder, with ids and template from its JSON configs."""
    from tokenizers import Tokenizer as Backend

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"checkpoint folder {folder} has no tokenizer.json")
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
        raise ConfigError(f"{path}: not a readable tokenizer.json: {exc}") from exc
    tok_config = _optional_json(folder / "tokenizer_config.json")
    config = _optional_json(folder / "config.json")
    return TokenizersTokenizer(backend, eos_id=_special_id(backend, "eos", tok_config, config),
                               bos_id=_special_id(backend, "bos", tok_config, config),
                               chat_template=_hf_chat_template(folder, tok_config), source=str(folder))


# ---- GGUF ----------------------------------------------------------------------------------------------


def _gguf_added_tokens(tokens: list[str], types: list[int]) -> list[Any]:
    """Control tokens as special added tokens and user-defined ones as plain added tokens, kept whole."""
    from tokenizers import AddedToken

    return [AddedToken(token, special=kind == GGUF_TOKEN_CONTROL, normalized=False)
            for token, kind in zip(tokens, types) if kind in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)]


def _gguf_bpe(tokens: list[str], merges: list[str], types: list[int]) -> Any:
    """A byte-level BPE tokenizer from the GGUF arrays (tokens are already in GPT-2's byte alphabet)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(_gguf_added_tokens(tokens, types))  # AddedToken(special=True) stays special
    return backend


def _check_gguf_tokenizer(reader: Any, path: Path) -> None:
    model = field(reader, "tokenizer.ggml.model", None)
    if model != "gpt2":
        raise ConfigError(f"GGUF file {path}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level "
                          f"BPE); use a checkpoint folder with tokenizer.json")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in GGUF_GPT2_PRE_TOKENIZERS:
        raise ConfigError(f"GGUF file {path}: pre-tokenizer {pre!r} is not supported (supported: "
                          f"{', '.join(GGUF_GPT2_PRE_TOKENIZERS)}); use a checkpoint folder with tokenizer.json")


def parse_gguf_tokenizer(path: Path) -> TokenizersTokenizer:
    """The vocabulary embedded in a GGUF file as a tokenizer (gpt2-style byte-level BPE), parsed now."""
    reader = open_gguf(path)
    _check_gguf_tokenizer(reader, path)
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    backend = _gguf_bpe(tokens, list(field(reader, "tokenizer.ggml.merges")), types)
    return TokenizersTokenizer(backend, eos_id=field(reader, "tokenizer.ggml.eos_token_id", None),
                               bos_id=field(reader, "tokenizer.ggml.bos_token_id", None),
                               chat_template=field(reader, "tokenizer.chat_template", None), source=str(path))


def gguf_tokenizer(path: Path) -> TokenizersTokenizer:
    """As parse_gguf_tokenizer, converted once per file into the GGUF cache (harness/formats/gguf/cache.py):
    tokenizers' own JSON plus the special ids and the chat template."""
    from tokenizers import Tokenizer as Backend

    from harness.formats.gguf.cache import converted

    def build(tmp: Path) -> None:
        parsed = parse_gguf_tokenizer(path)
        ids = {k: None if v is None else int(v) for k, v in (("eos_id", parsed.eos_id), ("bos_id", parsed.bos_id))}
        tmp.write_text(json.dumps({"tokenizer": parsed.backend.to_str(), **ids,
                                   "chat_template": parsed.chat_template}))

    doc = json.loads(converted(path, "tokenizer.json", build).read_text())
    return TokenizersTokenizer(Backend.from_str(doc["tokenizer"]), eos_id=doc["eos_id"], bos_id=doc["bos_id"],
                               chat_template=doc["chat_template"], source=str(path))


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """The tokenizer that goes with a model spec's weights."""
    if spec.source == "synthetic":
        return ByteTokenizer(spec.vocab)
    path = checkpoint_path(spec)
    return hf_tokenizer(path) if spec.source == "hf" else gguf_tokenizer(path)


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """A fingerprint of the tokenizer: its kind, special ids and the text of every id."""
    h = hashlib.sha256(json.dumps([type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id,
                                   tokenizer.eos_id]).encode())
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.decode([i]).encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()
