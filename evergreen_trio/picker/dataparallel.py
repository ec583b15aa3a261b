"""``data-parallel-profile-handler``, sans-IO, as llm-d-router's (ebab68792,
``profilehandler/dataparallel``, deprecated there for ``single-profile-handler`` with Istio >=
1.28.1): runs the one scheduling profile and sends the request to the picked pod's
``primaryPort`` (default 8000), naming the picked rank (its ``ip:port``) in
``x-data-parallel-host-port`` (:func:`~evergreen_trio.picker.routing_headers.at_primary_port`).

A config with more than one profile fails at startup (the reference's fails each request), and
``primaryPort: 0`` is refused (the reference then sends requests to port 0).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from evergreen_trio.picker.plugins import Category, Params, PluginType, register

DATA_PARALLEL_PROFILE_HANDLER = "data-parallel-profile-handler"


@dataclass(frozen=True)
class DataParallelHandler:
    """The pods' primary port, where every request is sent."""

    primary_port: int = 8000

    def choose(self, headers: Mapping[str, str], profiles: Collection[str]) -> str:
        """The profile to run: the one configured."""
        return next(iter(profiles))


def _data_parallel(params: Params) -> DataParallelHandler:
    return DataParallelHandler(params.integer("primaryPort", 8000, minimum=1, maximum=65535))


register(DATA_PARALLEL_PROFILE_HANDLER, PluginType(Category.PROFILE_HANDLER, ("primaryPort",), _data_parallel,
                                                   replaced_by="single-profile-handler"))
