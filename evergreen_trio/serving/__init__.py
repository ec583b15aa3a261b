"""Serving Evergreen sessions in production: the server, the ``serve`` command and what it runs with.

``server`` (:class:`~evergreen_trio.Server`), ``server_cli`` (``evergreen-trio serve``), ``workers``
(``--workers N``), ``app_import`` (``--app MODULE:FACTORY``), ``auth`` (authorizers), ``tls`` (contexts),
``metrics`` (Prometheus), ``signals`` (stop and drain on SIGINT/SIGTERM) and ``evergreen_front`` (an
Envoy in front of many servers). Import each module by its path; the user-facing names are re-exported
by :mod:`evergreen_trio`.
"""
