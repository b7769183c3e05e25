"""nanocp: serving MoE LLMs with dynamic (per-request) context parallelism."""

__version__ = "0.1.0"
