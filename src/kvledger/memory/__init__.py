"""KV memory: page and slot pools, the radix prefix cache, and the ledger that audits them."""

from .ledger import AuditReport, Holding, Ledger
from .pools import KVBuffer, PagePool, ReqSlotPool
from .radix import RadixCache, TreeNode

__all__ = [
    "AuditReport",
    "Holding",
    "KVBuffer",
    "Ledger",
    "PagePool",
    "RadixCache",
    "ReqSlotPool",
    "TreeNode",
]
