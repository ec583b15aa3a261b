"""``metrics-data-source``, ``models-data-source`` and ``dcgm-data-source`` over https, as the
reference's: the server's certificate is not verified unless ``insecureSkipVerify: false``, then
against ``caCertPath``; polled over real sockets from a TLS stand-in serving vLLM's metrics page,
its ``/v1/models`` and a dcgm-exporter page. The legacy flags too
(``--model-server-metrics-scheme https``, ``--model-server-metrics-https-insecure-skip-verify``),
through the command as a user types it."""

from __future__ import annotations

import ssl
import time
from functools import partial
from pathlib import Path

import pytest
import trio
import trustme
from picker_cli import EPHEMERAL_PORTS, picker_process, wait_health
from test_cli_reference_flags import LEGIT_BODY, route
from test_dcgm import dcgm_page
from test_models_source import VLLM_MODELS
from test_multicluster_e2e import Counted

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker import parse_config
from evergreen_trio.picker.config import Endpoint, PickerConfig
from evergreen_trio.picker.dcgm import GPU_UTILIZATION_KEY
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.runtime import Scrapers
from evergreen_trio.picker.scheduler import PoolSnapshot

PAGE = render_metrics("vllm", EndpointMetrics(waiting=3, kv_usage=0.25)).encode()
PAGES = {"/metrics": PAGE, "/v1/models": VLLM_MODELS, "/dcgm": dcgm_page([("", 30), ("", 64)]).encode()}


async def vllm_over_tls(nursery: trio.Nursery, ca: trustme.CA) -> int:
    """A model server's metrics page over https, its certificate issued by ``ca``; its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)

    async def handle(request: HttpRequest) -> HttpResponse:
        page = PAGES.get(request.target)
        return HttpResponse(200 if page else 404, [("content-type", "text/plain")], page or b"")

    port: int = await nursery.start(partial(serve_http, handle, "127.0.0.1", 0, max_body=1024, ssl_context=context))
    return port


def https_config(port: int, parameters: str, more: str = "") -> PickerConfig:
    """Metrics over https with ``parameters``; ``more``: further plugins, then the data layer."""
    return parse_config(f"""
pool: {{name: tls, endpoints: ['127.0.0.1:{port}'], refreshMetricsInterval: 10ms}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: metrics-data-source, parameters: {{scheme: https, {parameters}}}}}
- {{type: core-metrics-extractor}}
- {{type: queue-scorer}}
{more}schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}]
""")


async def scraped(nursery: trio.Nursery, config: PickerConfig) -> tuple[PoolSnapshot, Counted]:
    """The config's endpoints scraped for a while (until one is ready, or 40 scrape intervals)."""
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, time.monotonic)
    errors = Counted()
    Scrapers(nursery, config, snapshot, lambda: None, errors).sync(config.pool.endpoints)
    with trio.move_on_after(config.pool.refresh_interval_s * 40 + 2):
        while not snapshot.ready_states():  # noqa: ASYNC110 (the scrape task's snapshot)
            await trio.sleep(0.01)
    return snapshot, errors


async def test_the_model_servers_certificate_is_not_verified_by_default(nursery: trio.Nursery) -> None:
    port = await vllm_over_tls(nursery, trustme.CA())  # a CA nobody trusts
    snapshot, errors = await scraped(nursery, https_config(port, "path: /metrics"))
    (state,) = snapshot.ready_states()
    assert state.metrics is not None and state.metrics.waiting == 3 and state.metrics.kv_usage == 0.25
    assert not errors.polls


async def test_verified_against_its_ca_or_refused_without_it(nursery: trio.Nursery, tmp_path: Path) -> None:
    ca = trustme.CA()
    port = await vllm_over_tls(nursery, ca)
    snapshot, errors = await scraped(nursery, https_config(port, "insecureSkipVerify: false"))
    assert snapshot.ready_states() == [] and errors.polls["metrics-data-source"] > 0  # the system roots
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    config = https_config(port, f"insecureSkipVerify: false, caCertPath: '{ca_file}'")
    assert config.pool.metrics_tls == (False, str(ca_file), "", "")
    snapshot, errors = await scraped(nursery, config)
    assert [s.endpoint for s in snapshot.ready_states()] == [Endpoint("127.0.0.1", port)] and not errors.polls


def data_sources_config(port: int, models: str, dcgm: str) -> PickerConfig:
    """Metrics over unverified https, and the models and DCGM sources with these https parameters."""
    return https_config(port, "path: /metrics", f"""\
- {{type: models-data-source, name: models, parameters: {{scheme: https, interval: 10ms, {models}}}}}
- {{type: models-data-extractor}}
- {{type: dcgm-data-source, name: gpus, parameters: {{scheme: https, port: 0, interval: 10ms, {dcgm}}}}}
- {{type: dcgm-extractor}}
dataLayer:
  sources:
  - {{pluginRef: metrics-data-source, extractors: [{{pluginRef: core-metrics-extractor}}]}}
  - {{pluginRef: models, extractors: [{{pluginRef: models-data-extractor}}]}}
  - {{pluginRef: gpus, extractors: [{{pluginRef: dcgm-extractor}}]}}
""")


