"""Each running source's protection verdict (``/v1/protection``, docs/protection.md)."""
