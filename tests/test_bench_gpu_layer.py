"""bench.gpu_layer: the per-phase layer benchmark's CPU dry run, its inputs, the profile fit and the comparison."""

import json

import pytest
import torch

from nanocp.bench import gpu_layer as gl
from nanocp.bench.latency_profile import PHASE_FEATURES, LatencyProfile
from nanocp.bench.simulator import SimConfig, UnboundedPrefillTier, simulate
from nanocp.bench.workloads import Request
from nanocp.data_plane.kernels.reference import TorchRoutingKernels
from nanocp.models import merge_attention_partials, mla_attention_with_lse, mla_paged_attention_with_lse

TINY = gl.LayerDims.tiny()
PROFILE_PHASES = [p for p in PHASE_FEATURES if p != "host"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The CLI's tiny CPU dry run: (exit code, output dir)."""
    out = tmp_path_factory.mktemp("gpu_layer")
    return gl.main(["--device", "cpu", "--tiny", "--budget-s", "60", "--out", str(out)]), out


def test_dry_run_times_every_phase(dry_run):
    code, out = dry_run
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "cpu-dryrun-deepseek-v3.json",
        "gpu_layer_cpu-dryrun.json",
        "gpu_layer_cpu-dryrun.md",
    ]
    raw = json.loads((out / "gpu_layer_cpu-dryrun.json").read_text())
    assert raw["schema"] == gl.SCHEMA and raw["skipped_points"] == 0 and "note" not in raw
    assert set(raw["phases"]) == set(gl.PHASE_ORDER)
    for name, rec in raw["phases"].items():
        assert rec["error"] is None and rec["errors"] == [], name
        assert rec["implementation"], name
        assert rec["points"] and all(p["seconds"] > 0 for p in rec["points"]), name
        assert all(r["seconds"] > 0 for p in rec["points"] for r in p["by_impl"].values()), name
    assert raw["phases"]["attention"]["implementation"] == "reference"  # no FlashMLA on a CPU
    assert raw["phases"]["merge"]["implementation"] == "merge_routed/torch"
    assert {p["ep"] for p in raw["phases"]["expert"]["points"]} == {2, 4, 8, 16}
    assert any(p["shards_per_request"] > 1 for p in raw["phases"]["attention"]["points"])
    md = (out / "gpu_layer_cpu-dryrun.md").read_text()
    for name in gl.PHASE_ORDER:
        assert f"| {name} | {raw['phases'][name]['implementation']}" in md


def test_dry_run_profile_loads_and_simulates(dry_run):
    _, out = dry_run
    data = json.loads((out / "cpu-dryrun-deepseek-v3.json").read_text())
    assert data["name"] == "cpu-dryrun-deepseek-v3" and data["kind"] == "measured"
    assert "dry run" in data["description"]
    prof = LatencyProfile.from_dict(data)
    cost = prof.iteration_cost([4096.0] * 4, [2.0] * 4, [2.0] * 4)
    assert cost.total_s > 0 and prof.ideal_iteration_time(4 * 4096, 8, 4) > 0
    for phase in gl.PHASE_ORDER:  # every measured phase replaced, its provenance says so
        assert data["provenance"][f"phases.{phase}"].startswith("measured on CPU"), phase
    base = LatencyProfile.load(gl.DEFAULT_BASE)
    assert prof.phases["moe_dispatch"] == base.phases["moe_dispatch"] and prof.links == base.links
    reqs = [Request(f"r{i}", 0.01 * i, 2000, 4) for i in range(6)]
    cfg = SimConfig(num_nodes=1, instances_per_node=4, profile=prof, kv_capacity_tokens=100_000, progress=False)
    res = simulate(reqs, cfg, UnboundedPrefillTier(lambda n: 0.01))
    assert len(res.requests) == 6 and all(r.finish_s > r.ttft_s for r in res.requests)


def _synthetic(coefs: dict[str, dict[str, float]], expert: dict[int, dict[str, float]]) -> dict:
    """Timings generated from a known linear model (seconds)."""

    def points(feature_rows):
        return [{**f, "seconds": None} for f in feature_rows]

    batches = [{"batch": b} for b in (1, 8, 32, 64, 128, 256)]
    feats = {
        "attention": [
            {"kv_tokens": r * n, "shards": r, "row_tokens": n} for r, n in ((1, 1024), (8, 4096), (64, 4096), (4, 512))
        ],
        "merge": [{"batch": b, "parts": k, "partials": b * (k - 1)} for b in (1, 64) for k in (1, 2, 8)],
    }
    phases = {}
    for phase in ("attention", "merge", "dense", "shared_expert", "dense_mlp", "iteration"):
        pts = points(feats.get(phase, batches))
        for p in pts:
            c = coefs[phase]
            p["seconds"] = c["const"] + sum(c[f] * p[f] for f in PHASE_FEATURES[phase])
        phases[phase] = {"points": pts, "implementation": "synthetic"}
    pts = []
    for ep, c in expert.items():
        for b in (1, 64, 256):
            pts.append({"ep": ep, "batch": b, "seconds": c["const"] + c["batch"] * b})
    phases["expert"] = {"points": pts, "implementation": "synthetic"}
    return {"phases": phases, "dtype": "bfloat16"}


