"""The plugin registry against llm-d-router's: every type it registers is one here."""

from __future__ import annotations

import subprocess
import sys

from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES

REFERENCE_TYPES = frozenset({
    "active-request-scorer", "agent-identity", "always-disagg-multimodal-decider", "always-disagg-pd-decider",
    "anthropic-parser", "approx-prefix-cache-producer", "burst-prefix-cache-producer", "by-label",
    "by-label-selector", "concurrency-detector", "context-length-aware", "core-metrics-extractor",
    "data-parallel-profile-handler", "dcgm-data-source", "dcgm-extractor", "decode-filter",
    "destination-endpoint-served-verifier", "disagg-headers-handler", "disagg-profile-handler",
    "disaggregatedset-rollout-screener", "edf-ordering-policy", "encode-filter", "endpoint-attribute-filter",
    "endpoint-attribute-scorer", "endpoint-notification-source", "fcfs-ordering-policy", "file-discovery",
    "global-strict-fairness-policy", "header-based-testing-filter", "header-label-affinity-scorer",
    "header-profile-handler", "inflight-load-producer", "k8s-notification-source", "kv-cache-utilization-scorer",
    "label-selector-filter", "latency-scorer", "latency-slo-admitter", "load-aware-scorer", "local-syncer",
    "lora-affinity-scorer", "max-score-picker", "metrics-data-source", "mm-embeddings-cache-producer",
    "mm-embeddings-cache-scorer", "models-data-extractor", "models-data-source",
    "multicluster-approx-prefix-cache-producer", "multicluster-file-discovery",
    "multicluster-kv-cache-utilization-scorer", "multicluster-metrics-data-source", "multicluster-metrics-extractor",
    "multicluster-prefix-cache-scorer", "multicluster-queue-scorer", "multicluster-session-affinity-filter",
    "no-hit-lru-scorer", "openai-parser", "p2p-source-producer", "passthrough-parser", "pd-profile-handler",
    "precise-prefix-cache-producer", "precise-prefix-cache-scorer", "predicted-latency-producer", "prefill-filter",
    "prefill-header-handler", "prefix-based-pd-decider", "prefix-cache-affinity-filter", "prefix-cache-scorer",
    "priority-holdback-policy", "priority-then-time-eviction-order-policy", "probabilistic-admitter",
    "program-aware-fairness", "queue-scorer", "random-picker", "request-attribute-reporter",
    "round-robin-fairness-policy", "running-requests-size-scorer", "session-affinity-filter",
    "session-affinity-scorer", "session-id-producer", "sglanghttp-parser", "sheddable-eviction-filter",
    "single-profile-handler", "slo-deadline-ordering-policy", "slo-headroom-tier-filter",
    "soft-reflective-ceiling-policy", "static-usage-limit-policy", "token-load-scorer", "token-producer",
    "tokenizer", "topology-affinity-filter", "topology-affinity-scorer", "topology-extractor",
    "utilization-detector", "utilization-filter", "vertexai-parser", "vllmgrpc-parser", "vllmhttp-parser",
    "weighted-random-picker",
})
"""The plugin types llm-d-router ebab68792 registers (``cmd/epp/runner/runner.go`` and the parser,
data-layer and flow-control registries it calls), deprecated spellings included."""


def test_every_type_the_reference_registers_is_registered_and_its_alpha_ones_marked() -> None:
    assert set(PLUGIN_TYPES) == REFERENCE_TYPES  # and nothing of our own under the reference's config kind
    assert ALPHA_TYPES <= REFERENCE_TYPES


def test_importing_the_picker_registers_every_type_its_configs_name() -> None:
    """A fresh process that imports only the package sees the whole registry (no type is registered
    by a module a config parse would not import)."""
    script = ("import evergreen_trio.picker\nfrom evergreen_trio.picker.plugins import PLUGIN_TYPES\n"
              "print(sorted(PLUGIN_TYPES))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(PLUGIN_TYPES))
