"""Tools around the product: the cloud emulator, the policy simulator and the demo."""
