"""``moefit`` as a user runs it: a subprocess, exit codes, the table, the JSON schema."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process   # every test starts `moefit` as a subprocess

FIELD = ["Qwen3.5-35B-A3B", "--max-context", "512K", "--rope-scaling", "yarn",
         "--rope-scale", "2", "--kv", "int8", "--prefill", "24576"]


def moefit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moefit", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=60)


def test_plan_fits_exit_0_and_prints_lines_in_commit_order():
    r = moefit("plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB")
    assert r.returncode == 0, r.stderr
    labels = ["runtime", "weights", "weight arena", "KV cache", "prefill staging",
              "safety margin", "expert cache", "unassigned"]
    device, host = r.stdout.split("host budget")
    rows = [l.strip() for l in device.splitlines() if l.startswith("  ")]
    assert [next(lab for lab in labels if row.startswith(lab)) for row in rows] == labels
    assert "VRAM budget  cuda:0  RTX 5060 Ti 16GB  15.48 GiB free of 15.93 GiB" in r.stdout
    host_labels = ["runtime", "weights", "staging", "expert blobs", "simulated devices",
                   "safety margin"]
    rows = [l.strip() for l in host.splitlines()[1:] if l.startswith("  ")]
    assert [next(lab for lab in host_labels if row.startswith(lab)) for row in rows] == host_labels
    assert "524288 tokens x 1 sequence, int8, 10 of 40 layers" in r.stdout


def test_plan_clamp_line_on_12gb_card():
    r = moefit("plan", *FIELD, "--gpu", "RTX 3060 12GB")
    assert r.returncode == 0, r.stderr
    assert "prefill: requested 24576, clamped to " in r.stdout
    assert "due to VRAM budget" in r.stdout


def test_plan_json_schema_when_clamped():
    r = moefit("plan", *FIELD, "--gpu", "RTX 3060 12GB", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "moefit.plan/2" and doc["fits"] is True
    assert doc["split"] == "single" and doc["devices"][0]["role"] == "main"
    host = doc["host"]
    assert host["checked"] is False and host["capacity_bytes"] is None    # a what-if card
    assert [l["key"] for l in host["lines"]] == ["host_runtime", "host_weights", "host_staging",
                                                "host_experts", "host_devices", "host_margin"]
    assert host["planned_bytes"] == sum(l["bytes"] for l in host["lines"])
    assert {"name", "total_params", "active_params"} <= set(doc["model"])
    dev = doc["devices"][0]
    assert {"name", "capacity_bytes", "free_bytes", "lines", "unassigned_bytes"} <= set(dev)
    assert [l["key"] for l in dev["lines"]] == ["runtime", "weights", "weight_arena", "kv",
                                               "prefill", "margin", "experts"]
    assert all(isinstance(l["bytes"], int) and set(l) == {"key", "bytes", "detail"}
               for l in dev["lines"])
    assert sum(l["bytes"] for l in dev["lines"]) + dev["unassigned_bytes"] == dev["free_bytes"]
    p = doc["prefill"]
    assert p["requested"] == 24576 and p["clamped"] is True and p["selected"] < 24576
    assert {"slots", "total", "per_layer"} <= set(doc["experts"])
    assert isinstance(doc["notes"], list)
    assert "shortfall_bytes" not in doc


def test_plan_does_not_fit_exit_3_with_alternatives_that_fit():
    r = moefit("plan", *FIELD, "--vram", "6GiB", "--json")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fits"] is False and doc["shortfall_bytes"] > 0
    assert doc["limiting"] and doc["alternatives"]
    base = [a for a in FIELD]
    for alt in doc["alternatives"]:
        args = list(base)
        for change in (alt, *alt.get("with", ())):
            if change["flag"] in args:
                args[args.index(change["flag"]) + 1] = str(change["value"])
            else:
                args += [change["flag"], str(change["value"])]
        assert moefit("plan", *args, "--vram", "6GiB").returncode == 0, alt
    text = moefit("plan", *FIELD, "--vram", "6GiB")
    assert text.returncode == 3 and "short by" in text.stdout and "fits with:" in text.stdout


@pytest.mark.parametrize("args,needle", [
    (["plan", "no-such-model", "--vram", "16G"], "unknown model"),
    (["plan", "Qwen3-30B-A3B", "--vram", "-16G"], "--vram"),
    (["plan", "Qwen3-30B-A3B", "--vram", "16G", "--kv", "q4"], "--kv"),
    (["plan", "Qwen3-30B-A3B", "--vram", "16G", "--max-context", "1M"], "--rope-scaling"),
    (["plan", "Qwen3-30B-A3B", "--vram", "16G", "--prefill", "soon"], "--prefill"),
    (["plan", "Qwen3-30B-A3B", "--gpu", "RTX 9999"], "moefit gpus"),
    (["plan", "Qwen3-30B-A3B", "--vram", "16G", "--rope-scale", "2"], "--rope-scaling"),
    (["plan"], "model"),
])
def test_bad_input_exit_2_names_the_input(args, needle):
    r = moefit(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_plan_runs_with_torch_unimportable(tmp_path):
    # a sitecustomize that makes `import torch` fail, as on a machine without torch
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        sys.modules["transformers"] = None
    """))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = moefit("plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fits"] is True
    check = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, **env},
                           capture_output=True, text=True)
    assert check.returncode != 0   # the trick really hides torch


