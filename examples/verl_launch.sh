#!/usr/bin/env bash
# verl PPO that saves before the ESI / spot machine is released.
#
#   examples/verl_launch.sh data.train_files=... actor_rollout_ref.model.path=... [more overrides]
#
# verl already asks should_save_ckpt_esi(...) after every step and saves when it says so,
# but its own version only reads the capacity-block variables, which nothing sets on an
# ESI machine. sidecar.integrations.verl.install() swaps in one that asks the daemon
# first. verl's trainer runs in a Ray actor, so install it in every Ray worker process
# through Ray's worker_process_setup_hook: one extra Hydra override, no change to verl.
# (When your own script drives verl's trainer in one process, this line is enough:
#  import sidecar.integrations.verl as esi; esi.install()
#  With `ray job submit`: --runtime-env-json
#  '{"worker_process_setup_hook": "sidecar.integrations.verl.install",
#    "env_vars": {"ESI_SIDECAR_URL": "http://127.0.0.1:8791"}}')
# See docs/integrations.md, "verl".
set -euo pipefail

PYTHON="${PYTHON:-python3}"
# verl's single controller decides for all nodes: list every node's daemon, comma-
# separated (the earliest deadline wins; each daemon then has to listen on that address,
# ESI_SIDECAR_LISTEN).
ESI_SIDECAR_URL="${ESI_SIDECAR_URL:-http://127.0.0.1:8791}"
# verl ignores the ESI signal unless save_freq > 0. The margin (seconds) covers clock
# error, a late notice and the release itself; verl adds its own 60 s save estimate.
SAVE_FREQ="${SAVE_FREQ:-100}"
ESI_REDUNDANT_TIME="${ESI_REDUNDANT_TIME:-120}"

# Fail here, in seconds, rather than in a Ray worker an hour into the run.
if ! "$PYTHON" -c 'import verl' 2>/dev/null; then
    echo "verl is not installed for $PYTHON (pip install verl); esi-sidecar must be too" >&2
    exit 2
fi
ESI_SIDECAR_URL="$ESI_SIDECAR_URL" "$PYTHON" - <<'EOF'
from sidecar.train.client import SidecarClient

client = SidecarClient()  # reads ESI_SIDECAR_URL
answer = client.expiry()
if answer is None:
    print(f"warning: no daemon answered ({client.last_error}); verl falls back to "
          "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP")
else:
    print(f"esi-sidecar: release at {answer.expires_at or 'none scheduled'} "
          f"(source {answer.source})")
EOF

# Hydra parses commas and colons in a bare value, hence the inner single quotes.
exec "$PYTHON" -m verl.trainer.main_ppo \
    trainer.save_freq="$SAVE_FREQ" \
    trainer.esi_redundant_time="$ESI_REDUNDANT_TIME" \
    +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=sidecar.integrations.verl.install \
    "+ray_kwargs.ray_init.runtime_env.env_vars.ESI_SIDECAR_URL='$ESI_SIDECAR_URL'" \
    "$@"
