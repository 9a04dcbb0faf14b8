"""The speed model (moefit.plan.speed): predicted prefill / decode tokens/s of a plan, the
bound named for each, the figures it runs on, and how it reaches the plan's outputs."""

import json
from dataclasses import replace

import pytest

from moefit.cli import main
from moefit.devices import GPU_CATALOGUE, find_gpu
from moefit.devices.device import PCIE_LANE_BYTES_PER_S
from moefit.devices.catalogue import PUBLISHED_AI_TOPS
from moefit.devices.host import DEFAULT_HOST_BANDWIDTH, default_host_speed
from moefit.ingest.resolve import load_model
from moefit.memory import calibration
from moefit.memory.kv import kv_format
from moefit.plan.request import Request
from moefit.plan.solver import solve
from moefit.plan.speed import RESOURCES, plan_crossovers, predict, predict_plan, rates_for, routing
from moefit.plan.throughput import alternative_request

FIELD = ["Qwen3.5-35B-A3B", "--max-context", "512K", "--rope-scaling", "yarn",
         "--rope-scale", "2", "--kv", "k8v4", "--prefill", "24576"]


def _predict(name: str, gpu: str, resident: int, **kw):
    geom = load_model(name)
    rates = rates_for(find_gpu(gpu), default_host_speed())
    res = {l.index: resident for l in geom.moe_layers}
    args = dict(context=32768, chunk=4096, seqs=1, policy="cpu") | kw
    return predict(geom, rates, kv_format("bf16"), res, **args)


