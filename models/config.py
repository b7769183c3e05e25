"""Model configuration for DeepSeek-V3-architecture models (MLA + DeepSeek MoE).

`ModelConfig` holds exactly the numbers the model math needs. It reads HF `config.json` files strictly: an
unsupported architecture, a key whose value would change the math in a way we do not implement, or a key we do not
know at all is an error naming the key, so a checkpoint never runs with silently wrong math.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .quantization import Fp8BlockQuantization, QuantizationError

SUPPORTED_ARCHITECTURE = "DeepseekV3ForCausalLM"
SUPPORTED_MODEL_TYPE = "deepseek_v3"
# model_type values of DeepseekV3ForCausalLM checkpoints: DeepSeek-V3 / V3.1 / R1 and Moonlight say "deepseek_v3",
# Kimi-K2 says "kimi_k2" (its remote code is DeepSeek-V3's); everything that changes the math is in the other keys.
SUPPORTED_MODEL_TYPES = (SUPPORTED_MODEL_TYPE, "kimi_k2")


class ConfigError(ValueError):
    """A config.json that nanocp cannot run exactly."""


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN rope scaling, with HF transformers' defaults for absent keys."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # scales cos/sin together with mscale_all_dim (HF `attention_factor`)
    mscale_all_dim: float | None = None  # also scales the softmax by mscale(factor, mscale_all_dim)^2
    attention_factor: float | None = None  # explicit cos/sin scale; overrides mscale/mscale_all_dim
    truncate: bool = True  # round the YaRN correction range to whole dims

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be > 0")

    def to_hf_dict(self, rope_theta: float) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "truncate": self.truncate,
        }
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 architecture hyper-parameters (HF `DeepseekV3Config` names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int  # width of one routed expert; shared experts are n_shared_experts times wider
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None -> plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int  # layers [0, first_k_dense_replace) are dense (all of them when >= the layer count)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    dtype: str = "float32"  # storage dtype of the checkpoint's unquantized tensors (informational)
    quantization: Fp8BlockQuantization | None = None  # FP8 block-quantized weights (dequantized at load)
    model_type: str = SUPPORTED_MODEL_TYPE  # one of SUPPORTED_MODEL_TYPES (same math)
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank must be > 0 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.first_k_dense_replace < 0:
            raise ConfigError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            raise ConfigError("intermediate_size must be > 0 when there are dense layers")
        if self.num_moe_layers > 0:
            self._check_moe()
        for key in ("bos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{key}={value} outside the vocabulary [0, {self.vocab_size})")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"eos_token_id={eos} outside the vocabulary [0, {self.vocab_size})")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(_model_type_message(self.model_type))

    def _check_moe(self) -> None:
        if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ConfigError("MoE layers need n_routed_experts > 0 and moe_intermediate_size > 0")
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.n_group <= 0 or self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} outside [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.experts_per_group < 2:
            raise ConfigError("group-limited routing scores groups by their top-2 experts: need >= 2 per group")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * self.experts_per_group:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} outside [1, topk_group * experts per group"
                f" = {self.topk_group * self.experts_per_group}]"
            )

    # ---- derived sizes -------------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values per token per layer in the latent KV cache (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_latent_dim(self) -> int:
        """Values per head of the absorbed decode query (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """Scale of q.k in attention: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling
        if yarn is not None and yarn.mscale_all_dim:
            mscale = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
            scale = scale * mscale * mscale
        return scale

    # ---- construction --------------------------------------------------------------------------------------

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The embedded default model: 3 layers (1 dense + 2 MoE), byte vocabulary, 16 experts, YaRN rope."""
        return cls(
            vocab_size=260,  # 256 bytes + <bos> <eos> <pad> <unk>
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=YarnScaling(
                factor=4.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            rope_interleave=True,
            max_position_embeddings=16384,
            bos_token_id=256,
            eos_token_ids=(257,),
            pad_token_id=258,
            tie_word_embeddings=False,
            dtype="float32",
            name="tiny",
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{config_file}: no config.json in the checkpoint directory")
        try:
            data = json.loads(config_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_file}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: expected a JSON object, got {type(data).__name__}")
        try:
            config = cls.from_hf_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{config_file}: {exc}") from exc
        return dataclasses.replace(config, name=str(path))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF DeepseekV3 config dict; raise ConfigError naming any key we cannot honour exactly."""
        _check_architecture(d)
        unknown = sorted(set(d) - _CONSUMED_KEYS - _HARMLESS_KEYS - set(_REQUIRED_VALUES))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}: they may change the model math")
        for key, allowed in _REQUIRED_VALUES.items():
            if key in d and d[key] not in allowed:
                raise ConfigError(f"unsupported {key}={d[key]!r} (supported: {sorted(map(repr, allowed))})")
        if "num_hidden_layers" not in d:
            raise ConfigError("missing required key 'num_hidden_layers'")

        defaults = _HF_DEFAULTS
        get = lambda key: d[key] if d.get(key) is not None else defaults[key]
        quantization = None
        if d.get("quantization_config") is not None:
            try:
                quantization = Fp8BlockQuantization.from_hf_dict(d["quantization_config"])
            except QuantizationError as exc:
                raise ConfigError(str(exc)) from exc
        rope_theta, rope_scaling = _parse_rope(d, get("max_position_embeddings"))
        eos = d.get("eos_token_id", defaults["eos_token_id"])
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        config = cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size"),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=get("num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank", defaults["q_lora_rank"]),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_group=get("n_group"),
            topk_group=get("topk_group"),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob")),
            first_k_dense_replace=get("first_k_dense_replace"),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(get("rope_interleave")),
            max_position_embeddings=get("max_position_embeddings"),
            bos_token_id=d.get("bos_token_id", defaults["bos_token_id"]),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            quantization=quantization,
            model_type=d["model_type"],
        )
        _check_derived(d, config)
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' DeepseekV3Config and `from_hf_dict` both read."""
        eos: int | list[int] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        d: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURE],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(self.rope_theta),
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "dtype": self.dtype,
        }
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_hf_dict()
        return d


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# ---- config.json parsing tables ----------------------------------------------------------------------------

# HF DeepseekV3Config defaults for keys a config.json may omit.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

_CONSUMED_KEYS = set(_HF_DEFAULTS) | {
    "architectures",
    "model_type",
    "num_hidden_layers",
    "pad_token_id",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "quantization_config",
    "dtype",
    "torch_dtype",
    "qk_head_dim",  # derived by HF; checked for consistency
    "head_dim",  # HF sets it to qk_rope_head_dim; checked for consistency
}

# Keys that never change inference math: training-only knobs, bookkeeping, generation defaults, and
# num_key_value_heads (MLA gives every head its own key and value through kv_b_proj, whatever it says).
_HARMLESS_KEYS = {
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "initializer_range",
    "use_cache",
    "output_router_logits",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "num_nextn_predict_layers",  # multi-token-prediction modules are stored as extra layers; we skip them
    "num_mtp_layers",
    "pretraining_tp",
    "attention_dropout",
    "num_key_value_heads",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tokenizer_class",
    # transformers 4.x PretrainedConfig attributes written by to_dict(use_diff=False): generation defaults and
    # bookkeeping of the config class, none of which enters the forward pass
    "add_cross_attention",
    "bad_words_ids",
    "begin_suppress_tokens",
    "cross_attention_hidden_size",
    "decoder_start_token_id",
    "diversity_penalty",
    "do_sample",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "is_decoder",
    "length_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_return_sequences",
    "output_scores",
    "prefix",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict_in_generate",
    "sep_token_id",
    "suppress_tokens",
    "task_specific_params",
    "temperature",
    "tf_legacy_loss",
    "tie_encoder_decoder",
    "top_k",
    "top_p",
    "torchscript",
    "typical_p",
    "use_bfloat16",
}

# Keys whose value changes the math: only these values are implemented.
_REQUIRED_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,),
}