async def test_models_and_dcgm_are_polled_over_https_verified_or_not(nursery: trio.Nursery, tmp_path: Path) -> None:
    ca = trustme.CA()
    port = await vllm_over_tls(nursery, ca)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    # models verified against its CA, the DCGM exporter left unverified (the reference's default)
    config = data_sources_config(port, f"insecureSkipVerify: false, caCertPath: '{ca_file}'", "path: /dcgm")
    assert config.pool.models_sources[0].tls == (False, str(ca_file), "", "")
    assert config.pool.dcgm_sources[0].tls == (True, "", "", "")
    snapshot, errors = await scraped(nursery, config)
    state = snapshot.states[f"127.0.0.1:{port}"]
    with trio.fail_after(10):
        while state.models is None or GPU_UTILIZATION_KEY not in state.attributes:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert [m.id for m in state.models] == ["meta-llama/Llama-3.1-8B-Instruct", "food-review"]
    assert state.attributes[GPU_UTILIZATION_KEY] == 0.64 and not errors.polls
    # the DCGM exporter verified against the system roots, which do not know this CA: its polls fail
    snapshot, errors = await scraped(nursery, data_sources_config(port, "path: /v1/models",
                                                                  "insecureSkipVerify: false"))
    state = snapshot.states[f"127.0.0.1:{port}"]
    with trio.fail_after(10):
        while state.models is None or errors.polls["dcgm-data-source"] < 2:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert GPU_UTILIZATION_KEY not in state.attributes and state.ready and not errors.polls["models-data-source"]


async def test_a_certificate_file_gone_bad_after_startup_leaves_the_picker_polling(nursery: trio.Nursery,
                                                                                    tmp_path: Path) -> None:
    # tls.client_context builds each source's context once, when the config loads, as the reference
    # builds its sources' clients: an endpoint joining after the CA file turned to garbage is polled.
    ca = trustme.CA()
    first, second = await vllm_over_tls(nursery, ca), await vllm_over_tls(nursery, ca)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    verified = f"insecureSkipVerify: false, caCertPath: '{ca_file}'"
    config = data_sources_config(first, verified, "path: /dcgm")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, time.monotonic)
    errors = Counted()
    scrapers = Scrapers(nursery, config, snapshot, lambda: None, errors)
    scrapers.sync(config.pool.endpoints)
    ca_file.write_text("not a certificate")
    joined = Endpoint("127.0.0.1", second)
    scrapers.sync([*config.pool.endpoints, joined])
    with trio.fail_after(10):
        while not ((state := snapshot.states.get(joined.address)) and state.ready and state.models):  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert not errors.polls


def test_a_certificate_file_that_does_not_load_fails_the_config(tmp_path: Path) -> None:
    missing = tmp_path / "absent.pem"
    with pytest.raises(ConfigError, match=r"absent\.pem") as caught:
        data_sources_config(1, f"insecureSkipVerify: false, caCertPath: '{missing}'", "path: /dcgm")
    assert caught.value.field == "EndpointPickerConfig.plugins[3].parameters"


async def routed_to(port: int, want: str | None, seconds: float) -> bool:
    """Whether the picker routes a request to ``want`` (None: answers it itself) within ``seconds``."""
    with trio.move_on_after(seconds):
        while True:
            fields = (await trio.to_thread.run_sync(route, port, LEGIT_BODY)).dynamic_metadata.fields
            destination = (fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
                           if "envoy.lb" in fields else None)
            if destination == want:
                return True
            await trio.sleep(0.1)
    return False


@pytest.mark.parametrize("verify", [False, True])
async def test_the_legacy_scheme_flag_scrapes_over_https(nursery: trio.Nursery, tmp_path: Path, verify: bool) -> None:
    port = await vllm_over_tls(nursery, trustme.CA())
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool:\n  name: tls\n  endpoints: ['127.0.0.1:{port}']\n")
    args = ["--config", str(config), *EPHEMERAL_PORTS, "--model-server-metrics-scheme", "https",
            *(["--model-server-metrics-https-insecure-skip-verify=false"] if verify else [])]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        if verify:  # a certificate no root vouches for: never ready, every request answered by the picker
            assert not await routed_to(picker.grpc, f"127.0.0.1:{port}", 2.0)
        else:
            assert await routed_to(picker.grpc, f"127.0.0.1:{port}", 10.0)
