"""KV memory: page and slot pools, the radix prefix cache, the ledger that audits them, and the
memory operations on behalf of requests and sessions (``KVManager``)."""

from .audit import AuditReport, Holding
from .kv_manager import KVManager
from .ledger import Ledger
from .pools import KVBuffer, PagePool, ReqSlotPool
from .radix import RadixCache, TreeNode
from .req_pages import PageWrite, request_holding
from .session_kv import Session, SessionKV
from .window import OUT_OF_WINDOW, WindowKV, release_window

__all__ = [
    "OUT_OF_WINDOW",
    "AuditReport",
    "Holding",
    "KVBuffer",
    "KVManager",
    "Ledger",
    "PagePool",
    "PageWrite",
    "RadixCache",
    "ReqSlotPool",
    "Session",
    "SessionKV",
    "TreeNode",
    "WindowKV",
    "release_window",
    "request_holding",
]
