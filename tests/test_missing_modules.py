"""missing_modules asks the engine's interpreter, not this one, whenever its path differs: a virtual environment's
python links to the same interpreter binary as this harness's, but its packages are its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.backends.http.backend import missing_modules


def test_a_venv_sharing_this_interpreter_binary_is_asked_for_its_own_packages(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    assert python.resolve() == Path(sys.executable).resolve() or python.is_symlink()
    # torch is installed here, not in the bare venv: the venv's answer, not this process's
    assert missing_modules(str(python), ["torch", "json"]) == ("torch",)
    assert missing_modules(sys.executable, ["torch", "json"]) == ()
