"""`harness export --model M --out DIR`: a model as a Hugging Face checkpoint folder (config.json,
model.safetensors, tokenizer files) for external engines; the embedded engine loads it back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.cli.checks import require_writable_dir
from harness.formats.locate import load_model


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a model as a Hugging Face checkpoint folder", description=__doc__)
    p.add_argument("--model", required=True, help="shipped model name, model spec .yaml, checkpoint or .gguf")
    p.add_argument("--out", required=True, type=Path, help="new (or empty) folder to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.formats.export import export_model  # heavy imports only for this command

    require_writable_dir(args.out, "--out")
    out = export_model(load_model(args.model), args.out)
    print(f"exported {args.model} to {out}")
    return 0
