"""The picker's Kubernetes side: cluster access, InferencePool discovery, Lease leader election."""

from evergreen_trio.picker.k8s.access import ClusterAccess, KubeError
from evergreen_trio.picker.k8s.discovery import PoolRef, parse_selector, pool_discovery
from evergreen_trio.picker.k8s.leader import lease_election

__all__ = ["ClusterAccess", "KubeError", "PoolRef", "lease_election", "parse_selector", "pool_discovery"]
