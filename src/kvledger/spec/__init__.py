"""Speculative decoding: draft proposers plugged into the scheduler (``Scheduler.proposer``); the
model runner verifies the drafts in the same forward as everything else."""

from .ngram import NgramProposer

__all__ = ["NgramProposer"]
