"""Builds the shipped prefill latency profiles (run: `python -m nanocp.prefill.profiles.build`).

- a100-llama3-8b.json: Eq. 1 fitted to Tetris' Table 1 (LLaMA3-8B, A100, ring attention, TP=1).
- h200-deepseek-v3.json: Eq. 1 derived from first principles (FLOPs of MLA + MoE per token at stated MFUs) for
  DeepSeek-V3 on H200, for ring attention and for all-to-all head parallelism (Ulysses).

Both are model outputs, not measurements on our hardware; every number's source is recorded in the JSON.
"""

from __future__ import annotations

from pathlib import Path

from nanocp.prefill.latency_model import (
    PROFILE_DIR,
    LatencyCoeffs,
    PrefillLatencyModel,
    evaluate_fit,
    fit,
    save_profile,
)

# --- Tetris Table 1: prefill latency (s) of LLaMA3-8B on A100, batch 1, TP=1, C=0 ------------------------------
TABLE1_PROMPTS = [4096, 8192, 16384, 32768, 65536, 131072, 262144]  # "4k".."256k", read as multiples of 1024
TABLE1_SECONDS: dict[int, list[float | None]] = {
    1: [0.28, 0.57, 1.29, 3.22, 9.05, 29.20, None],  # None = OOM in the paper
    2: [0.16, 0.31, 0.69, 1.67, 4.61, 14.30, 50.07],
    4: [0.13, 0.20, 0.39, 0.92, 2.43, 7.32, 24.77],
    8: [0.21, 0.24, 0.31, 0.58, 1.37, 3.96, 12.81],
    16: [0.39, 0.43, 0.46, 0.53, 0.96, 2.31, 7.02],
}


