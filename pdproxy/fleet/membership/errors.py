"""Typed errors of pdproxy.fleet.membership.

Hierarchy::

    ProxyError (pdproxy.errors)
    └── MembershipError         dynamic membership could not apply a change
        ├── MemberConflict      the name belongs to a configured backend or another source
        ├── MemberRemoved       an operator removed or drained it: out until re-admitted
        └── AnnouncementRefused an authenticated announcement the proxy will not act on
                                (an address outside the allowed networks, the registrant cap)

Malformed announcements are :class:`kvtier.errors.AnnouncementError` (the wire format's own
error); the registration listener counts both and drops the message.
"""

from __future__ import annotations

from pdproxy.errors import ProxyError


class MembershipError(ProxyError):
    """Dynamic membership could not apply a change."""


class MemberConflict(MembershipError):
    """A backend of that name exists and belongs to the config, the admin API or another
    source (or registrant): it is neither replaced nor drained."""


class MemberRemoved(MembershipError):
    """An operator removed (or drained, and it then left) this backend through the admin API:
    its source may not bring it back until it is re-admitted
    (:meth:`~pdproxy.fleet.membership.members.Membership.readmit`)."""


class AnnouncementRefused(MembershipError):
    """An authenticated announcement the proxy will not act on (the reason is a short label
    for metrics: ``address``, ``full``, ``owner``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
