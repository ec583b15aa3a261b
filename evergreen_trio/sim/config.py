"""The simulator's knobs: one frozen dataclass, validated once when it is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from evergreen_trio.sim.errors import SimConfigError

# The model-server engines whose metric names the simulator can present.
METRICS_ENGINES = ("vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm")


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes one simulated vLLM server: its models, its capacity and its timings.

    Times are model times; ``time_scale`` multiplies all of them, so a benchmark on a slow
    machine can stretch the simulated GPU until Python's own overhead is small beside it.
    """

    model: str = "sim-model"
    """The served model name (``/v1/models``, the ``model`` a request must name)."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters a request may name instead of the base model."""
    max_batch: int = 16
    """Most sequences running at once (vLLM ``max_num_seqs``)."""
    kv_blocks: int = 512
    """KV cache size in blocks (vLLM ``num_gpu_blocks``)."""
    block_size: int = 16
    """Tokens per KV block."""
    chars_per_token: int = 4
    """The simulated tokenizer: this many characters make a token."""
    prefill_us_per_token: float = 50.0
    """Prefill time per prompt token that is not in the prefix cache, microseconds."""
    decode_ms_per_token: float = 5.0
    """Time of one decode step with a batch of one, milliseconds."""
    decode_batch_factor: float = 0.03
    """Each extra running sequence makes a decode step this fraction slower."""
    max_batched_tokens: int = 8192
    """Most uncached prompt tokens prefilled in one step (a first request is always admitted)."""
    max_loras: int = 2
    """Most LoRA adapters loaded at once; a batch never mixes more."""
    lora_load_ms: float = 25.0
    """Time added to a step that loads an adapter which is not loaded, milliseconds."""
    max_model_len: int = 8192
    """Most prompt plus output tokens per request."""
    default_max_tokens: int = 16
    """Output tokens when a request does not say."""
    max_waiting: int = 4096
    """Most queued requests; one more is answered 503."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body; a larger one is answered 413."""
    seed: int = 0
    """Seed of the generated reply text (timing does not depend on it)."""
    time_scale: float = 1.0
    """Multiplies every simulated duration."""
    metrics_engine: str = "vllm"
    """Whose metric names ``/metrics`` presents: vllm, sglang, trtllm-serve or triton-tensorrt-llm."""

    def __post_init__(self) -> None:
        positive_ints = (
            "max_batch", "kv_blocks", "block_size", "chars_per_token", "max_batched_tokens",
            "max_model_len", "default_max_tokens", "max_waiting", "max_body_bytes",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SimConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise SimConfigError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        for name in ("prefill_us_per_token", "decode_ms_per_token", "decode_batch_factor", "lora_load_ms"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise SimConfigError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.time_scale, int | float) or self.time_scale <= 0:
            raise SimConfigError(f"time_scale must be a number > 0, got {self.time_scale!r}")
        if not self.model:
            raise SimConfigError("model must be a non-empty name")
        if self.metrics_engine not in METRICS_ENGINES:
            raise SimConfigError(f"metrics_engine must be one of {', '.join(METRICS_ENGINES)}, "
                                 f"got {self.metrics_engine!r}")
        names = [self.model, *self.lora_adapters]
        if len(set(names)) != len(names) or not all(names):
            raise SimConfigError(f"model and lora_adapters must be distinct non-empty names, got {names}")
        if self.lora_adapters and self.max_loras < 1:
            raise SimConfigError(f"max_loras must be >= 1 when adapters are served, got {self.max_loras}")
        if self.default_max_tokens >= self.max_model_len:
            raise SimConfigError(
                f"default_max_tokens must be < max_model_len ({self.max_model_len}), got {self.default_max_tokens}"
            )

    @property
    def block_chars(self) -> int:
        """Characters in one full KV block of prompt text."""
        return self.block_size * self.chars_per_token


OPTION_HELP: Mapping[str, str] = {
    "model": "served model name",
    "max_batch": "most running sequences",
    "kv_blocks": "KV cache blocks",
    "block_size": "tokens per KV block",
    "chars_per_token": "characters per simulated token",
    "prefill_us_per_token": "prefill microseconds per uncached prompt token",
    "decode_ms_per_token": "decode step milliseconds at batch 1",
    "decode_batch_factor": "decode step slowdown per extra running sequence",
    "max_batched_tokens": "most uncached prompt tokens prefilled per step",
    "max_loras": "most LoRA adapters loaded at once",
    "lora_load_ms": "milliseconds to load an adapter",
    "max_model_len": "most prompt + output tokens",
    "default_max_tokens": "output tokens when the request does not say",
    "max_waiting": "most queued requests (then 503)",
    "max_body_bytes": "largest request body (then 413)",
    "seed": "seed of the generated text",
    "time_scale": "multiplies every simulated duration",
    "metrics_engine": "whose metric names /metrics presents (" + " | ".join(METRICS_ENGINES) + ")",
}
"""Short help of each knob a command line sets (``evergreen-trio sim``, ``gateway --simulate``)."""
