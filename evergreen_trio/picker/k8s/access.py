"""Cluster access: kubeconfig resolution and the lightkube client, on Trio.

Why lightkube: it is maintained, typed, and async through ``httpx2``, whose transport runs on
``anyio`` and therefore directly under ``trio.run`` (no asyncio loop, no bridge). Two of its
conveniences are not used because they are asyncio-only: the watch's built-in retry sleeps with
``asyncio.sleep``, so every watch here runs with ``on_error_raise`` and this package retries with
``trio.sleep``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx2
from lightkube import AsyncClient, ConfigError, KubeConfig

from evergreen_trio.picker.errors import PickerError

REQUEST_TIMEOUT_S = 10.0


class KubeError(PickerError):
    """No usable cluster access: a kubeconfig that does not load, or no in-cluster account."""


@dataclass(frozen=True)
class ClusterAccess:
    """A loaded kubeconfig (or in-cluster service account) and its default namespace."""

    config: KubeConfig
    namespace: str

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> ClusterAccess:
        """``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster service account; KubeError if none."""
        path = kubeconfig or os.environ.get("KUBECONFIG")
        try:
            config = KubeConfig.from_file(path) if path else KubeConfig.from_service_account()
            context = config.get()
            if context is None:
                raise ConfigError("no current context")
            namespace = context.namespace or "default"
        except (ConfigError, OSError, ValueError, KeyError) as exc:
            where = path or "the in-cluster service account"
            raise KubeError(f"expected cluster access from {where}, got {type(exc).__name__}: {exc}") from None
        return cls(config, namespace)

    def client(self) -> AsyncClient:
        """A new client; requests time out after 10 s (watches have their own server-side timeout)."""
        return AsyncClient(self.config, namespace=self.namespace, timeout=httpx2.Timeout(REQUEST_TIMEOUT_S))
