"""Tools for property-testing Evergreen servers and clients (docs/testing.md).

- ``strategies``: hypothesis strategies for node DAGs, the fragment streams that deliver them,
  and invalid sessions labelled with the rule they break.
- ``model``: the expected result of a session as pure functions (flattening, reassembly).
- ``wire``: a synchronous grpcio client that plays a whole session (needs ``grpcio``).
- ``checks`` and ``machine``: the invariants, and a RuleBasedStateMachine that plays them
  against any server address.
- ``conformance``: ``evergreen-trio conformance HOST:PORT``.
- ``subprocess_server`` and ``pytest_plugin``: our server in a child process, and fixtures.
- ``kube_api``: a stand-in Kubernetes API server (lists, watches, 410 Gone, restarts) for the
  picker's discovery and leader election.

Nothing is imported here, so loading the pytest plugin stays cheap.
"""
