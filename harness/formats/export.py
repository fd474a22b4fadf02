"""`harness export`: a shipped or synthetic model as a Hugging Face checkpoint folder.

The folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) is what external engines load (vLLM, SGLang, transformers) and what the
embedded engine loads back as `source: hf`, so both sides of a comparison run the same weights and
the same token ids.

Synthetic models use the byte tokenizer (ids 0..255 are UTF-8 bytes, 256 BOS, 257 EOS); it is written
as a byte-level BPE without merges whose vocabulary maps each byte to its own id, so a Hugging Face
tokenizer encodes text to exactly the ids the embedded engine uses. Ids from 258 up are special
placeholder tokens (they exist in the model and decode to nothing, as in the byte tokenizer).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.hf.deepseek_mtp import to_deepseek_mtp
from harness.formats.hf.write import save_hf_checkpoint
from harness.formats.speculator import mtp_weights
from harness.formats.tokenizer import BYTE_BOS, BYTE_EOS, TokenizersTokenizer, load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from harness.specs.speculative import SpeculativeSettings

BOS_TEXT = "<s>"
EOS_TEXT = "</s>"
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer_backend(vocab: int) -> Any:
    """A `tokenizers.Tokenizer` that encodes text to its UTF-8 bytes as ids 0..255 (no merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_level_alphabet()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials = [BOS_TEXT, EOS_TEXT, *(f"<|extra_{i}|>" for i in range(BYTE_EOS + 1, vocab))]
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
    return backend


def _tokenizer_config(bos: str | None, eos: str | None, chat_template: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                              "clean_up_tokenization_spaces": False, "add_bos_token": False,
                              "add_eos_token": False, "bos_token": bos, "eos_token": eos}
    if chat_template:
        config["chat_template"] = chat_template
    return config


def write_tokenizer(spec: ModelSpec, folder: Path) -> tuple[int | None, int | None]:
    """tokenizer.json and tokenizer_config.json for `spec`; returns (bos_id, eos_id)."""
    if spec.source == "synthetic":
        backend = byte_tokenizer_backend(spec.vocab)
        bos_id, eos_id, template = BYTE_BOS, BYTE_EOS, None
    else:
        tokenizer = load_tokenizer(spec)
        if not isinstance(tokenizer, TokenizersTokenizer):
            raise ConfigError(f"model {spec.name!r}: its tokenizer cannot be written as tokenizer.json")
        backend, bos_id, eos_id, template = (tokenizer.backend, tokenizer.bos_id, tokenizer.eos_id,
                                             tokenizer.chat_template)
    backend.save(str(folder / "tokenizer.json"))
    text = {i: (backend.id_to_token(i) if i is not None else None) for i in (bos_id, eos_id)}
    config = _tokenizer_config(text[bos_id], text[eos_id], template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return bos_id, eos_id


REAL_EXTRA_PACKAGES: tuple[str, ...] = ("tokenizers",)  # what writing tokenizer.json needs (the [real] extra)


def require_real_extra() -> None:
    """The packages of the `[real]` extra that export needs, or one ConfigError saying what to install."""
    for name in REAL_EXTRA_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"harness export needs the {name!r} package (the [real] extra), which is not "
                              f"installed; install it with: pip install -e '.[real]'") from None


def check_out(out: Path) -> None:
    """--out is a new folder or an empty one."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; give a new or empty folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out {out} lies under the file {parent}; give a new or empty folder")
            break


def export_model(spec: ModelSpec, out: Path) -> Path:
    """Write `spec` (weights and tokenizer) as a Hugging Face checkpoint folder at `out`: into a temporary
    folder beside it, renamed into place only when complete (a failed export leaves no folder behind)."""
    refusal = model_of(spec).export_refusal()
    if refusal is not None:
        raise ConfigError(refusal)
    check_out(out)
    require_real_extra()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.partial"  # this process's own staging folder
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_folder(spec, tmp)
        os.replace(tmp, out)  # an empty `out` is replaced too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_tensors(file: Path, tensors: dict[str, Any]) -> None:
    """Rewrite safetensors `file` with `tensors` added."""
    from safetensors.torch import load_file, save_file

    save_file({**load_file(str(file)), **{k: t.contiguous() for k, t in tensors.items()}}, str(file),
              metadata={"format": "pt"})


def _write_folder(spec: ModelSpec, out: Path) -> None:
    weights = load_weights(spec)
    save_hf_checkpoint(spec, weights, out)
    if spec.nextn_layers:  # the MTP speculator's layer beside the target's (DeepSeek-V3's format)
        add_tensors(out / "model.safetensors",
                    to_deepseek_mtp(spec, mtp_weights(spec, weights, SpeculativeSettings().mtp_hidden_mix)))
    bos_id, eos_id = write_tokenizer(spec, out)
    config = json.loads((out / "config.json").read_text())
    config.update({"bos_token_id": bos_id, "eos_token_id": eos_id})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