def table1_points(sp: int) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of Table 1 for one SP size, OOM entries dropped."""
    return [(n, t) for n, t in zip(TABLE1_PROMPTS, TABLE1_SECONDS[sp]) if t is not None]


def chunked_samples_from_table(sp: int) -> list[tuple[int, int, float]]:
    """Synthesised (C, L, seconds) samples with C > 0 from the causal-attention identity.

    A chunk of L tokens after C computed tokens does the work of a C+L prompt minus that of a C prompt, plus one
    fixed overhead: T(C, L) = T(0, C+L) - T(0, C) + a. Both prompt latencies are Table 1 measurements; `a` comes
    from a fit of Eq. 1 to the C = 0 points alone.
    """
    points = table1_points(sp)
    overhead = fit([(0, n, t) for n, t in points])[0].a
    samples = []
    for i, (ctx, t_ctx) in enumerate(points):
        for total, t_total in points[i + 1 :]:
            samples.append((ctx, total - ctx, t_total - t_ctx + overhead))
    return samples


def build_a100_llama3_8b() -> tuple[list[PrefillLatencyModel], dict]:
    coeffs, quality, table_quality = {}, {}, {}
    for sp in TABLE1_SECONDS:
        measured = [(0, n, t) for n, t in table1_points(sp)]
        coeffs[sp], quality[sp] = fit(measured + chunked_samples_from_table(sp))
        table_quality[str(sp)] = vars(evaluate_fit(coeffs[sp], measured))
    provenance = {
        "source": "Tetris (Li et al.), 'Optimizing Long-context LLM Serving via Fine-grained Sequence "
        "Parallelism', Table 1: LLaMA3-8B prefill latency on A100-SXM4-80GB, batch 1, TP=1, ring attention, "
        "prompts 4k..256k (read as 4096..262144 tokens), SP 1..16. SP=1 at 256k is OOM and left out.",
        "context_term": "Table 1 has only C=0 points. C>0 points are synthesised from the causal-attention "
        "identity T(C, L) = T(0, C+L) - T(0, C) + a_s, using pairs of measured prompt lengths (C, C+L) and a_s "
        "from a fit to the C=0 points alone; Eq. 1 is then fitted to measured + synthesised points.",
        "fit": "least squares weighted by 1/seconds (relative error), coefficients constrained >= 0 "
        "(exact: best feasible support of the 4 coefficients); fit_quality is over measured + synthesised "
        "points, table1_quality over the 4k..256k measurements only.",
        "table1_quality": table_quality,
        "kind": "fitted to published measurements (model output, not measured by nanocp)",
    }
    model = PrefillLatencyModel("ring", coeffs, quality, provenance)
    meta = {"source_paper": "papers/tetris-cdsp-prefill.md", "hardware": "NVIDIA A100-SXM4-80GB, TP=1 per instance"}
    return [model], meta


# --- DeepSeek-V3 on H200 from first principles -------------------------------------------------------------------
DSV3 = {  # HF DeepseekV3Config defaults (transformers), see REFERENCE.md
    "hidden": 7168,
    "layers": 61,
    "dense_layers": 3,
    "dense_intermediate": 18432,
    "moe_intermediate": 2048,
    "routed_per_token": 8,
    "shared_experts": 1,
    "routed_experts": 256,
    "heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope": 128,
    "qk_rope": 64,
    "v_head": 128,
}
H200 = {
    "fp8_dense_flops": 1979e12,  # NVIDIA H200 SXM datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense
    "bf16_dense_flops": 989e12,  # datasheet 1,979 with sparsity -> ~989 dense (REFERENCE.md: "about 990")
    "nvlink_bytes_per_s": 450e9,  # 900 GB/s bidirectional per GPU (REFERENCE.md) -> 450 GB/s each way
    "rdma_bytes_per_s": 50e9,  # one 400 Gb/s NIC per GPU: eight 50 GB/s NICs per node (REFERENCE.md)
}
ASSUMPTIONS = {
    "gemm_mfu": 0.40,  # assumed: FP8 block-scaled GEMMs (DeepGEMM) incl. MoE imbalance, fraction of FP8 peak
    "attention_mfu": 0.50,  # assumed: causal prefill attention (FA3-class kernels), fraction of BF16 peak
    "per_layer_overhead_s": 100e-6,  # assumed: ~25 kernels per layer at ~4 us launch/tail each
    "moe_all_to_all_floor_s": 191e-6,  # DeepEP EP8 dispatch 77 us + combine 114 us (REFERENCE.md, H800)
    "ring_step_latency_s": {"intra_node": 10e-6, "inter_node": 20e-6},  # assumed put + signal latency
    "all_to_all_latency_s": {"intra_node": 15e-6, "inter_node": 30e-6},  # assumed per all-to-all
    "gpus_per_node": 8,
}


def dsv3_gemm_macs_per_token() -> int:
    """Multiply-accumulates of all GEMMs for one token through the 61 layers (LM head excluded: last token only)."""
    m = DSV3
    qk_head = m["qk_nope"] + m["qk_rope"]
    attn_proj = (
        m["hidden"] * m["q_lora_rank"]  # q_a_proj
        + m["q_lora_rank"] * m["heads"] * qk_head  # q_b_proj
        + m["hidden"] * (m["kv_lora_rank"] + m["qk_rope"])  # kv_a_proj_with_mqa
        + m["kv_lora_rank"] * m["heads"] * (m["qk_nope"] + m["v_head"])  # kv_b_proj
        + m["heads"] * m["v_head"] * m["hidden"]  # o_proj
    )
    expert = 3 * m["hidden"] * m["moe_intermediate"]  # gate, up, down
    moe = m["hidden"] * m["routed_experts"] + (m["routed_per_token"] + m["shared_experts"]) * expert
    dense_mlp = 3 * m["hidden"] * m["dense_intermediate"]
    moe_layers = m["layers"] - m["dense_layers"]
    return m["layers"] * attn_proj + m["dense_layers"] * dense_mlp + moe_layers * moe


def dsv3_attention_macs_per_pair() -> int:
    """MACs of one (query, key) pair over all layers in the prefill (non-absorbed, MHA-form) MLA."""
    m = DSV3
    return m["layers"] * m["heads"] * (m["qk_nope"] + m["qk_rope"] + m["v_head"])


def dsv3_ulysses_bytes_per_token() -> int:
    """Bytes one token moves through all-to-alls per layer in head-parallel attention: q, k, v in, out back (bf16)."""
    m = DSV3
    qk_head = m["qk_nope"] + m["qk_rope"]
    return 2 * m["heads"] * (2 * qk_head + m["v_head"] + m["v_head"])


def dsv3_h200_coeffs(sp: int, attention: str) -> LatencyCoeffs:
    """Eq. 1 coefficients of one H200 instance (1 GPU, DP attention + EP MoE) inside an SP group of `sp`."""
    a = ASSUMPTIONS
    layers, moe_layers = DSV3["layers"], DSV3["layers"] - DSV3["dense_layers"]
    gemm_rate = a["gemm_mfu"] * H200["fp8_dense_flops"]  # FLOP/s
    attn_rate = a["attention_mfu"] * H200["bf16_dense_flops"]  # FLOP/s
    pair_seconds = 2 * dsv3_attention_macs_per_pair() / attn_rate
    inter_node = sp > a["gpus_per_node"]
    fixed = layers * a["per_layer_overhead_s"] + moe_layers * a["moe_all_to_all_floor_s"]
    # Each instance holds L/sp tokens and 1/sp of the causal pairs C*L + L*(L+1)/2 (zigzag + cache balancing).
    b = 2 * dsv3_gemm_macs_per_token() / gemm_rate / sp + 0.5 * pair_seconds / sp
    c = pair_seconds / sp
    d = 0.5 * pair_seconds / sp
    if attention == "ring":
        # sp - 1 KV hops per layer; transfer assumed overlapped with attention (see provenance for the range).
        step = a["ring_step_latency_s"]["inter_node" if inter_node else "intra_node"]
        return LatencyCoeffs(fixed + layers * (sp - 1) * step, b, c, d)
    if attention == "ulysses":
        # Two all-to-alls per layer (q/k/v in, output back), exposed: (sp - 1) / sp of each instance's L / sp
        # tokens leaves the GPU.
        if sp == 1:
            return LatencyCoeffs(fixed, b, c, d)
        latency = a["all_to_all_latency_s"]["inter_node" if inter_node else "intra_node"]
        bandwidth = H200["rdma_bytes_per_s"] if inter_node else H200["nvlink_bytes_per_s"]
        comm_b = layers * dsv3_ulysses_bytes_per_token() * (sp - 1) / (sp * sp) / bandwidth
        return LatencyCoeffs(fixed + layers * 2 * latency, b + comm_b, c, d)
    raise ValueError(f"unknown attention mode {attention!r}")


H200_SP_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def build_h200_deepseek_v3() -> tuple[list[PrefillLatencyModel], dict]:
    gemm_macs, pair_macs = dsv3_gemm_macs_per_token(), dsv3_attention_macs_per_pair()
    common = {
        "kind": "analytic first-principles model (model output, not measured), coefficients are exact formulas",
        "instance": "one H200 GPU running DP attention + EP MoE (DeepSeek's prefill deployment style); MoE "
        "work per GPU taken as its own tokens' expert work (balanced EP under load)",
        "gemm_macs_per_token": gemm_macs,
        "gemm_flops_per_token": 2 * gemm_macs,
        "attention_macs_per_query_key_pair": pair_macs,
        "model_config": DSV3,
        "model_config_source": "HF transformers DeepseekV3Config defaults (REFERENCE.md)",
        "hardware": H200,
        "assumptions": ASSUMPTIONS,
        "formula": "b_s = 2*gemm_macs/(gemm_mfu*fp8_peak)/s + pair_s/2/s, c_s = pair_s/s, d_s = pair_s/2/s with "
        "pair_s = 2*attention_macs_per_pair/(attention_mfu*bf16_peak); a_s = 61*per_layer_overhead + "
        "58*moe_all_to_all_floor + mode-specific communication latency",
        "sanity_check": "b_1 gives ~11.1k tokens/s per GPU for short prompts; DeepSeek's published H800 prefill "
        "average is ~73.7k tokens/s per 8-GPU node (~9.2k per GPU, incl. cache hits), same tensor-core peak",
    }
    ring = dict(
        common,
        communication="ring: sp-1 KV hops per layer at the step latency; transfer assumed hidden behind "
        "attention, which holds while each instance's chunk share L/s is >= ~1.1k tokens inside a node and "
        ">= ~10k tokens across nodes (bandwidth vs attention FLOPs per hop); below that the model is optimistic",
    )
    ulysses = dict(
        common,
        communication="ulysses (all-to-all head parallel): 2 all-to-alls per layer, latency in a_s, bytes "
        "(q, k, v, out in bf16) exposed in b_s at NVLink (s <= 8) or RDMA (s > 8) bandwidth",
    )
    models = [
        PrefillLatencyModel("ring", {s: dsv3_h200_coeffs(s, "ring") for s in H200_SP_SIZES}, {}, ring),
        PrefillLatencyModel("ulysses", {s: dsv3_h200_coeffs(s, "ulysses") for s in H200_SP_SIZES}, {}, ulysses),
    ]
    meta = {"hardware": "NVIDIA H200 SXM 141GB, 8 per node", "model": "DeepSeek-V3 (671B, 37B active)"}
    return models, meta


def write_profiles(out_dir: Path = PROFILE_DIR) -> list[Path]:
    a100_models, a100_meta = build_a100_llama3_8b()
    h200_models, h200_meta = build_h200_deepseek_v3()
    a100_path, h200_path = out_dir / "a100-llama3-8b.json", out_dir / "h200-deepseek-v3.json"
    save_profile(
        a100_path,
        a100_models,
        name="a100-llama3-8b",
        description="LLaMA3-8B prefill on A100 (TP=1 instances), Eq. 1 fitted to Tetris Table 1",
        provenance=a100_meta,
    )
    save_profile(
        h200_path,
        h200_models,
        name="h200-deepseek-v3",
        description="DeepSeek-V3 prefill on H200 (1-GPU DP-attention instances), Eq. 1 from FLOPs at stated MFU",
        provenance=h200_meta,
    )
    return [a100_path, h200_path]


def main() -> None:
    for path in write_profiles():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
