"""Flight as the control plane: ``GetFlightInfo`` points at our dissociated transport.

A ``pyarrow.flight`` server answers ``GetFlightInfo``/``ListFlights`` with endpoints
whose location is the Dissociated IPC URI (``ucx://host:port?want_data=..``) and whose
ticket is the ``want_data`` body. ``DoGet`` still works for plain Flight clients.
pyarrow runs the gRPC server on its own threads; Trio code only starts and stops it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import trio

from evergreen_trio.ipc.arrow import read_messages
from evergreen_trio.ipc.errors import TransportError, UnknownTicketError
from evergreen_trio.ipc.service import Catalog, fetch_table
from evergreen_trio.ipc.uri import SCHEMES, IpcUri


class ControlPlane(flight.FlightServerBase):  # type: ignore[misc]
    """Flight server describing ``catalog``; data is fetched from ``data_uri``."""

    def __init__(self, location: str, catalog: Catalog, data_uri: IpcUri) -> None:
        super().__init__(location)
        self.catalog = catalog
        self.data_uri = data_uri

    def _info(self, ticket: bytes) -> flight.FlightInfo:
        try:
            schema, batches = read_messages(self.catalog.lookup(ticket))
        except UnknownTicketError as exc:
            raise flight.FlightServerError(str(exc)) from None
        endpoint = flight.FlightEndpoint(ticket, [str(self.data_uri)])
        descriptor = flight.FlightDescriptor.for_path(ticket)
        rows = sum(batch.num_rows for batch in batches)
        size = sum(batch.nbytes for batch in batches)
        return flight.FlightInfo(schema, descriptor, [endpoint], rows, size)

    def list_flights(self, context: Any, criteria: bytes) -> Iterator[flight.FlightInfo]:
        for ticket in self.catalog.tickets:
            yield self._info(ticket)

    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        key = descriptor.path[0] if descriptor.path else descriptor.command
        return self._info(bytes(key))

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        try:
            schema, batches = read_messages(self.catalog.lookup(ticket.ticket))
        except UnknownTicketError as exc:
            raise flight.FlightServerError(str(exc)) from None
        return flight.RecordBatchStream(pa.Table.from_batches(batches, schema=schema))


async def locate(flight_location: str, ticket: bytes | str, *, timeout_s: float = 10.0) -> tuple[str, bytes]:
    """Ask a Flight server where ``ticket`` lives: its Dissociated IPC URI and the ticket to send there.

    Raises UnknownTicketError when the server says it knows no such flight (NOT_FOUND, or the
    server error :class:`ControlPlane` answers an unknown ticket with) or offers no IPC location,
    TransportError when it cannot be reached, fails otherwise or has not answered within ``timeout_s``.
    """
    key = ticket.encode() if isinstance(ticket, str) else ticket

    def info() -> flight.FlightInfo:
        with flight.connect(flight_location) as client:
            return client.get_flight_info(flight.FlightDescriptor.for_path(key),
                                          flight.FlightCallOptions(timeout=timeout_s))

    try:
        flight_info = await trio.to_thread.run_sync(info)
    except flight.FlightTimedOutError:
        raise TransportError(
            f"Flight info for {key[:64]!r} at {flight_location}: no answer within {timeout_s}s") from None
    except (KeyError, flight.FlightServerError) as exc:  # pyarrow's KeyError is gRPC's NOT_FOUND
        raise UnknownTicketError(f"Flight info for {key[:64]!r} at {flight_location}: {exc}") from None
    except (flight.FlightError, pa.ArrowException) as exc:  # unavailable (refused, reset), internal, cancelled
        raise TransportError(f"Flight info for {key[:64]!r} at {flight_location}: {exc}") from None
    for endpoint in flight_info.endpoints:
        for location in endpoint.locations:
            uri = location.uri.decode()
            if uri.split(":", 1)[0] in SCHEMES:
                return uri, endpoint.ticket.ticket
    raise UnknownTicketError(f"Flight info for {key[:64]!r}: expected a {SCHEMES} location, got none")


async def fetch_through_flight(flight_location: str, ticket: bytes | str) -> pa.Table:
    """Ask a Flight server where ``ticket`` lives, then fetch it over the dissociated transport."""
    uri, data_ticket = await locate(flight_location, ticket)
    return await fetch_table(uri, data_ticket)
