"""``python -m benchmarks.picker_calls`` runs each case with tiny counts, and its streams are routed as Envoy's are."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from benchmarks.picker_calls import Bench, Meter, main


def test_each_case_prints_its_counts(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--requests", "8", "--repeats", "1", "--endpoints", "3", "--streams-per-read", "2"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[0].strip() for row in rows] == ["routing", "observed", "floor"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


@pytest.mark.parametrize("case", ["routing", "observed"])
def test_every_request_is_routed_and_its_stream_ended(case: str) -> None:
    bench = Bench(case, endpoints=3, streams_per_read=4)
    bench.run(16, Meter())
    page = generate_latest(bench.metrics.registry).decode()
    assert 'inference_objective_request_total{model_name="bench",priority="0",target_model_name="bench"} 16.0' in page
    assert ("inference_objective_output_tokens_sum" in page) == (case == "observed")
    assert bench.server.open_streams == 0 and not bench.server.closed


def test_an_unknown_case_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sockets"])
    assert "unknown case 'sockets'" in capsys.readouterr().err


def test_with_tracing_every_request_is_traced(capsys: pytest.CaptureFixture[str]) -> None:
    bench = Bench("routing", endpoints=3, streams_per_read=4, tracing=1.0)
    spans: list[str] = []
    assert bench.picker.tracing is not None
    bench.picker.tracing.buffer.on_end = lambda span: spans.append(span.name)  # type: ignore[method-assign]
    bench.run(8, Meter())
    assert spans.count("gateway.request") == spans.count("pick_endpoints") == 8
    main(["routing", "--requests", "4", "--repeats", "1", "--tracing", "0.5"])
    assert capsys.readouterr().out.splitlines()[2].startswith("| routing |")
