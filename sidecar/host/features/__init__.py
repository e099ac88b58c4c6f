"""The daemon's features: each a package that declares what it adds to the daemon."""
