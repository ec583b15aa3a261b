"""The benchmark's reference picker: grpcio's ``grpc.aio`` + xds-protos, the same decision core.

It serves ``ExternalProcessor/Process`` with :class:`evergreen_trio.picker.processor.Picker` (so
both pickers decide identically) and scrapes ``/metrics`` with asyncio tasks, the way a plain
grpcio implementation would; only the serving stack differs from ``evergreen-trio picker``.
Run: ``python -m benchmarks.grpcio_picker --config FILE --port 9002``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from benchmarks._harness import run_plain_asyncio
from evergreen_trio.picker import (
    Endpoint,
    MetricsError,
    Picker,
    PickerConfig,
    PoolSnapshot,
    load_config,
    parse_engine_metrics,
)


class Servicer(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        stream = self.picker.new_stream()
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                for reply in stream.on_end():
                    await context.write(reply)
                return
            for reply in stream.on_message(message):
                await context.write(reply)
            if stream.finished:
                return


async def scrape(client: httpx.AsyncClient, endpoint: Endpoint, config: PickerConfig, snapshot: PoolSnapshot) -> None:
    url = f"http://{endpoint.address}{config.pool.metrics_path}"
    while True:
        try:
            response = await client.get(url)
            snapshot.update(endpoint.address, parse_engine_metrics(endpoint.engine, response.text))
        except (httpx.HTTPError, MetricsError):
            snapshot.mark_failed(endpoint.address)
        await asyncio.sleep(config.pool.refresh_interval_s)


async def main(config: PickerConfig, port: int) -> None:
    snapshot = PoolSnapshot(config.pool.endpoints, config.pool.staleness_threshold_s, time.monotonic)
    server = grpc.aio.server()
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Servicer(Picker(config, snapshot)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    async with httpx.AsyncClient(timeout=config.pool.scrape_timeout_s) as client:
        tasks = [asyncio.create_task(scrape(client, e, config, snapshot)) for e in config.pool.endpoints]
        await server.wait_for_termination()
        for task in tasks:
            task.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, default=9002)
    args = parser.parse_args()
    run_plain_asyncio(main(load_config(args.config), args.port))