def test_fit_recovers_known_coefficients():
    coefs = {
        "attention": {"const": 7e-6, "kv_tokens": 3e-10, "shards": 2e-7},
        "merge": {"const": 4e-6, "partials": 5e-8, "batch": 1e-8},
        "dense": {"const": 5e-5, "batch": 6e-7},
        "shared_expert": {"const": 3e-5, "batch": 1.5e-7},
        "dense_mlp": {"const": 1e-4, "batch": 1.2e-6},
        "iteration": {"const": 4.5e-4, "batch": 2.8e-6},
    }
    expert = {8: {"const": 3.3e-4, "batch": 1.1e-6}, 32: {"const": 9e-5, "batch": 1.05e-6}}
    timings = _synthetic(coefs, expert)
    prof = gl.fit_profile(timings, gpu_name="NVIDIA H100 80GB HBM3", hbm_bytes=85e9)
    assert prof["name"] == "h100-deepseek-v3" and prof["kind"] == "measured"
    assert prof["memory"]["hbm_bytes"] == 85e9 and "H100" in prof["description"]
    scale = {"us": 1e-6, "s": 1.0, "ms": 1e-3}[prof["time_unit"]]
    for phase, c in coefs.items():
        for k, v in c.items():
            assert prof["phases"][phase][k] * scale == pytest.approx(v, rel=1e-9, abs=1e-18), (phase, k)
    for ep, c in expert.items():
        for k, v in c.items():
            assert prof["phases"]["expert"]["by_ep"][str(ep)][k] * scale == pytest.approx(v, rel=1e-9), (ep, k)
    loaded = LatencyProfile.from_dict(prof)
    assert loaded.phase("dense", 32)(batch=64) == pytest.approx(5e-5 + 64 * 6e-7, rel=1e-9)
    assert loaded.phase("expert", 32)(batch=10) == pytest.approx(9e-5 + 10 * 1.05e-6, rel=1e-9)
    assert all(f["rel_rms_residual"] == pytest.approx(0, abs=1e-9) for p, f in prof["measurement"]["fits"].items()
               if p != "expert")  # fmt: skip


def test_comparison_has_a_row_per_phase(dry_run):
    _, out = dry_run
    measured = json.loads((out / "cpu-dryrun-deepseek-v3.json").read_text())
    rows = gl.compare_profiles(measured)
    assert {r["phase"] for r in rows} == set(PROFILE_PHASES) | {"total"}
    for r in rows:
        assert r["published_us"] > 0 and r["ratio"] == pytest.approx(r["measured_us"] / r["published_us"])
        if r["phase"] in ("moe_dispatch", "moe_combine"):
            assert r["source"] == "copied" and r["ratio"] == pytest.approx(1.0)
    md = gl.markdown_report({"phases": {}}, measured, rows)
    assert sum(line.startswith("| ") for line in md.splitlines()) >= len(rows)


def test_zero_budget_skips_the_grid_and_says_so():
    res = gl.time_layer_phases("cpu", TINY, gl.Grid.tiny(), 0.0, torch.float32)
    assert res["skipped_points"] > 0 and "skipped" in res["note"]
    for name, rec in res["phases"].items():
        assert rec["points"] == [] and rec["skipped"], name
        assert all("core" not in p and p["reason"] == "budget" for p in rec["skipped"])
    prof = gl.fit_profile(res)  # nothing measured: every phase copied from the base, and said so
    assert all(prof["provenance"][f"phases.{p}"].startswith("not measured") for p in gl.PHASE_ORDER)
    LatencyProfile.from_dict(prof)


def test_first_pass_points_come_first():
    grid = gl.Grid.tiny()
    res = gl.time_layer_phases("cpu", TINY, grid, 60.0, torch.float32, phases=("attention",))
    pts = res["phases"]["attention"]["points"]
    first = [p for p in pts if p["core"]]
    assert first and pts[: len(first)] == first  # core points come first
    assert len(first) >= 3  # enough to fit const + kv_tokens + shards


