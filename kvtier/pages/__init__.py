"""kvtier.pages: KV page memory and GPU↔host page copies (torch).

``DevicePages`` (block-major KV tensor on ``cuda`` or CPU), ``HostPages`` (pinned host pages that
back ``kvtier.offload.HostPagePool``), ``PageCopier`` (copy jobs: submit/poll/wait).
"""

from kvtier.pages.copy import CompletedCopy, CopyDirection, CopyJobId, PageCopier
from kvtier.pages.memory import DevicePages, HostPages, default_device

__all__ = [
    "CompletedCopy",
    "CopyDirection",
    "CopyJobId",
    "DevicePages",
    "HostPages",
    "PageCopier",
    "default_device",
]
