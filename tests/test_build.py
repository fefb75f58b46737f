"""What the installed package contains: build info, the compiled core, typing files."""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import shardadam

PKG_DIR = Path(shardadam.__file__).parent


def test_build_info_fields_and_types():
    info = shardadam.build_info()
    assert set(info) >= {"cuda", "cuda_architectures", "cuda_runtime_version", "cuda_device_count",
                         "version", "max_groups_per_launch", "tensor_scan"}
    assert info["tensor_scan"] is True  # built with torch, for this torch: tests/test_tensor_scan.py
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cuda_architectures"], str)
    assert isinstance(info["cuda_runtime_version"], int)
    assert isinstance(info["cuda_device_count"], int) and info["cuda_device_count"] >= 0
    assert info["max_groups_per_launch"] == 32
    if info["cuda"]:
        archs = info["cuda_architectures"].replace(";", ",").split(",")
        assert archs and all(re.fullmatch(r"\d+(-real|-virtual|a|f)?", a) for a in archs), archs
        assert info["cuda_runtime_version"] >= 11000
    else:
        assert info["cuda_device_count"] == 0
    if torch.cuda.is_available() and info["cuda"]:
        assert info["cuda_device_count"] == torch.cuda.device_count()


def test_build_info_returns_a_fresh_dict():
    a = shardadam.build_info()
    a["cuda"] = "mutated"
    assert shardadam.build_info()["cuda"] != "mutated"


def test_version_matches_metadata():
    assert shardadam.__version__ == shardadam.build_info()["version"]
    assert shardadam.__version__ == importlib.metadata.version("shardadam")
    assert re.fullmatch(r"\d+\.\d+\.\d+", shardadam.__version__)


def test_core_imports_with_its_api():
    core = importlib.import_module("shardadam._core")
    assert Path(core.__file__).parent == PKG_DIR
    for name in ("adam", "lion", "scale", "l2_norm", "build_info", "check_adam_table", "check_lion_table",
                 "TensorTable", "AdamGroup", "AdamExtras", "Scalar", "DType"):
        assert hasattr(core, name), name
    assert core.DType.float32.value == 1 and core.DType.int16.value == 4
    g = core.AdamGroup()
    assert (g.beta1, g.adam_w_mode, g.bias_correction, g.maximize) == (0.9, True, True, False)


def test_import_in_a_fresh_interpreter():
    # Importing must not need a GPU or initialise CUDA.
    code = ("import shardadam, sys; from shardadam import kernels; "
            "assert 'shardadam._core' in sys.modules; print(shardadam.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.stdout.strip() == shardadam.__version__


def test_stub_and_py_typed_are_installed():
    stub = PKG_DIR / "_core.pyi"
    marker = PKG_DIR / "py.typed"
    assert stub.is_file(), f"missing {stub}"
    assert marker.is_file(), f"missing {marker}"
    tree = ast.parse(stub.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in ("adam", "lion", "scale", "l2_norm", "build_info", "check_adam_table", "check_lion_table",
                 "TensorTable", "AdamGroup", "AdamExtras", "Scalar", "DType"):
        assert name in names, f"{name} not in {stub}"
    core = importlib.import_module("shardadam._core")
    for name in names:
        assert hasattr(core, name), f"stub names {name}, which _core lacks"
