"""The host side: everything the daemon (``esi-sidecar serve``) runs on the GPU host.

Settings, wiring, the poller and its sources, the store, the HTTP API, systemd
notification and the checkpoint uploader. Needs the ``[server]`` extra (the uploader
needs ``[upload]``). Nothing outside this package imports it, except ``sidecar.cli``
(lazily) and the tools.
"""