def test_bf16_dry_run_takes_the_gpu_dtype_paths():
    """bf16 on the CPU runs the torch branches the GPU takes (no fused CPU kernels)."""
    res = gl.time_layer_phases("cpu", TINY, gl.Grid.tiny(), 60.0, torch.bfloat16)
    for name, rec in res["phases"].items():
        assert rec["error"] is None and rec["errors"] == [], name
        assert all(p["seconds"] > 0 for p in rec["points"]), name
        if name in ("dense", "shared_expert", "dense_mlp", "iteration"):
            assert rec["implementation"] == "decode_layers/torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_implementations_agree(dtype):
    gate_up = gl._random((4, TINY.hidden, 2 * TINY.moe_intermediate), "cpu", dtype, std=0.2)
    down = gl._random((4, TINY.moe_intermediate, TINY.hidden), "cpu", dtype, std=0.2)
    case = gl.ExpertCase.make(gate_up, down, [3, 0, 5, 1])  # uneven, one idle expert
    checks = gl.verify_experts(case)
    assert checks["loop"] is None and checks["slab_bmm"] is None
    ref = case.loop().float()
    # the loop itself against plain per-expert math
    x, start = case.x.float(), 0
    for e, n in enumerate(case.counts):
        if n == 0:
            continue
        h = x[start : start + n] @ gate_up[e].float()
        y = (torch.nn.functional.silu(h[:, : TINY.moe_intermediate]) * h[:, TINY.moe_intermediate :]) @ down[e].float()
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        assert torch.allclose(ref[start : start + n], y, rtol=tol, atol=tol * float(y.abs().max()))
        start += n
    if hasattr(torch, "_grouped_mm"):
        try:
            torch._grouped_mm(case.x, gate_up, offs=case.offs)
        except Exception as e:  # not on this build: the check must say so
            assert checks["grouped_mm"] is not None and type(e).__name__ in checks["grouped_mm"]
        else:
            assert checks["grouped_mm"] is None
            scale = float(ref.abs().max())
            assert (
                float((case.grouped_mm().float() - ref).abs().max())
                <= (1e-5 if dtype == torch.float32 else 3e-2) * scale
            )
    else:
        assert "no torch._grouped_mm" in checks["grouped_mm"]


def test_grouped_mm_fallback_is_recorded(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("grouped GEMM not supported here")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    res = gl.time_layer_phases("cpu", TINY, gl.Grid.tiny(), 60.0, torch.float32, phases=("expert",))
    rec = res["phases"]["expert"]
    assert rec["implementation"] in ("loop", "slab_bmm")
    assert "grouped GEMM not supported" in rec["notes"]["verification"]["grouped_mm"]
    assert "torch._grouped_mm not used" in rec["notes"]["grouped_mm_fallback"]
    assert all("grouped_mm" not in p["by_impl"] for p in rec["points"]) and rec["errors"] == []


def _contiguous_kv(case: gl.AttentionCase, row: int) -> torch.Tensor:
    """Row `row`'s KV tokens gathered page by page from the pool -> [lens[row], Dqk]."""
    pages = case.kv_pages[case.block_table[row].long()]  # [n, page, Dqk]
    return pages.reshape(-1, pages.shape[-1])[: int(case.lens[row])]


def test_attention_case_computes_the_real_attention():
    pool = gl.make_kv_pool(TINY, 64, "cpu", torch.float32)
    case = gl.attention_case(TINY, pool, requests=3, shards_per_request=1, row_tokens=40)  # 40: a partial page
    o, lse = case.run(mla_paged_attention_with_lse)
    for r in range(3):
        kv = _contiguous_kv(case, r)[None]
        o_ref, lse_ref = mla_attention_with_lse(case.q[r : r + 1], kv, torch.tensor([40]), case.scale, TINY.kv_lora)
        torch.testing.assert_close(o[r : r + 1], o_ref)
        torch.testing.assert_close(lse[r : r + 1], lse_ref)
    # the pages of different rows are disjoint
    assert len(set(case.block_table.flatten().tolist())) == case.block_table.numel()

    # CP shards: one request in 4 shards; their merged partials = attention over the whole request
    split = gl.attention_case(TINY, pool, requests=1, shards_per_request=4, row_tokens=24)
    assert torch.equal(split.q[0], split.q[3])
    o_s, lse_s = split.run(mla_paged_attention_with_lse)
    merged, merged_lse = merge_attention_partials(o_s, lse_s)  # [H, Dv], [H]
    whole = torch.cat([_contiguous_kv(split, r) for r in range(4)])[None]
    o_ref, lse_ref = mla_attention_with_lse(split.q[:1], whole, torch.tensor([96]), split.scale, TINY.kv_lora)
    torch.testing.assert_close(merged[None], o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse[None], lse_ref, rtol=1e-5, atol=1e-5)


def test_attention_bench_times_the_reference_on_the_case():
    bench = gl._AttentionBench(TINY, gl.Grid.tiny(), torch.device("cpu"), torch.float32)
    bench.build()
    point = next(p for p in bench.points() if p["shards_per_request"] > 1)
    fns = bench.functions(point)
    assert set(fns) == {"reference"}
    case = gl.attention_case(TINY, bench.pool, point["requests"], point["shards_per_request"], point["row_tokens"])
    o, lse = fns["reference"]()
    o_ref, lse_ref = case.run(mla_paged_attention_with_lse)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert o.shape == (point["shards"], TINY.heads, TINY.kv_lora)


def test_merge_inputs_are_the_instance_merge():
    o, lse, res, index = gl.merge_inputs(TINY, batch=3, parts=4, device="cpu", dtype=torch.float32)
    assert res.shape == (9, TINY.heads, TINY.kv_lora + 1) and index.shape == (3, 4)
    merged, merged_lse = TorchRoutingKernels.merge_routed(o, lse, res, index)
    parts_o, parts_lse = gl.stacked_partials(o, lse, res, index)
    assert parts_o.shape == (4, 3, TINY.heads, TINY.kv_lora)
    ref_o, ref_lse = merge_attention_partials(parts_o, parts_lse)
    torch.testing.assert_close(merged, ref_o)
    torch.testing.assert_close(merged_lse, ref_lse)
    torch.testing.assert_close(parts_o[0], o)  # the local partial first


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "invalid choice"),
        (["--device", "cpu", "--budget-s", "-1"], "--budget-s must be >= 0"),
        (["--device", "cpu", "--base", "no-such-profile"], "--base"),
        (["--tiny"], "required"),
    ],
)
def test_bad_arguments_fail_in_one_line(argv, message, capsys, tmp_path):
    assert gl.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_bad_argument(capsys):
    assert gl.main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
    ],
)
def test_gpu_slug(name, slug):
    assert gl.gpu_slug(name) == slug