_ROPE_KEYS = {
    "type",
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
}


def _check_architecture(d: dict[str, Any]) -> None:
    archs = d.get("architectures")
    if archs is not None and list(archs) != [SUPPORTED_ARCHITECTURE]:
        raise ConfigError(f"unsupported architectures={archs!r}: only {SUPPORTED_ARCHITECTURE} is supported")
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(_model_type_message(model_type))


def _model_type_message(model_type: Any) -> str:
    return (
        f"unsupported model_type={model_type!r} (supported: {', '.join(map(repr, SUPPORTED_MODEL_TYPES))}: the "
        f"{SUPPORTED_ARCHITECTURE} architecture of DeepSeek-V3/V3.1/R1, Kimi-K2 and Moonlight)"
    )


def _parse_rope(d: dict[str, Any], max_position_embeddings: int) -> tuple[float, YarnScaling | None]:
    """Read rope_theta + rope scaling from either the legacy (rope_scaling) or the transformers-5 layout."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
    elif d.get("rope_scaling"):
        raise ConfigError("both rope_parameters and rope_scaling are set; expected only one")
    if not isinstance(params, dict):
        raise ConfigError(f"rope parameters must be a dict, got {params!r}")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"unknown rope_scaling key(s) {unknown}: they may change the rope math")
    theta = params.get("rope_theta", d.get("rope_theta"))
    if "rope_theta" in params and d.get("rope_theta") not in (None, params["rope_theta"]):
        raise ConfigError(f"rope_theta={d['rope_theta']} disagrees with rope_parameters.rope_theta={theta}")
    theta = 10000.0 if theta is None else float(theta)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"unsupported rope partial_rotary_factor={params['partial_rotary_factor']}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: 'yarn' or none)")
    if params.get("factor") is None:
        raise ConfigError("yarn rope_scaling needs 'factor'")
    return theta, YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_position_embeddings),
        beta_fast=float(params.get("beta_fast") or 32.0),  # HF treats 0/None as the default
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _check_derived(d: dict[str, Any], config: ModelConfig) -> None:
    if d.get("qk_head_dim") not in (None, config.qk_head_dim):
        raise ConfigError(f"qk_head_dim={d['qk_head_dim']} != qk_nope_head_dim + qk_rope_head_dim")
    if d.get("head_dim") not in (None, config.qk_rope_head_dim):
        raise ConfigError(f"head_dim={d['head_dim']} != qk_rope_head_dim={config.qk_rope_head_dim}")
