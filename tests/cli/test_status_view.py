"""``esi-sidecar status``'s lines from the daemon's bodies (issue 39, item 10)."""

from __future__ import annotations

from sidecar.cli.status_view import SayOnce, describe_sources

VOLC = ("no Volcengine credentials: set VOLCENGINE_ACCESS_KEY and VOLCENGINE_SECRET_KEY "
        "(plus VOLCENGINE_SESSION_TOKEN for STS credentials), or attach an IAM role to this "
        "instance")


def test_sources_not_on_this_machine_are_one_line_and_refusals_one_each() -> None:
    health = {"sources": {"volcengine-esi": {}},
              "skipped": {"aws": "no EC2 metadata service at http://x (cannot connect)",
                          "gcp": "no GCE metadata server at http://x (cannot connect)",
                          "azure": "no Azure metadata service (cannot connect)",
                          "slurm": "no Slurm job or config here",
                          "volcengine-events": f"refused: {VOLC} (asked again every 60 s)"}}
    assert describe_sources(health) == [
        "sources: volcengine-esi",
        "not on this machine: aws, azure, gcp, slurm (why: /healthz)",
        f"left out: volcengine-events  {VOLC} (asked again every 60 s)",
    ]


def test_the_credentials_sentence_is_said_once() -> None:
    once = SayOnce()
    lines = once.lines([f"last error: volcengine-esi: {VOLC}",
                        f"left out: volcengine-events  {VOLC} (asked again every 60 s)",
                        f"  unknown  volcengine-spot: {VOLC}"])
    assert lines[0].endswith(VOLC)
    assert lines[1] == ("left out: volcengine-events  no Volcengine credentials (as above) "
                        "(asked again every 60 s)")
    assert lines[2] == "  unknown  volcengine-spot: no Volcengine credentials (as above)"
    assert once.line(f"degraded: {VOLC}") == "degraded: no Volcengine credentials (as above)"
    assert "\n".join(lines).count("VOLCENGINE_ACCESS_KEY") == 1
