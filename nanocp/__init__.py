"""nanocp: serving MoE LLMs with dynamic (per-request) context parallelism."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import nanocp` stays cheap (the CLI and the control plane do not need torch models).
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .data_plane.sampling import SamplingParams

        return SamplingParams
    if name in ("Engine", "EngineConfig", "RequestOutput"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'nanocp' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput"]