def test_plan_loads_no_engine_module_without_engine(tmp_path):
    """``moefit plan`` imports the other engines' models (``moefit.external``) only for
    ``--engine``: with the package made unimportable, moefit's own plans (one that fits, one
    that fails and lists alternatives) still answer, and an ``--engine`` plan does not."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["moefit.external"] = None\n')
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    fits = moefit("plan", "DeepSeek-V3", "--gpu", "4090", "--max-context", "32K", env=env)
    assert fits.returncode == 0, fits.stderr
    short = moefit("plan", "Qwen3-30B-A3B", "--vram", "4G", env=env)
    assert short.returncode == 3 and "fits with:" in short.stdout, short.stderr
    engine = moefit("plan", "Qwen3-30B-A3B", "--vram", "24G", "--engine", "llama.cpp", env=env)
    assert engine.returncode != 0 and "moefit.external" in engine.stderr   # the trick works


def test_a_plan_that_fits_loads_none_of_the_on_demand_modules(tmp_path):
    """A plan of a preset that fits imports none of the modules that tests/test_imports.py
    lets the package import where their path begins (:data:`ON_DEMAND`,
    :data:`RARE_STDLIB`): each would slow every plan (issue 24). With a calibration file in
    the cache the plan hashes its geometry to look it up (its layers as dicts,
    ``dataclasses.asdict``), and hashlib and dataclasses are seen to load."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_imports import ON_DEMAND, RARE_STDLIB

    watched = sorted({*ON_DEMAND, *RARE_STDLIB, "fractions"})   # units parses without it
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from moefit.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["plan", "DeepSeek-V3", "--gpu", "4090", "--max-context", "32K"])
        print(code, [m for m in {watched!r} if m in sys.modules])
    """)

    def loaded() -> str:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "MOEFIT_CACHE_DIR": str(tmp_path)}, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert loaded() == "0 []"
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "0123.json").write_text("{}")   # another key's: not read
    assert loaded() == "0 ['dataclasses', 'hashlib']"


def test_a_failing_plan_prices_its_llamacpp_alternative_without_gguf_or_numpy():
    """A plan that does not fit on one card prices llama.cpp's alternative from ggml's block
    sizes (moefit.ingest.ggml_types), not from the gguf package, which brings numpy: a third
    of a second of every failing plan (issue 24). The alternative is still there."""
    code = textwrap.dedent("""
        import contextlib, io, sys
        from moefit.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4060"])
        print(code, "llama.cpp" in out.getvalue(), [m for m in ("gguf", "numpy", "shutil") if m in sys.modules])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3 True []"


@pytest.mark.parametrize("columns", [None, "", "x", "0", "50", "200"])
def test_the_help_is_as_wide_as_shutil_says(monkeypatch, columns):
    """The width argparse's help is wrapped at (moefit.cli._columns, which spares a plan
    importing shutil) is shutil.get_terminal_size()'s."""
    import shutil

    from moefit import cli
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert cli._columns() == shutil.get_terminal_size().columns


def test_the_compiler_lookup_is_shutil_which(tmp_path):
    """moefit.memory.cpu_kernels._which (spares a plan importing shutil) finds what
    shutil.which finds: a program on the PATH, an absolute path, not a directory nor a file
    that does not run, an empty PATH."""
    import shutil

    from moefit.memory.cpu_kernels import _which
    (tmp_path / "runs").write_text("#!/bin/sh\n")
    (tmp_path / "runs").chmod(0o755)
    (tmp_path / "stays").write_text("")
    (tmp_path / "dir").mkdir()
    for program, path in [("sh", None), ("no-such-cc", None), ("runs", str(tmp_path)),
                          ("stays", str(tmp_path)), ("dir", str(tmp_path)), ("sh", ""),
                          (str(tmp_path / "runs"), None), (str(tmp_path / "stays"), None),
                          ("runs", f"/nonexistent{os.pathsep}{tmp_path}")]:
        assert _which(program, path) == (shutil.which(program, path=path) is not None), (program, path)


def test_models_and_gpus_list():
    m = moefit("models")
    assert m.returncode == 0 and "Qwen3-30B-A3B" in m.stdout and "DeepSeek-V3" in m.stdout
    g = moefit("gpus")
    assert g.returncode == 0 and "RTX 4090" in g.stdout and "H200" in g.stdout


def test_plan_from_a_config_path_matches_the_preset(tmp_path):
    import moefit
    cfg = Path(moefit.__file__).parent / "presets" / "Qwen3-30B-A3B" / "config.json"
    (tmp_path / "config.json").write_text(cfg.read_text())
    a = json.loads(moefit_json("plan", str(tmp_path), "--vram", "24G"))
    b = json.loads(moefit_json("plan", str(tmp_path / "config.json"), "--vram", "24G"))
    c = json.loads(moefit_json("plan", "qwen3-30b-a3b", "--vram", "24G"))
    assert a["devices"] == b["devices"] == c["devices"]


def moefit_json(*args: str) -> str:
    r = moefit(*args, "--json")
    assert r.returncode == 0, r.stderr
    return r.stdout