def test_real_grid_stays_within_memory_bounds():
    """The real run's attention grid: every point under the KV-token cap, the shard splits included."""
    bench = gl._AttentionBench(gl.LayerDims(), gl.Grid(), torch.device("cpu"), torch.bfloat16)
    pts = bench.points()
    assert max(p["kv_tokens"] for p in pts) <= gl.Grid().max_kv_tokens
    assert {p["row_tokens"] for p in pts} >= {1024, 131072}
    assert {p["shards_per_request"] for p in pts} >= {1, 2, 4, 8}
    expert = gl._ExpertBench(gl.LayerDims(), gl.Grid(), torch.device("cpu"), torch.bfloat16).points()
    assert {p["ep"] for p in expert} == {8, 16, 32, 64, 128, 256}
    assert all(p["rows"] == 8 * p["batch"] for p in expert)
    assert {p["local_experts"] for p in expert if p["ep"] == 32} == {8}


def test_failures_are_recorded_and_the_run_goes_on(monkeypatch, tmp_path):
    """A phase whose weights cannot be built and points that run out of memory: recorded, exit code 0."""

    def no_weights(self):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1.85 GiB")

    def big_fails(q, kv_pages, block_table, lens, scale, v_dim):
        if int(lens.sum()) > 512:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return mla_paged_attention_with_lse(q, kv_pages, block_table, lens, scale, v_dim)

    monkeypatch.setattr(gl._IterationBench, "build", no_weights)
    monkeypatch.setattr(gl, "mla_paged_attention_with_lse", big_fails)
    assert gl.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    raw = json.loads((tmp_path / "gpu_layer_cpu-dryrun.json").read_text())
    it = raw["phases"]["iteration"]
    assert (
        it["points"] == [] and it["skipped"] and "building the weights: RuntimeError: CUDA out of memory" in it["error"]
    )
    assert {p["reason"] for p in it["skipped"]} == {"phase error"} and "note" not in raw
    att = raw["phases"]["attention"]
    failed = [p for p in att["points"] if p["seconds"] is None]
    assert failed and all(p["kv_tokens"] > 512 for p in failed)
    assert all(p["by_impl"]["reference"]["error"].endswith("Tried to allocate 2.00 GiB") for p in failed)
    assert len(att["errors"]) == len(failed) and att["implementation"] == "reference"
    assert all(raw["phases"][p]["error"] is None for p in ("dense", "expert", "merge"))
    prof = json.loads((tmp_path / "cpu-dryrun-deepseek-v3.json").read_text())
    assert prof["provenance"]["phases.iteration"].startswith("not measured (building the weights")
    assert prof["provenance"]["phases.attention"].startswith("measured on CPU")
    assert "error: RuntimeError: CUDA out of memory" in (tmp_path / "gpu_layer_cpu-dryrun.md").read_text()
