"""What a serving install pulls in: the product packages import no benchmark or model-fetch code, and
pyproject.toml keeps those dependencies in their extras."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ["engine", "router", "worker_core", "prefill_worker", "decode_worker", "kv_transfer", "protos",
                    "planner"]
PRODUCT_MODULES = ["pdserve.cli", "pdserve.serve", "pdserve.status", "pdserve.grpc_client"]
# Only in the `bench` and `fetch` extras. numpy and accelerate are left out: torch and transformers
# import them whenever they are installed.
NOT_FOR_SERVING = ("matplotlib", "gguf")

IMPORT_ALL = f"""
import importlib, json, pkgutil, sys
names = list({PRODUCT_MODULES!r})
for package in {PRODUCT_PACKAGES!r}:
    names.append(package)
    names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
for name in names:
    importlib.import_module(name)

def loaded(prefixes):
    return sorted(m for m in sys.modules if m.split(".")[0] in prefixes or m.startswith("pdserve.bench"))

imported = loaded({NOT_FOR_SERVING!r})
from pdserve.cli import build_parser
build_parser()  # every `pdserve` command line builds the bench sub-commands' flags
print(json.dumps({{"imported": imported, "parser": loaded({NOT_FOR_SERVING!r})}}))
"""


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_product_packages_import_no_benchmark_or_fetch_code():
    res = subprocess.run([sys.executable, "-c", IMPORT_ALL], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout.splitlines()[-1])
    assert found["imported"] == [], f"serving code imports benchmark or fetch-only modules: {found['imported']}"
    assert not [m for m in found["parser"] if m.split(".")[0] in NOT_FOR_SERVING], found["parser"]


def test_base_dependencies_leave_benchmarks_and_fetching_to_extras():
    p = project()
    base = {Requirement(r).name: Requirement(r) for r in p["dependencies"]}
    assert not {"matplotlib", "gguf", "accelerate", "numpy", "psutil"} & set(base), sorted(base)
    floor = min(Version(s.version) for s in base["torch"].specifier if s.operator in (">=", "=="))
    assert floor >= Version("2.13"), base["torch"]
    extras = {name: {Requirement(r).name for r in reqs} for name, reqs in p["optional-dependencies"].items()}
    assert {"matplotlib", "numpy", "psutil"} <= extras["bench"]
    assert {"gguf", "accelerate"} <= extras["fetch"]
    dev_self = [Requirement(r) for r in p["optional-dependencies"]["dev"] if Requirement(r).name == "pdserve"]
    assert dev_self and {"bench", "fetch"} <= dev_self[0].extras, "the tests import the benchmarks"


@pytest.mark.parametrize("absent", ["matplotlib", "numpy", "psutil"])
def test_bench_without_the_bench_extra_names_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                absent: str):
    from pdserve.cli import main

    monkeypatch.setitem(sys.modules, absent, None)  # as if not installed
    assert main(["bench", "engine", "--quick"]) == 2
    err = capsys.readouterr().err
    assert absent in err and "pip install 'pdserve[bench]'" in err and "Traceback" not in err
