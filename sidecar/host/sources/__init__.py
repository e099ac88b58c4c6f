"""Deadline sources, one module each; ``base`` holds the protocol, ``registry`` maps names
to modules and imports a source only when it is chosen."""
