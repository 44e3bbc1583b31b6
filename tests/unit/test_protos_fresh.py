"""The committed gRPC stubs match the .proto files (regenerate with `python -m protos.generate`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh() -> None:
    result = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=ROOT, check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
