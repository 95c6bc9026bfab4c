"""Tier 3: the project's worker in the real workerd runtime (see semaphore.testing.workerd)."""