def run(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


# ---- the figures ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec", GPU_CATALOGUE, ids=lambda s: s.name)
def test_every_catalogue_card_has_sourced_throughput_figures(spec):
    g = spec.speed
    assert g is not None and g.source
    assert 100e9 <= g.memory_bytes_per_s <= 10e12
    # dense int8 is 2x (professional / data-centre cards) or 4x (GeForce) dense bf16
    assert 1.9 <= g.int8_ops / g.bf16_flops <= 4.1
    assert g.pcie_gen in (4, 5) and g.pcie_lanes in (8, 16)
    assert find_gpu(spec.name).speed == g       # the what-if device carries them


# The whitepaper rows the catalogue quotes, re-derived from the per-tensor-core rate the derived
# GeForce cards use (128 bf16 FLOP with fp32 accumulation, 512 int8 OP per core and clock, 4
# cores per SM): (card, SMs, boost GHz) as the card's spec page gives them. A quoted figure that
# was a sparse one (2x) or the fp16-accumulate rate (2x on GeForce) fails here.
WHITEPAPER_ROWS = [("RTX 3070", 46, 1.725), ("RTX 3080 10GB", 68, 1.71), ("RTX 3090", 82, 1.695),
                   ("RTX 4080", 76, 2.505), ("RTX 4090", 128, 2.52), ("RTX 5090", 170, 2.407)]


@pytest.mark.parametrize("card, sms, ghz", WHITEPAPER_ROWS, ids=[r[0] for r in WHITEPAPER_ROWS])
def test_whitepaper_rows_agree_with_the_per_core_rate_of_the_derived_cards(card, sms, ghz):
    g = find_gpu(card).speed
    per_clock = 4 * sms * ghz * 1e9
    assert g.bf16_flops == pytest.approx(per_clock * 128, rel=5e-3)
    assert g.int8_ops == pytest.approx(per_clock * 512, rel=5e-3)


@pytest.mark.parametrize("card", sorted(PUBLISHED_AI_TOPS))
def test_derived_geforce_int8_matches_nvidias_ai_tops(card):
    """NVIDIA's "AI TOPS" (Ada: fp8 with sparsity, 2x dense int8; Blackwell: fp4 with sparsity,
    4x) checks the SMs x boost x per-core derivation of each card that has one."""
    tops, per_int8, source = PUBLISHED_AI_TOPS[card]
    assert source
    assert find_gpu(card).speed.int8_ops == pytest.approx(tops / per_int8 * 1e12, rel=5e-3)


@pytest.mark.parametrize("card, sparse_bf16, sparse_int8, rel", [
    ("A100 40GB", 624, 1248, 2e-3), ("A100 80GB", 624, 1248, 2e-3),
    ("H100 80GB", 1513, 3026, 2e-3), ("H200", 1979, 3958, 2e-3), ("RTX A6000", 309.7, 619.4, 2e-3),
    # the L40S datasheet prints BF16 "362.05 | 733*": its own dense figure (kept) is 1.2% under
    # half its sparse one (142 SMs x 2.52 GHz x 1024 = 366.4 dense)
    ("L40S", 733, 1466, 1.5e-2)])
def test_datasheet_cards_take_the_dense_half_of_the_sparse_figures(card, sparse_bf16, sparse_int8,
                                                                     rel):
    """The datasheets print "with sparsity" figures (footnote: 1/2 lower without)."""
    g = find_gpu(card).speed
    assert g.bf16_flops == pytest.approx(sparse_bf16 / 2 * 1e12, rel=rel)
    assert g.int8_ops == pytest.approx(sparse_int8 / 2 * 1e12, rel=2e-3)
    assert str(sparse_bf16).rstrip("0").rstrip(".") in g.source     # the source quotes it


def test_pcie_lane_rates_follow_the_line_code():
    """PCI-SIG: 8 / 16 / 32 GT/s per lane with 128b/130b for 3.0 / 4.0 / 5.0."""
    for gen, gts in ((3, 8), (4, 16), (5, 32)):
        assert PCIE_LANE_BYTES_PER_S[gen] == pytest.approx(gts * 1e9 * 128 / 130 / 8, rel=1e-12)
    assert PCIE_LANE_BYTES_PER_S[4] == pytest.approx(1.969e9, rel=1e-3)   # PCI-SIG's ~2 GB/s
    assert PCIE_LANE_BYTES_PER_S[2] == pytest.approx(5e9 * 8 / 10 / 8)     # 8b/10b: 500 MB/s
    assert find_gpu("RTX 5060 Ti 16GB").speed.pcie_bytes_per_s == pytest.approx(31.5e9, rel=1e-2)


def test_default_host_bandwidth_is_dual_channel_ddr5_5600():
    """2 channels x 8 bytes (64-bit) x 5600 MT/s = 89.6 GB/s."""
    assert DEFAULT_HOST_BANDWIDTH == 2 * 8 * 5600e6 == 89.6e9
    assert default_host_speed().memory_bytes_per_s == DEFAULT_HOST_BANDWIDTH


def test_a_failing_llamacpp_plan_prints_no_speed_line(capsys):
    """A catalogue card's llama.cpp plan that does not fit (the host short) has no speed line:
    not one that blames the card's figures."""
    code, out = run(capsys, "plan", "Qwen3.5-35B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB",
                    "--host-ram", "8GiB", "--no-calibration")
    assert code == 3 and "does not fit" in out
    assert "speed" not in out
    code, out = run(capsys, "plan", "Qwen3.5-35B-A3B", "--engine", "llama.cpp", "--gpu", "RTX 5060 Ti 16GB",
                    "--no-calibration")
    assert code == 0 and "speed  prefill" in out


def test_a_vram_card_has_no_figures_and_the_plan_says_so(capsys):
    code, out = run(capsys, "plan", "Qwen3-30B-A3B", "--vram", "24GiB", "--no-calibration")
    assert code == 0
    assert "speed  not predicted: no throughput figures for this device" in out


def test_host_calibration_round_trip_and_a_file_from_another_machine_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    assert calibration.load_host() is None
    rates = {"Q4_K": 40e9, "BF16": 100e9}
    path = calibration.save_host({1: (20e9, rates), 2: (30e9, {k: 2 * v for k, v in rates.items()})})
    got = calibration.load_host(threads=2)
    assert got.memory_bytes_per_s == 30e9 and got.threads == 2 and got.rate("Q4_K") == 80e9
    assert calibration.load_host(threads=1).memory_bytes_per_s == 20e9
    assert got.rate("Q6_K") == 80e9          # not measured: the slowest measured rate
    doc = json.loads(path.read_text())
    doc["cpu"] = "another CPU"
    path.write_text(json.dumps(doc))
    warnings = []
    assert calibration.load_host(warn=warnings.append) is None
    assert "measured on another machine" in warnings[0]


def test_host_bandwidth_flag_sets_the_host_figure(capsys):
    args = ["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4060", "--max-context", "16K", "--no-calibration", "--json"]
    slow = json.loads(run(capsys, *args, "--host-bandwidth", "20GB/s")[1])["speed"]
    fast = json.loads(run(capsys, *args, "--host-bandwidth", "200GB/s")[1])["speed"]
    assert "20.0 GB/s (--host-bandwidth)" in slow["sources"][1]
    assert slow["decode"]["tokens_per_s"] < fast["decode"]["tokens_per_s"]
    assert slow["decode"]["bound"] == "host memory"


def test_bad_host_bandwidth_is_an_input_error(capsys):
    code = main(["plan", "Qwen3-30B-A3B", "--gpu", "RTX 4060", "--host-bandwidth", "fast"])
    assert code == 2 and "--host-bandwidth" in capsys.readouterr().err


# ---- the model ------------------------------------------------------------------------------

def test_decode_touches_few_experts_and_a_large_chunk_all_of_them():
    geom = load_model("Qwen3-30B-A3B")
    route = routing(geom)
    layer = geom.moe_layers[0].index
    hit, miss, hit_p, miss_p = route.expected(layer, 0, 1)
    assert miss == pytest.approx(8) and hit == 0 and miss_p == pytest.approx(8)
    hit, miss, *_ = route.expected(layer, 32, 16384)
    assert hit == pytest.approx(32) and miss == pytest.approx(96)


def test_more_resident_experts_never_predict_slower_decode_while_the_host_is_the_longer_branch():
    """From 0 slots up to where the device's share of a decode step's experts takes as long
    as the host's, every slot more is faster (misses read from host memory at 89.6 GB/s,
    hits from the card's at 272 GB/s); past it the model predicts that the idle host
    still helps (the runtime runs misses on the host while the device runs the hits), so
    a full cache is not the fastest there: that regime is pinned in the next test."""
    prev = 0.0
    for r in range(0, 97, 4):       # Qwen3-30B-A3B has 128 experts per layer
        t = _predict("Qwen3-30B-A3B", "RTX 4060", r).decode.tokens_per_s
        assert t >= prev, r
        prev = t
    assert _predict("Qwen3-30B-A3B", "RTX 4060", 0).decode.bound == "host memory"
    assert _predict("Qwen3-30B-A3B", "RTX 4060", 128).decode.bound == "device memory"


def test_a_full_cache_is_device_bound_and_faster_than_an_empty_one():
    full = _predict("Qwen3-30B-A3B", "RTX 4060", 128).decode.tokens_per_s
    empty = _predict("Qwen3-30B-A3B", "RTX 4060", 0).decode.tokens_per_s
    assert full > 1.5 * empty


@pytest.mark.parametrize("prompt", [16384, 20000])
def test_a_larger_chunk_never_predicts_slower_prefill_when_the_arena_copies(prompt):
    prev = 0.0
    for chunk in (256, 512, 1024, 2048, 4096, 8192, 16384):
        p = _predict("Qwen3-30B-A3B", "RTX 4090", 16, policy="copy", chunk=chunk,
                     prompt_tokens=prompt).prefill
        assert p.tokens_per_s >= prev, chunk
        assert p.copied == 48          # every MoE layer copies its misses
        prev = p.tokens_per_s


def test_copying_misses_beats_the_host_for_a_large_chunk_and_loses_for_decode():
    cpu = _predict("Qwen3-30B-A3B", "RTX 4090", 16, policy="cpu")
    copy = _predict("Qwen3-30B-A3B", "RTX 4090", 16, policy="copy")
    assert copy.prefill.tokens_per_s > 2 * cpu.prefill.tokens_per_s
    assert copy.decode.tokens_per_s < cpu.decode.tokens_per_s
    assert copy.decode.bound == "PCIe" and cpu.prefill.bound in RESOURCES
    auto = _predict("Qwen3-30B-A3B", "RTX 4090", 16, policy="auto")
    assert auto.prefill.copied == 48 and auto.decode.copied == 0
    assert auto.prefill.tokens_per_s == pytest.approx(copy.prefill.tokens_per_s)
    assert auto.decode.tokens_per_s == pytest.approx(cpu.decode.tokens_per_s)


def test_a_concentrated_routing_profile_predicts_more_hits_than_uniform_routing():
    geom = load_model("Qwen3-30B-A3B")
    # half the traffic on 8 experts of each layer
    profile = {l.index: {e: (1000 if e < 8 else 62) for e in range(128)} for l in geom.moe_layers}
    rates = rates_for(find_gpu("RTX 4060"), default_host_speed())
    res = {l.index: 8 for l in geom.moe_layers}
    args = dict(context=32768, chunk=4096, seqs=1, policy="cpu")
    skewed = predict(geom, rates, kv_format("bf16"), res, profile=profile, **args)
    even = predict(geom, rates, kv_format("bf16"), res, **args)
    assert skewed.decode.tokens_per_s > 1.3 * even.decode.tokens_per_s


def test_simulated_device_runs_every_part_on_the_host():
    geom = load_model("Qwen3-30B-A3B")
    plan = solve(geom, resolve_cpu(), Request(max_context=4096))
    speed = predict_plan(plan, default_host_speed())
    assert speed is not None and speed.decode.bound in ("host memory", "device memory")
    assert speed.sources[0].startswith("device: the host")


def resolve_cpu():
    from moefit.devices import resolve_device
    return resolve_device("cpu", None, "8GiB", None)


# ---- the plan's outputs ----------------------------------------------------------------------

def test_field_plan_prints_predicted_prefill_and_decode(capsys):
    """On CUDA the default policy is auto: the chunk's misses are copied (the device's
    compute bounds it); with cpu the host's compute does."""
    for policy, bound in ((), "device compute"), (("--miss-policy", "cpu"), "host compute"):
        code, out = run(capsys, "plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB", "--no-calibration", *policy)
        assert code == 0
        line = next(l for l in out.splitlines() if l.startswith("speed  "))
        assert "prefill " in line and "decode " in line and f"bound: {bound}" in line
        assert "a 24576-token chunk at position 262144" in line


def test_verbose_shows_each_layer_kind_and_the_figures(capsys):
    code, out = run(capsys, "plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB", "--no-calibration", "-v")
    assert code == 0
    assert "speed by layer kind" in out
    assert "    linear + MoE      30 layers" in out and "    full + MoE        10 layers" in out
    assert "figures: device: RTX 5060 Ti 16GB: 448 GB/s" in out
    assert "figures: host: default host: 89.6 GB/s" in out


def test_json_speed_schema(capsys):
    code, out = run(capsys, "plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB", "--no-calibration",
                    "--json", "--prompt-tokens", "30000")
    assert code == 0
    s = json.loads(out)["speed"]
    assert set(s) == {"policy", "prefill", "decode", "sources", "miss_crossover"}
    assert s["policy"] == "auto"   # CUDA's default
    for key in ("prefill", "decode"):
        p = s[key]
        assert set(p) == {"tokens_per_s", "bound", "tokens", "position", "chunk",
                          "copied_layers", "by_kind"}
        assert p["tokens_per_s"] > 0 and p["bound"] in RESOURCES
        assert {k["kind"] for k in p["by_kind"]} == {"linear + MoE", "full + MoE"}
        assert all(set(k) == {"kind", "layers", "seconds", "bound"} for k in p["by_kind"])
    assert s["prefill"]["tokens"] == 30000 and s["prefill"]["position"] == 0
    assert s["decode"]["position"] == 30000 and s["decode"]["tokens"] == 1
    # the crossover the runtime's auto compares against, every MoE layer once
    geom = load_model(FIELD[0])
    plan = solve(geom, find_gpu("RTX 5060 Ti 16GB"), Request(
        max_context=524288, rope_scaling="yarn", rope_scale=2.0, kv="k8v4",
        prefill_mode="fixed", prefill_tokens=24576, miss_policy="auto"))
    want = plan_crossovers(plan, default_host_speed())
    got = {l: g["tokens"] for g in s["miss_crossover"] for l in g["layers"]}
    assert got == pytest.approx(want) and len(got) == len(geom.moe_layers)


def test_verbose_prints_the_miss_crossover(capsys):
    code, out = run(capsys, "plan", "Qwen3-30B-A3B", "--gpu", "RTX 4090", "--max-context", "32K",
                    "--no-calibration", "-v")
    geom = load_model("Qwen3-30B-A3B")
    plan = solve(geom, find_gpu("RTX 4090"), Request(max_context=32768, miss_policy="auto"))
    (value,) = set(plan_crossovers(plan, default_host_speed()).values())
    assert code == 0 and f"    {value:.1f} tokens per missing expert   (48 MoE layers)" in out
    code, out = run(capsys, "plan", "Qwen3-30B-A3B", "--device", "cpu", "--vram", "8GiB",
                    "--host-ram", "128GiB", "--max-context", "32K", "--no-calibration", "-v")
    assert "never: host and device are one memory   (48 MoE layers)" in out


def test_every_alternative_gets_the_speed_of_its_own_plan(capsys):
    code, out = run(capsys, "plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB",
                    "--max-context", "256K", "--strict", "--prefill", "65536",
                    "--no-calibration", "--json")
    assert code == 3
    doc = json.loads(out)
    assert doc["speed"] is None                      # the plan itself does not run
    alts = doc["alternatives"]
    assert {a["flag"] for a in alts} >= {"--kv", "--prefill", "--max-context"}
    own = [a for a in alts if a["flag"] != "--engine"]     # llama.cpp's remedy: not predicted yet
    assert own and all(a["speed"]["prefill_tokens_per_s"] > 0 and a["speed"]["decode_tokens_per_s"] > 0
                       for a in own)
    code, text = run(capsys, "plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB",
                     "--max-context", "256K", "--strict", "--prefill", "65536", "--no-calibration")
    assert "  --kv int8   (prefill " in text


def test_alternative_request_is_the_change_the_solver_verified():
    geom = load_model("Qwen3.5-35B-A3B")
    req = Request(max_context=262144, strict=True, prefill_mode="fixed", prefill_tokens=65536,
                  miss_policy="copy", reserve_bytes=900 << 20)
    plan = solve(geom, find_gpu("RTX 5060 Ti 16GB"), req)
    assert not plan.fits and len(plan.alternatives) >= 3
    for a in plan.alternatives:
        r = alternative_request(req, a)
        assert r is not None
        assert solve(geom, find_gpu("RTX 5060 Ti 16GB"), r, alternatives=False).fits, a


def test_llamacpp_plan_predicts_its_command_copies_for_prefill_and_runs_decode_on_the_cpu(capsys):
    args = ["plan", "Qwen3.5-35B-A3B", "--gpu", "RTX 5060 Ti 16GB", "--max-context", "256K",
            "--engine", "llama.cpp", "--no-calibration"]
    code, out = run(capsys, *args, "--json")
    assert code == 0
    doc = json.loads(out)
    s = doc["speed"]
    cpu_layers = len(doc["cpu_layers"])
    assert 0 < cpu_layers < 40
    assert s["prefill"]["copied_layers"] == cpu_layers and s["prefill"]["chunk"] == doc["ubatch"]
    assert s["decode"]["copied_layers"] == 0
    assert "llama.cpp copies" in s["policy"]
    code, text = run(capsys, *args)
    assert "speed  prefill " in text and "micro-batch at position 131072" in text


# ---- --miss-policy auto (the planner side) ---------------------------------------------------

def test_auto_prices_the_weight_arena_before_the_expert_cache_and_copies_only_large_steps(capsys):
    base = ["plan", *FIELD, "--gpu", "RTX 5060 Ti 16GB", "--no-calibration", "--json"]
    cpu = json.loads(run(capsys, *base, "--miss-policy", "cpu")[1])
    auto = json.loads(run(capsys, *base, "--miss-policy", "auto")[1])
    assert json.loads(run(capsys, *base)[1])["devices"] == auto["devices"]    # CUDA's default
    line = lambda doc, key: next(l for l in doc["devices"][0]["lines"] if l["key"] == key)  # noqa: E731
    assert line(cpu, "weight_arena")["bytes"] == 0
    arena = line(auto, "weight_arena")
    assert arena["bytes"] > 0 and "steps predicted faster copy" in arena["detail"]
    # the mandatory arena comes out of the expert cache, nothing else moves
    assert line(auto, "experts")["bytes"] <= line(cpu, "experts")["bytes"] - arena["bytes"] + \
        auto["experts"]["slot_bytes"]
    assert line(auto, "kv")["bytes"] == line(cpu, "kv")["bytes"]
    assert auto["prefill"]["selected"] == cpu["prefill"]["selected"]
    # the host keeps the experts that are not resident (auto never swaps), as with cpu
    host = lambda doc: next(l for l in doc["host"]["lines"] if l["key"] == "host_experts")  # noqa: E731
    assert "not resident" in host(auto)["detail"]
    s = auto["speed"]
    assert s["policy"] == "auto" and s["prefill"]["copied_layers"] == 40
    assert s["decode"]["copied_layers"] == 0
    assert s["prefill"]["tokens_per_s"] > 2 * cpu["speed"]["prefill"]["tokens_per_s"]


def test_auto_is_offered_the_cpu_policy_when_its_arena_does_not_fit(capsys):
    code, out = run(capsys, "plan", "Qwen3.5-35B-A3B", "--vram", "6GiB", "--max-context", "4K",
                    "--miss-policy", "auto", "--arena-slots", "400", "--no-calibration")
    assert code == 3 and "  --miss-policy cpu without --arena-slots" in out


def test_the_runtime_gets_the_crossovers_the_model_decides_by():
    """`moefit serve --miss-policy auto` solves the plan with the crossovers of the speed
    model (one home: the prediction's auto copies exactly the layers whose tokens per
    missing expert reach them); decode-sized steps stay below, a full chunk is above."""
    from moefit.cli import build_parser
    from moefit.flags import plan_from_args, runnable_devices
    from moefit.plan import speed

    args = build_parser().parse_args(["serve", "Qwen3-30B-A3B", "--device", "cpu", "--vram", "16GiB",
                                      "--miss-policy", "auto", "--max-context", "8K",
                                      "--host-ram", "256GiB"])
    devices = runnable_devices(args)           # auto runs: no refusal
    geom = load_model("Qwen3-30B-A3B")
    plan = plan_from_args(geom, devices, args)
    assert plan.fits and {l for l, _ in plan.miss_crossover} == {l.index for l in geom.moe_layers}
    assert {c for _, c in plan.miss_crossover} == {float("inf")}     # the simulated device: one memory
    cuda = solve(geom, find_gpu("RTX 4090"), Request(max_context=8192, miss_policy="auto"))
    cross = speed.plan_crossovers(cuda, default_host_speed())
    assert all(4 < c < 64 for c in cross.values()), cross       # llama.cpp copies from 32
    host = default_host_speed()
    for chunk in (16, 4096):
        s = predict_plan(replace(cuda, prefill_selected=chunk), host, policy="auto")
        expect = 0 if chunk * 8 / 128 < min(cross.values()) else len(geom.moe_layers)
        assert s.prefill.copied == expect
    assert predict_plan(cuda, host, policy="auto").decode.copied == 0

def test_a_cpu_device_prices_a_large_chunk_on_the_measured_dequantize_and_gemm_path():
    # a prefill chunk gives each expert more tokens than the batched kernel takes
    # (cpu_kernels.TOKENS_PER_EXPERT): the runtime dequantizes and multiplies expert by
    # expert, so a slower measured GEMM must slow the predicted prefill and leave decode
    from moefit.devices import Device
    from moefit.units import GIB
    geom = load_model("Qwen3-30B-A3B")
    device = Device("cpu", "simulated", "cpu", 64 * GIB, 64 * GIB, simulated=True, runtime_bytes=0)
    base = default_host_speed(threads=1)
    deq = {t: 4e9 for t in base.kernel_rates}
    fast, slow = (replace(base, dequant_rates=deq, gemm_flops=g) for g in (1e12, 1e10))
    res = {l.index: l.moe.num_experts for l in geom.moe_layers}
    kw = dict(context=8192, chunk=2048, seqs=1, policy="cpu")
    got = {h.gemm_flops: predict(geom, rates_for(device, h), kv_format("bf16"), res, **kw) for h in (fast, slow)}
    plain = predict(geom, rates_for(device, base), kv_format("bf16"), res, **kw)
    assert got[1e10].prefill.tokens_per_s < got[1e12].prefill.tokens_per_s
    assert got[1e10].decode.tokens_per_s == got[1e12].decode.tokens_per_s == plain.decode.tokens_per_s


def test_host_calibration_keeps_the_large_path_and_a_version_1_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    path = calibration.save_host({1: (20e9, {"Q4_K": 40e9}, {"Q4_K": 2e9, "Q8_0": 3e9}, 150e9)})
    got = calibration.load_host(threads=1)
    assert got.dequant_rate("Q8_0") == 3e9 and got.dequant_rate("Q6_K") == 2e9 and got.gemm_flops == 150e9
    doc = json.loads(path.read_text())
    doc["schema"] = "moefit.host/1"
    path.write_text(json.dumps(doc))
    warnings = []
    assert calibration.load_host(warn=warnings.append) is None
    assert "before the large-product figures" in warnings[0]
