"""``header-profile-handler``, sans-IO, as llm-d-router's
``scheduling/profilehandler/headerprofile``: each request runs exactly one scheduling profile, the
one a request header names, and that profile's pick is the request's.

- One configured profile: it always runs, whatever the header says.
- Else the header's value (``headerName``, default ``EPP-Profile``, compared in lower case;
  the value trimmed as Go's ``strings.TrimSpace``, its bytes matched verbatim) names the profile;
  a missing or blank header runs ``defaultProfile`` (default ``decode``).
- A value naming no profile (bytes that are no UTF-8 name none), or a default that is not one,
  runs none: the request is refused with 429, as the reference's scheduler reports it (the reason
  is logged, not sent; a logged value is cut at :data:`LOGGED_VALUE_CHARS`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from evergreen_trio._logsafe import peer_text
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.gotext import header_text, trim_space
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

log = logging.getLogger(__name__)

HEADER_PROFILE_HANDLER = "header-profile-handler"
LOGGED_VALUE_CHARS = 128


@dataclass(frozen=True)
class HeaderProfileHandler:
    """The header naming the profile (lower case) and the profile run without it."""

    header: str = "epp-profile"
    default_profile: str = "decode"

    def choose(self, headers: Mapping[str, str], profiles: Collection[str]) -> str:
        """The profile to run; RequestError 429 when the header or the default names none."""
        if len(profiles) == 1:
            return next(iter(profiles))
        value = trim_space(headers.get(self.header, ""))
        name = header_text(value) if value else self.default_profile
        if name is not None and name in profiles:
            return name
        shown = peer_text(value, LOGGED_VALUE_CHARS)
        reason = (f"no scheduling profile configured for {self.header!r} header value '{shown}'" if value else
                  f"defaultProfile {self.default_profile!r} is not a configured scheduling profile")
        log.info("picker.no_profile_selected reason=%s registered=%s", reason, sorted(profiles))
        raise RequestError(429, "failed to run any scheduler profile for the request")


def _header_profile_handler(params: Params) -> HeaderProfileHandler:
    header = params.text("headerName", "").strip().lower() or "epp-profile"
    return HeaderProfileHandler(header, params.text("defaultProfile", "").strip() or "decode")


register(HEADER_PROFILE_HANDLER,
         PluginType(Category.PROFILE_HANDLER, ("headerName", "defaultProfile"), _header_profile_handler))
