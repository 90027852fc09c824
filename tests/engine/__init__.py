"""Whole-engine scenarios (the offline Engine on tiny models, strict memory): the seed reports,
sessions, fault containment, the executor and connector seams, speculation, compile."""
