"""The CPU ops library's build: plain C++ that compiles in seconds (a new user's first run waited ~80 s
here, and up to 435 s on a busy machine, for the pybind11 extension), and a compiler error named in
the warning. Every build here goes to a tmp cache."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.ops import builder
from engine.ops.flatten import copy_into, torch_copy_into

ALLOWED_TORCH_HEADERS = {"c10/util/BFloat16.h", "c10/util/Half.h"}  # header-only dtype conversions


def test_cpu_sources_include_no_torch_extension_headers() -> None:
    """torch/extension.h (pybind11 and all of ATen) cost ~22 s per translation unit at -O3 here."""
    included = set()
    for path in sorted((builder.CSRC / "cpu").glob("*.[ch]*")):
        included |= set(re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)[>\"]", path.read_text(), re.MULTILINE))
    from_torch = {h for h in included if h.split("/")[0] in ("torch", "ATen", "c10", "pybind11", "caffe2")}
    assert from_torch <= ALLOWED_TORCH_HEADERS, sorted(from_torch - ALLOWED_TORCH_HEADERS)


def test_a_clean_build_compiles_and_links_no_torch_library(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("ZERO_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(builder.ENV_MODE, "require")
    compiler = builder.compiler_version()
    directory = builder.build_dir(builder.NAME, builder.cache_key(builder.sources(), compiler), compiler)
    directory.mkdir(parents=True)
    # A build killed before its link finished: neither loaded nor taken for a cached build.
    (directory / f"{builder.NAME}.so.4242.tmp").write_bytes(b"half a library")
    try:
        builder.reset_for_tests()
        ops = builder.load()
        status = builder.status()
        assert ops is not None and status.state == "compiled", capsys.readouterr().err
        assert Path(ops.path) == directory / f"{builder.NAME}.so"
        readelf = shutil.which("readelf")  # binutils: present wherever the compiler that built this is
        assert readelf is not None
        dynamic = subprocess.run([readelf, "-d", str(ops.path)], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\).*\[(.+)\]", dynamic)
        assert needed and not [lib for lib in needed if "torch" in lib or "c10" in lib], needed
        # The library it built is the one the ops use, and it agrees with the torch path bit for bit.
        srcs = [torch.randn(n).to(torch.bfloat16) for n in (3, 40_000, 17)]
        offsets = [0, 3, 40_003]
        got, want = torch.zeros(40_020), torch.zeros(40_020)
        copy_into(got, srcs, offsets, 0.37)
        torch_copy_into(want, srcs, offsets, 0.37)
        assert torch.equal(got, want)
        builder.reset_for_tests()
        assert builder.load() is not None and builder.status().state == "cached"
    finally:
        builder.reset_for_tests()


def test_a_compiler_error_is_named_in_the_warning(monkeypatch, tmp_path) -> None:
    root = tmp_path / "checkout"
    (root / "csrc" / "cpu").mkdir(parents=True)
    (root / "csrc" / "cpu" / "broken.cpp").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(builder, "ROOT", root)
    monkeypatch.setattr(builder, "CSRC", root / "csrc")
    monkeypatch.setenv("ZERO_ENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(builder.ENV_MODE, "auto")
    try:
        builder.reset_for_tests()
        with pytest.warns(
            RuntimeWarning,
            match=r"C\+\+ extension unavailable \(the build failed: [^;]*broken\.cpp:1:"
            r"\d+: error: .undeclared_name. was not declared",
        ):
            assert builder.load() is None
        assert builder.status().state == "fallback"
        monkeypatch.setenv(builder.ENV_MODE, "require")
        builder.reset_for_tests()
        with pytest.raises(
            RuntimeError,
            match=r"require but the C\+\+ extension is unavailable: the build failed: "
            r".*undeclared_name",
        ):
            builder.load()
        assert not list((tmp_path / "cache").glob("ops/*/*.so")), "a failed build must leave no library behind"
    finally:
        builder.reset_for_tests()
