"""The reference Endpoint Picker's command-line flags that ``evergreen-trio picker`` accepts.

The official ``inferencepool`` Helm chart passes the reference image's flags (Go ``pflag``
style: ``--flag value``, ``--flag=value``, bare ``--bool`` meaning true). The ones we implement
are plain options of the ``picker`` command (see :mod:`evergreen_trio.picker.cli`); the ones
here are accepted so the chart's arguments run unchanged, and either mapped (logging levels) or
ignored with one log line each saying so.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

# Flags taking a value that we accept and ignore, with why.
IGNORED_VALUE_FLAGS = {
    "--zap-encoder": "log lines are key=value text",
    "--zap-stacktrace-level": "no stack traces on log lines",
    "--zap-time-encoding": "log lines carry ISO time",
    "--refresh-prometheus-metrics-interval": "pool gauges are updated on every scrape",
    "--model-server-metrics-port": "metrics are scraped on the pool's target port",
    "--total-queued-requests-metric": "metric names follow the engine (vLLM by default)",
    "--total-running-requests-metric": "metric names follow the engine (vLLM by default)",
    "--kv-cache-usage-percentage-metric": "metric names follow the engine (vLLM by default)",
    "--lora-info-metric": "metric names follow the engine (vLLM by default)",
    "--cache-info-metric": "metric names follow the engine (vLLM by default)",
}
# Go booleans accepted and ignored.
IGNORED_BOOL_FLAGS = {
    "--health-checking": "gRPC health is always served",
    "--enable-pprof": "no pprof (Go profiler)",
    "--enable-cert-reload": "certificates under --cert-path are always reloaded on change",
    "--zap-devel": "one log format",
}
# Reference verbosity (logr V levels: 2 default, 3 verbose, 4 debug, 5 trace) -> Python level.
_VERBOSITY = {0: logging.WARNING, 1: logging.INFO, 2: logging.INFO, 3: logging.INFO}
_ZAP_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR,
               "dpanic": logging.CRITICAL, "panic": logging.CRITICAL, "fatal": logging.CRITICAL}


def go_bool(text: str) -> bool:
    """Go's ``strconv.ParseBool`` spellings; ArgumentTypeError for anything else."""
    value = text.removeprefix("=").lower()
    if value in ("1", "t", "true"):
        return True
    if value in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def verbosity(text: str) -> int:
    value = text.removeprefix("=")
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a verbosity number, got {text!r}")
    return int(value)


def add_reference_flags(parser: argparse.ArgumentParser) -> None:
    """Accept the reference-only flags (shown under their own heading in ``--help``)."""
    group = parser.add_argument_group("reference EPP flags accepted for the Helm chart (mapped or ignored)")
    group.add_argument("-v", "--v", dest="epp_verbosity", type=verbosity, default=None, metavar="N",
                       help="verbosity: 0 warnings, 1-3 info, 4+ debug")
    group.add_argument("--zap-log-level", dest="epp_log_level", default=None, metavar="LEVEL",
                       choices=sorted(_ZAP_LEVELS), help="debug | info | warn | error")
    for flag in IGNORED_VALUE_FLAGS:
        group.add_argument(flag, dest=_dest(flag), default=None, metavar="VALUE", help=argparse.SUPPRESS)
    for flag in IGNORED_BOOL_FLAGS:
        group.add_argument(flag, dest=_dest(flag), type=go_bool, nargs="?", const=True, default=None,
                           metavar="BOOL", help=argparse.SUPPRESS)


def _dest(flag: str) -> str:
    return "epp_" + flag.removeprefix("--").replace("-", "_")


def apply_reference_flags(args: argparse.Namespace) -> None:
    """Map the logging flags onto the root logger; log one line per ignored flag that was given."""
    level = None
    if args.epp_log_level is not None:
        level = _ZAP_LEVELS[args.epp_log_level]
    if args.epp_verbosity is not None:
        level = _VERBOSITY.get(args.epp_verbosity, logging.DEBUG)
    if level is not None:
        logging.getLogger().setLevel(level)
    for table in (IGNORED_VALUE_FLAGS, IGNORED_BOOL_FLAGS):
        for flag, why in table.items():
            value = getattr(args, _dest(flag), None)
            if value is not None:
                log.info("picker.flag_ignored flag=%s value=%s reason=%r", flag, value, why)
