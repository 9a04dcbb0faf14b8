"""``moefit gguf-header MODEL OUT --type FTYPE`` (issue 25, item 5): header-only GGUF stand-ins
for every family that plans with ``--engine llama.cpp``, which llama.cpp loads far enough to
print its buffers.

The stand-ins were loaded by hand with the CPU llama.cpp build (commit 0c1e570); two of those
runs are recorded in ``tests/data/llamacpp_standin`` (the command and the buffer lines), and
checked here against the plan of the stand-in the command writes now. llama.cpp is not needed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from moefit.cli import main  # noqa: E402
from moefit.devices import Device  # noqa: E402
from moefit.external import llamacpp as lc  # noqa: E402
from moefit.ingest.gguf_mix import default_ftype, llamacpp_tensors  # noqa: E402
from moefit.errors import InputError  # noqa: E402
from moefit.ingest.resolve import list_presets, load_model  # noqa: E402
from moefit.tools.stand_in import byte_tokens, write_stand_in  # noqa: E402
from moefit.units import MIB  # noqa: E402

LOGS = Path(__file__).parent / "data" / "llamacpp_standin"
#: presets llama.cpp plans: a GGUF architecture and a Hugging Face config (DeepSeek-V2-Lite
#: ships its inference config only; Llama 4 has no GGUF architecture here)
PLANNED = [p for p in list_presets() if p not in ("DeepSeek-V2-Lite", "Llama-4-Scout-17B-16E-Instruct")]


def fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    out = {}
    for k, f in r.fields.items():
        if f.types[0] == gguf.GGUFValueType.STRING:
            out[k] = bytes(f.parts[f.data[0]]).decode()
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            out[k] = len(f.data)
        else:
            out[k] = f.parts[f.data[0]].tolist()[0]
    return out


@pytest.mark.parametrize("preset", PLANNED)
def test_every_family_that_plans_writes_a_stand_in_that_plans_the_same(tmp_path, preset):
    geom = load_model(preset)
    ftype = default_ftype(geom)
    out = write_stand_in(preset, None, tmp_path / "s.gguf")
    derived, _ = llamacpp_tensors(geom, ftype)
    header = lc.tensors_from_header(str(out))
    assert [(t.name, t.kind, tuple(t.ne)) for t in header] == [(t.name, t.kind, tuple(t.ne)) for t in derived]
    # a sparse file: the size of its tensors, next to no disk
    assert out.stat().st_size >= sum(t.nbytes for t in derived) and out.stat().st_blocks * 512 < 64 * MIB
    f = fields(out)
    arch = f["general.architecture"]
    assert f["tokenizer.ggml.tokens"] == geom.vocab_size == f[f"{arch}.vocab_size"]
    assert f["tokenizer.ggml.model"] == "gpt2" and f[f"{arch}.block_count"] == geom.num_layers
    if arch == "qwen35moe":
        assert f"{arch}.rope.dimension_sections" in f      # llama.cpp's Qwen3.5 loader requires it
    # the stand-in plans as the model: the same lines (moefit's GGUF reader reads the MoE
    # architectures; a dense qwen3 file is llama.cpp's only)
    if arch == "qwen3":
        with pytest.raises(InputError, match="GGUF architecture 'qwen3'"):
            load_model(str(out))
        return
    stand_in = load_model(str(out))
    dev = Device(label="cuda:0", description="what-if", kind="cuda", capacity_bytes=16 << 30,
                    free_bytes=16 << 30, simulated=True)
    req = lc.LlamaRequest(context=8192)
    a = lc.solve_llamacpp(stand_in, header, dev, req, alternatives=False)
    b = lc.solve_llamacpp(geom, [lc.Tensor(t.name, t.kind, t.ne, t.nbytes) for t in derived], dev, req,
                          alternatives=False)
    assert [(l.key, l.bytes) for l in a.lines] == [(l.key, l.bytes) for l in b.lines]


def test_the_command_writes_the_released_mix_and_names_the_next_step(capsys, tmp_path):
    assert main(["gguf-header", "gpt-oss-20b", str(tmp_path / "g.gguf")]) == 0
    out = capsys.readouterr().out
    assert "headers only" in out and "moefit plan" in out and "--engine llama.cpp" in out
    kinds = {t.kind for t in lc.tensors_from_header(str(tmp_path / "g.gguf")) if t.name.endswith("_exps.weight")}
    assert kinds == {"MXFP4"}
    assert main(["gguf-header", "Qwen3-30B-A3B", str(tmp_path / "q.gguf"), "--type", "q8_0"]) == 0
    assert {t.kind for t in lc.tensors_from_header(str(tmp_path / "q.gguf")) if t.name.endswith("_exps.weight")} \
        == {"Q8_0"}


@pytest.mark.parametrize("argv,needle", [
    (["DeepSeek-V2-Lite"], "model_type"),
    (["Llama-4-Scout-17B-16E-Instruct"], "GGUF architecture"),
    (["Qwen3-30B-A3B", "--type", "Q9_K"], "--type 'Q9_K'"),
])
def test_bad_input_exits_2_with_the_reason(capsys, tmp_path, argv, needle):
    code = main(["gguf-header", argv[0], str(tmp_path / "x.gguf"), *argv[1:]])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


def test_a_vocabulary_gguf_is_copied_to_the_models_size(tmp_path):
    # a vocabulary GGUF of 300 tokens (stand-in tokens), copied into a 151936-token model
    src = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(byte_tokens() + [f"t{i}" for i in range(44)])
    w.add_token_types([1] * 300)
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(299)
    w.add_bos_token_id(200000)              # past any vocabulary: left out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    out = write_stand_in("Qwen3-30B-A3B", "Q4_K_M", tmp_path / "q.gguf", vocab=src)
    f = fields(out)
    assert f["tokenizer.ggml.tokens"] == f["tokenizer.ggml.token_type"] == 151936
    assert f["tokenizer.ggml.pre"] == "qwen2" and f["tokenizer.ggml.eos_token_id"] == 299
    assert "tokenizer.ggml.bos_token_id" not in f
    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "qwen2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(InputError, match="--vocab .*no tokenizer.ggml.tokens"):
        write_stand_in("Qwen3-30B-A3B", "Q4_K_M", tmp_path / "r.gguf", vocab=bare)
    assert not (tmp_path / "r.gguf").exists()


def test_the_byte_tokens_are_gpt2s():
    t = byte_tokens()
    assert len(set(t)) == 256 and t[ord("A")] == "A" and t[ord(" ")] == "Ġ" and t[ord("\n")] == "Ċ"


# ---- llama.cpp's buffers of two stand-ins ---------------------------------------------------------
def _record(name: str) -> tuple[list[str], str]:
    text = (LOGS / name).read_text()
    argv = shlex.split(re.search(r"^# command: (.*)$", text, re.M).group(1))
    return argv, text


def _mib(text: str, pattern: str) -> list[float]:
    return [float(x) for x in re.findall(pattern + r"\s*=\s*([\d.]+) MiB", text)]


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")))
def test_llamacpp_loaded_the_stand_in_with_the_planned_buffers(tmp_path, name):
    argv, text = _record(name)
    model = re.search(r"^# model: moefit gguf-header (\S+)", text, re.M).group(1)
    f = write_stand_in(model, None, tmp_path / "s.gguf")
    geom, tensors = load_model(str(f)), lc.tensors_from_header(str(f))
    flag = lambda n, d: argv[argv.index(n) + 1] if n in argv else d  # noqa: E731
    ctx, ub = int(flag("-c", 4096)), int(flag("-ub", 512))
    tk, tv = flag("-ctk", "f16"), flag("-ctv", "f16")
    printed = lambda n: round(n / MIB, 2)  # noqa: E731
    assert _mib(text, r"CPU_Mapped model buffer size") == [printed(lc.cpu_model_buffer(tensors))]
    kv = lc.kv_price(geom, ctx, ub, tk, tv, lc.CPU)
    assert _mib(text, r"CPU KV buffer size") == [printed(b) for b in (kv.bytes_full, kv.bytes_swa) if b]
    assert _mib(text, r"CPU RS buffer size") == ([printed(kv.recurrent_bytes)] if kv.recurrent_bytes else [])
    assert _mib(text, r"CPU  output buffer size") == [printed(4 * geom.vocab_size)]
    comp = lc.compute_price(geom, geom.vocab_size, ub, kv, tk, tv, lc.CPU)
    logged = _mib(text, r"sched_reserve:\s+CPU compute buffer size")[0] * MIB
    assert abs(comp.bytes / logged - 1) < 0.05
