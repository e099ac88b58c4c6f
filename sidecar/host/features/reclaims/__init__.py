"""What each reclaim cost: the ledger and ``/v1/reclaims`` (docs/protection.md)."""
