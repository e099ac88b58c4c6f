#!/usr/bin/env bash
# Install esi-sidecar as a host service: a venv, the settings file, the systemd unit.
#
#   sudo ./install.sh --region cn-beijing          # from this checkout
#   sudo ./install.sh --help                       # every option
#
# Safe to run again: every file is compared before it is written, and a run that finds
# everything in place changes nothing and says "unchanged". See docs/deploy.md.
set -euo pipefail

readonly EXIT_USAGE=2
readonly UNIT_NAME=esi-sidecar.service
readonly DEFAULT_PREFIX=/opt/esi-sidecar
readonly ENV_DIR=/etc/esi-sidecar
readonly ENV_FILE=$ENV_DIR/esi-sidecar.env
readonly UNIT_DIR=/etc/systemd/system
readonly STATE_DIR=/var/lib/esi-sidecar # StateDirectory=esi-sidecar
readonly STAMP_NAME=.esi-sidecar-install # in the venv: what was installed, for re-runs
readonly MIN_PYTHON_MINOR=9              # Python 3.9+

usage() {
	cat <<'EOF'
Usage: sudo ./install.sh [OPTIONS]

Install esi-sidecar as a systemd service: a venv under --prefix with esi-sidecar[server]
(plus [upload] with --upload),
/etc/esi-sidecar/esi-sidecar.env (mode 0600) and /etc/systemd/system/esi-sidecar.service,
then `systemctl enable --now` when systemd runs. Running it again changes nothing.

What to install (default: the checkout this script sits in):
  --wheel FILE           install this wheel (with its [server] extra) from a file
  --version X            install esi-sidecar[server]==X from the package index
  --prefix DIR           venv location (default /opt/esi-sidecar)
  --python PATH          interpreter for the venv, 3.9 or newer (default python3)
  --upload               also the [upload] extra (boto3) for the checkpoint uploader to
                         s3://; on by itself when ESI_SIDECAR_UPLOAD_TO is an s3:// URL
                         (a file:// volume needs no more than [server])
  --pip-args "ARGS"      extra arguments for pip install, e.g. "--index-url URL";
                         PIP_* variables work too

Settings written to /etc/esi-sidecar/esi-sidecar.env (a new file only; see --force-env):
  --access-key KEY       Volcengine access key      [env VOLCENGINE_ACCESS_KEY]
  --secret-key KEY       Volcengine secret key      [env VOLCENGINE_SECRET_KEY]
                         (a flag shows up in `ps` and shell history: prefer the variable;
                         with neither, the SDK uses the instance's role)
  --region REGION        e.g. cn-beijing            [env ESI_SIDECAR_REGION]
  --listen ADDRS         e.g. 127.0.0.1:8791,172.17.0.1:8791  [env ESI_SIDECAR_LISTEN]
  --set NAME=VALUE       any daemon setting, e.g. --set ESI_SIDECAR_POLL_INTERVAL=15
                         (every ESI_SIDECAR_* variable in the environment is passed on too;
                         VOLCENGINE_SESSION_TOKEN as well)
  --force-env            replace an existing env file (default: keep it untouched)

Actions:
  --uninstall            stop and remove the service, the unit and the venv; keep the env file
  --purge                with --uninstall: also remove the env file and the state directory
  --venv-only            only the venv (what the Dockerfile runs); no env file, no unit
  --no-start             install, but do not enable or start the service
  --dry-run              print each action; change nothing (secrets print as ****)
  --root DIR             install into a staging root: every path is prefixed with DIR and
                         systemctl is never called (allowed without root)
  -h, --help             this text

Exit status: 0 done, 1 a step failed, 2 bad usage or a host that cannot run it.
EOF
}

# ------------------------------------------------------------------ output helpers

say() { printf '%s\n' "$*"; }
warn() { printf 'install.sh: warning: %s\n' "$*" >&2; }
die() { # die STATUS MESSAGE...
	local status=$1
	shift
	printf 'install.sh: %s\n' "$*" >&2
	exit "$status"
}
usage_error() { die "$EXIT_USAGE" "$* (see ./install.sh --help)"; }

# ------------------------------------------------------------------ options

prefix=$DEFAULT_PREFIX
root=""
python=python3
wheel=""
version=""
pip_args=()
dry_run=0
force_env=0
uninstall=0
purge=0
venv_only=0
extras=server
no_start=0
access_key=${VOLCENGINE_ACCESS_KEY:-}
secret_key=${VOLCENGINE_SECRET_KEY:-}
secret_from_flag=0
declare -A settings=()  # env file name -> value
declare -a setting_order=()

set_setting() { # set_setting NAME VALUE: later calls win (flags after the environment)
	if [[ -z ${settings[$1]+x} ]]; then
		setting_order+=("$1")
	fi
	settings[$1]=$2
}

# Every ESI_SIDECAR_* variable of the environment is a daemon setting, except the
# training side's ESI_SIDECAR_URL.
while IFS= read -r name; do
	if [[ $name == ESI_SIDECAR_* && $name != ESI_SIDECAR_URL ]]; then
		set_setting "$name" "${!name}"
	fi
done < <(compgen -e | LC_ALL=C sort)

while (($#)); do
	flag=$1
	shift
	value=""
	inline=0
	if [[ $flag == --*=* ]]; then
		value=${flag#*=}
		flag=${flag%%=*}
		inline=1
	fi
	case $flag in
	--prefix | --root | --python | --wheel | --version | --pip-args | --access-key | \
		--secret-key | --region | --listen | --set)
		if ! ((inline)); then
			(($#)) || usage_error "$flag needs a value"
			value=$1
			shift
		fi
		;;
	*)
		if ((inline)); then
			usage_error "unknown option '${flag}' (or it takes no value)"
		fi
		;;
	esac
	case $flag in
	--prefix) prefix=$value ;;
	--root) root=$value ;;
	--python) python=$value ;;
	--wheel) wheel=$value ;;
	--version) version=$value ;;
	--pip-args)
		read -r -a extra <<<"$value"
		pip_args+=("${extra[@]}")
		;;
	--access-key) access_key=$value ;;
	--secret-key)
		secret_key=$value
		secret_from_flag=1
		;;
	--region) set_setting ESI_SIDECAR_REGION "$value" ;;
	--listen) set_setting ESI_SIDECAR_LISTEN "$value" ;;
	--set)
		if [[ $value != *=* ]]; then
			usage_error "--set needs NAME=VALUE, got '${value}'"
		fi
		name=${value%%=*}
		if [[ ! $name =~ ^ESI_SIDECAR_[A-Z0-9_]+$ ]]; then
			usage_error "--set takes ESI_SIDECAR_* names, got '${name}'"
		fi
		set_setting "$name" "${value#*=}"
		;;
	--force-env) force_env=1 ;;
	--uninstall) uninstall=1 ;;
	--purge) purge=1 ;;
	--venv-only) venv_only=1 ;;
	--upload) extras=server,upload ;;
	--no-start) no_start=1 ;;
	--dry-run) dry_run=1 ;;
	-h | --help)
		usage
		exit 0
		;;
	*) usage_error "unknown option '${flag}'" ;;
	esac
done

if ((purge)) && ! ((uninstall)); then
	usage_error "--purge goes with --uninstall"
fi
if [[ ${settings[ESI_SIDECAR_UPLOAD_TO]-} == s3://* ]]; then
	extras=server,upload # an uploader to S3 is configured: it needs boto3
fi
if [[ -n $wheel && -n $version ]]; then
	usage_error "--wheel and --version exclude each other"
fi
if [[ $prefix != /* || $prefix == / ]]; then
	usage_error "--prefix must be an absolute path below /, got '${prefix}'"
fi
prefix=${prefix%/}
if [[ -n $root ]]; then
	[[ -d $root ]] || usage_error "--root $root is not a directory"
	root=$(cd "$root" && pwd)
	[[ $root == / ]] && root=""
fi
if [[ -n $wheel ]]; then
	[[ -f $wheel ]] || usage_error "--wheel $wheel: no such file"
	wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
fi
if [[ $EUID -ne 0 && -z $root ]] && ! ((dry_run)); then
	die "$EXIT_USAGE" "run as root (sudo ./install.sh ...), or give --root DIR to install" \
		"into a staging folder"
fi

# The checkout this script sits in, when it does (not when piped into bash).
# deploy/ next to it holds the example env file; the unit comes from the installed package.
src_dir=""
deploy_dir=""
script=${BASH_SOURCE[0]:-}
if [[ -n $script && -f $script ]]; then
	here=$(cd "$(dirname "$script")" && pwd)
	deploy_dir=$here/deploy
	if [[ -f $here/pyproject.toml && -d $here/sidecar ]]; then
		src_dir=$here
	fi
fi

venv=$root$prefix
env_dir=$root$ENV_DIR
env_file=$root$ENV_FILE
unit_file=$root$UNIT_DIR/$UNIT_NAME
state_dir=$root$STATE_DIR
systemd_running=0
if [[ -z $root && -d /run/systemd/system ]]; then
	systemd_running=1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

changed=0 # how many things this run changed (or would change, under --dry-run)

# ------------------------------------------------------------------ actions

# run CMD...: run it, or under --dry-run print it. Never pass a secret to run.
run() {
	if ((dry_run)); then
		say "would run: $*"
	else
		"$@"
	fi
}

ensure_dir() { # ensure_dir DIR MODE
	local dir=$1 mode=$2
	if [[ -d $dir ]]; then
		if [[ $(stat -c %a "$dir") != "${mode#0}" ]]; then
			run chmod "$mode" "$dir"
			say "mode $mode: $dir"
			changed=$((changed + 1))
		fi
		return 0
	fi
	run install -d -m "$mode" "$dir"
	((dry_run)) || say "created: $dir"
	changed=$((changed + 1))
}

# put_file SRC DEST MODE [SHOWN]: give DEST the content of SRC unless it already has it.
# SHOWN (optional) is a masked copy to print under --dry-run instead of the content.
put_file() {
	local src=$1 dest=$2 mode=$3 shown=${4:-}
	if [[ -f $dest ]] && cmp -s "$src" "$dest"; then
		if [[ $(stat -c %a "$dest") == "${mode#0}" ]]; then
			say "unchanged: $dest"
			return 0
		fi
		run chmod "$mode" "$dest"
		say "mode $mode: $dest"
		changed=$((changed + 1))
		return 0
	fi
	changed=$((changed + 1))
	if ((dry_run)); then
		say "would write: $dest (mode $mode)"
		if [[ -n $shown ]]; then
			sed 's/^/    | /' "$shown"
		fi
		return 0
	fi
	local tmp
	tmp=$(mktemp "$(dirname "$dest")/.${dest##*/}.XXXXXX") # mktemp: mode 0600
	cat "$src" >"$tmp"
	chmod "$mode" "$tmp"
	mv -f "$tmp" "$dest"
	say "wrote: $dest"
}

remove_path() { # remove_path PATH WHAT
	if [[ -e $1 || -L $1 ]]; then
		run rm -rf -- "$1"
		((dry_run)) || say "removed: $1"
		changed=$((changed + 1))
	else
		say "absent: $1 ($2)"
	fi
}

# ------------------------------------------------------------------ host checks

check_python() {
	if ! command -v "$python" >/dev/null 2>&1; then
		die "$EXIT_USAGE" "no Python interpreter '${python}' found; on Debian/Ubuntu:" \
			"apt-get install python3 python3-venv"
	fi
	local found
	if ! found=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
		die "$EXIT_USAGE" "'${python}' does not run as a Python interpreter"
	fi
	local major=${found%%.*} minor=${found#*.}
	if [[ ! $major =~ ^[0-9]+$ || ! $minor =~ ^[0-9]+$ ]] ||
		((major < 3 || (major == 3 && minor < MIN_PYTHON_MINOR))); then
		die "$EXIT_USAGE" "esi-sidecar needs Python 3.${MIN_PYTHON_MINOR} or newer; '${python}'" \
			"is ${found} (give another with --python PATH)"
	fi
	if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
		die "$EXIT_USAGE" "'${python}' (Python ${found}) lacks the venv module; on" \
			"Debian/Ubuntu: apt-get install python3-venv (or python${found}-venv)"
	fi
	say "python: $(command -v "$python") (Python ${found})"
	check_interpreter_visible "$python"
}

# The venv's bin/python links to the base interpreter. PrivateTmp=yes in the unit gives the
# service a /tmp of its own, so a base under /tmp or /var/tmp makes systemd fail with the
# opaque 203/EXEC. One under a home (pyenv, conda) is fine: `esi-sidecar install` writes
# the unit with ProtectHome=tmpfs and that interpreter's folders bound in, read-only.
check_interpreter_visible() { # check_interpreter_visible PYTHON
	local base
	base=$("$1" -c 'import os, sys
print(os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable))' 2>/dev/null) ||
		return 0
	case $base in
	/tmp/* | /var/tmp/*) ;;
	*) return 0 ;;
	esac
	local message="the venv would run ${base}, which the unit's PrivateTmp= hides from the service"
	if [[ -n $root ]] || ((venv_only)); then
		warn "$message"
		return 0
	fi
	die "$EXIT_USAGE" "$message; use an interpreter outside /tmp: --python /usr/bin/python3" \
		"(apt-get install python3 python3-venv)"
}

# ------------------------------------------------------------------ the venv

# What this run would install, as one line; stored in the venv so a re-run can tell
# whether pip has anything to do.
install_source() {
	if [[ -n $wheel ]]; then
		printf 'wheel %s[%s] sha256:%s' "$(basename "$wheel")" "$extras" \
			"$(sha256sum <"$wheel" | cut -d' ' -f1)"
	elif [[ -n $version ]]; then
		printf 'index esi-sidecar[%s]==%s' "$extras" "$version"
	elif [[ -n $src_dir ]]; then
		# The files that make the package: a changed checkout reinstalls, an unchanged one
		# does not (build/ and *.egg-info are outputs, not inputs).
		local digest
		digest=$(cd "$src_dir" && find pyproject.toml README.md sidecar -type f \
			! -path '*/__pycache__/*' ! -name '*.pyc' 2>/dev/null | LC_ALL=C sort |
			xargs -d '\n' sha256sum | sha256sum | cut -d' ' -f1)
		printf 'checkout %s[%s] sha256:%s' "$src_dir" "$extras" "$digest"
	else
		printf 'index esi-sidecar[%s] (latest)' "$extras"
	fi
	if ((${#pip_args[@]})); then
		printf ' pip-args:%s' "${pip_args[*]}"
	fi
}

install_spec() {
	if [[ -n $wheel ]]; then
		printf '%s[%s]' "$wheel" "$extras"
	elif [[ -n $version ]]; then
		printf 'esi-sidecar[%s]==%s' "$extras" "$version"
	elif [[ -n $src_dir ]]; then
		printf '%s[%s]' "$src_dir" "$extras"
	else
		printf 'esi-sidecar[%s]' "$extras"
	fi
}

install_venv() {
	if [[ -x $venv/bin/python ]]; then
		say "venv: $venv (exists)"
		check_interpreter_visible "$venv/bin/python"
	elif [[ -e $venv && -n $(ls -A "$venv" 2>/dev/null) ]]; then
		die "$EXIT_USAGE" "$venv exists and is not a venv; choose another --prefix"
	else
		run "$python" -m venv "$venv"
		((dry_run)) || say "created venv: $venv"
		changed=$((changed + 1))
	fi
	local source stamp=$venv/$STAMP_NAME
	source=$(install_source)
	if [[ -f $stamp && -x $venv/bin/esi-sidecar ]] && [[ $(<"$stamp") == "$source" ]]; then
		say "unchanged: $venv (esi-sidecar from ${source%% *})"
		return 0
	fi
	changed=$((changed + 1))
	run "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
		"${pip_args[@]}" "$(install_spec)"
	if ((dry_run)); then
		return 0
	fi
	local imports='import fastapi, uvicorn, sidecar.host.daemon'
	if [[ $extras == *upload* ]]; then
		imports+=', boto3, sidecar.host.upload.transfer'
	fi
	if ! "$venv/bin/python" -c "$imports" 2>"$work/import.err"; then
		cat "$work/import.err" >&2
		die 1 "the venv lacks the [$extras] extras after pip install (see above)"
	fi
	printf '%s\n' "$source" >"$stamp"
	say "installed: $("$venv/bin/esi-sidecar" --version) in $venv"
}

# ------------------------------------------------------------------ the env file

# env_value VALUE: as systemd's EnvironmentFile= and a POSIX shell both read it back.
env_value() {
	local value=$1
	if [[ $value =~ ^[A-Za-z0-9_@%+=:,./-]*$ ]]; then
		printf '%s' "$value"
		return 0
	fi
	value=${value//\\/\\\\}
	value=${value//\"/\\\"}
	value=${value//\$/\\\$}
	value=${value//\`/\\\`}
	printf '"%s"' "$value"
}

is_secret() { [[ $1 == *SECRET* || $1 == *TOKEN* || $1 == *PASSWORD* ]]; }

masked() { # masked NAME VALUE: what may be printed
	if is_secret "$1"; then
		printf '****'
	elif [[ $1 == VOLCENGINE_ACCESS_KEY ]]; then
		printf '%s****' "${2:0:4}"
	else
		env_value "$2"
	fi
}

# write_env_lines OUT SHOWN: the env file to OUT and a masked copy to SHOWN. Only
# builtins touch the values, so a secret never appears in a process's arguments.
write_env_lines() {
	local out=$1 shown=$2 name value
	local -a names=()
	local session_token=${VOLCENGINE_SESSION_TOKEN:-}
	[[ -n $access_key ]] && names+=(VOLCENGINE_ACCESS_KEY)
	[[ -n $secret_key ]] && names+=(VOLCENGINE_SECRET_KEY)
	[[ -n $session_token ]] && names+=(VOLCENGINE_SESSION_TOKEN)
	names+=("${setting_order[@]}")
	{
		say "# esi-sidecar daemon settings, read by systemd (EnvironmentFile=) - mode 0600."
		say "# Written by install.sh; every setting is described in"
		say "# $ENV_DIR/esi-sidecar.env.example. After an edit: systemctl restart esi-sidecar"
		if [[ -z $access_key && -z $secret_key ]]; then
			say "# No VOLCENGINE_ACCESS_KEY/VOLCENGINE_SECRET_KEY: the SDK uses the instance's role."
		fi
	} | tee "$out" >"$shown"
	for name in "${names[@]}"; do
		case $name in
		VOLCENGINE_ACCESS_KEY) value=$access_key ;;
		VOLCENGINE_SECRET_KEY) value=$secret_key ;;
		VOLCENGINE_SESSION_TOKEN) value=$session_token ;;
		*) value=${settings[$name]} ;;
		esac
		if [[ $value == *$'\n'* || $value == *$'\r'* ]]; then
			die "$EXIT_USAGE" "$name: a value cannot hold a line break"
		fi
		printf '%s=%s\n' "$name" "$(env_value "$value")" >>"$out"
		printf '%s=%s\n' "$name" "$(masked "$name" "$value")" >>"$shown"
	done
}

# The installed package checks the file the way the daemon will read it: a typo stops
# the install here, not the service at every restart.
validate_env() { # validate_env FILE
	if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import sidecar.host.settings' 2>/dev/null; then
		if ((dry_run)); then
			say "note: the settings are checked by the installed package; a dry run installs none"
		else
			say "note: not checking the settings ($venv has no esi-sidecar to check them with)"
		fi
		return 0
	fi
	"$venv/bin/python" - "$1" <<'PY'
import re, sys
from sidecar.host.settings import OPTIONS, ConfigError, load_settings

path = sys.argv[1]
environ = {}
with open(path, encoding="utf-8") as lines:
    for line in lines:
        line = line.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        name, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = re.sub(r'\\(["\\`$])', r"\1", value[1:-1])
        environ[name.strip()] = value
known = {option.env for option in OPTIONS}
for name in sorted(environ):
    if name.startswith("ESI_SIDECAR_") and name not in known:
        print(f"install.sh: warning: {name} is not an esi-sidecar setting", file=sys.stderr)
try:
    load_settings(environ=environ)
except ConfigError as exc:
    print(f"install.sh: bad setting: {exc}", file=sys.stderr)
    sys.exit(2)
PY
}

install_env_file() {
	ensure_dir "$env_dir" 0700
	if [[ -f $deploy_dir/esi-sidecar.env.example ]]; then
		put_file "$deploy_dir/esi-sidecar.env.example" "$env_dir/esi-sidecar.env.example" 0644
	fi
	local candidate=$work/env shown=$work/env.shown
	(
		umask 077
		write_env_lines "$candidate" "$shown"
	)
	if [[ -f $env_file ]] && ! cmp -s "$candidate" "$env_file" && ! ((force_env)); then
		if [[ $(stat -c %a "$env_file") != 600 ]]; then
			run chmod 600 "$env_file"
			say "mode 600: $env_file"
			changed=$((changed + 1))
		fi
		if ((${#setting_order[@]})) || [[ -n $access_key || -n $secret_key ]]; then
			say "kept: $env_file (exists and differs from these settings; --force-env replaces it)"
		else
			say "kept: $env_file (exists)"
		fi
		validate_env "$env_file" || die "$EXIT_USAGE" "fix $ENV_FILE"
		return 0
	fi
	validate_env "$candidate" || die "$EXIT_USAGE" "nothing written"
	put_file "$candidate" "$env_file" 0600 "$shown"
	if ((secret_from_flag)); then
		warn "--secret-key on the command line is visible in ps and shell history;" \
			"VOLCENGINE_SECRET_KEY in the environment is not"
	fi
}

# ------------------------------------------------------------------ the unit

exec_start() { # the ExecStart command of a unit file, its %% (a literal %) unescaped
	sed -n 's/^ExecStart=//p' "$1" | head -n 1 | sed 's/%%/%/g'
}

# The package's own `esi-sidecar install` writes the unit (sidecar/host/install_service.py),
# so install.sh and a pip install never disagree on it; ExecStart names $prefix's binary.
install_unit() {
	local -a unit_command=("$venv/bin/esi-sidecar" install --unit-only
		--executable "$prefix/bin/esi-sidecar")
	[[ -n $root ]] && unit_command+=(--root "$root")
	ensure_dir "$(dirname "$unit_file")" 0755
	if ((dry_run)); then
		# The unit the installed package would write, compared; or, before the venv
		# exists (or with an older package), the command.
		if [[ -x $venv/bin/esi-sidecar ]] &&
			"${unit_command[@]}" --print >"$work/unit" 2>/dev/null; then
			local before=$changed
			put_file "$work/unit" "$unit_file" 0644
			unit_changed=$((changed - before))
		else
			rm -f "$work/unit"
			run "${unit_command[@]}"
			changed=$((changed + 1))
			unit_changed=1
		fi
		return 0
	fi
	local output
	output=$("${unit_command[@]}") || die 1 "esi-sidecar install --unit-only failed (see above)"
	say "$output"
	cp "$unit_file" "$work/unit"
	if [[ $output == wrote:* ]]; then
		changed=$((changed + 1))
		unit_changed=1
	fi
}

manual_start_hint() {
	local command="$prefix/bin/esi-sidecar serve" # the packaged unit's, until one is written
	if [[ -f $work/unit ]]; then
		command=$(exec_start "$work/unit")
	fi
	say ""
	if [[ -n $root ]]; then
		say "staging root $root: systemctl not called. To run the staged daemon by hand:"
		command=$root$command
	else
		say "systemd is not running on this host (no /run/systemd/system). Start the daemon"
		say "by hand, as the unit would (ExecStart=$command):"
	fi
	say "  install -d -m 0700 $state_dir"
	say "  env STATE_DIRECTORY=$state_dir sh -c 'set -a; . $env_file; set +a; exec $command'"
}

start_service() { # start_service ANYTHING_CHANGED
	if ((no_start)); then
		say "not started (--no-start): systemctl enable --now $UNIT_NAME"
		return 0
	fi
	if ! ((systemd_running)); then
		manual_start_hint
		return 0
	fi
	if ((unit_changed)); then
		run systemctl daemon-reload
		((dry_run)) || say "reloaded: systemctl daemon-reload"
	fi
	local was_active=0
	if systemctl is-active --quiet "$UNIT_NAME"; then
		was_active=1
	fi
	if ! systemctl is-enabled --quiet "$UNIT_NAME" 2>/dev/null || ! ((was_active)); then
		# Type=notify: this returns once the daemon said READY=1 (after its first poll).
		run systemctl enable --now "$UNIT_NAME"
		((dry_run)) || say "enabled and started: $UNIT_NAME"
		changed=$((changed + 1))
	elif (($1)); then
		run systemctl restart "$UNIT_NAME" # pick up the new venv, env file or unit
		((dry_run)) || say "restarted: $UNIT_NAME"
	else
		say "unchanged: $UNIT_NAME (enabled, running)"
	fi
	say "service: systemctl status $UNIT_NAME   logs: journalctl -u $UNIT_NAME -f"
}

# ------------------------------------------------------------------ uninstall

uninstall_all() {
	if ((systemd_running)) && [[ -f $unit_file ]]; then
		run systemctl disable --now "$UNIT_NAME" || warn "could not stop $UNIT_NAME"
	fi
	remove_path "$unit_file" "unit"
	if ((systemd_running)); then
		run systemctl daemon-reload
	fi
	if [[ -e $venv && ! -f $venv/pyvenv.cfg ]]; then
		warn "$venv is not a venv; left in place"
	else
		remove_path "$venv" "venv"
	fi
	remove_path "$env_dir/esi-sidecar.env.example" "example"
	if ((purge)); then
		remove_path "$env_file" "env file"
		if [[ -d $env_dir ]] && [[ -z $(ls -A "$env_dir") ]]; then
			run rmdir "$env_dir"
			((dry_run)) || say "removed: $env_dir"
		fi
		remove_path "$state_dir" "state"
		remove_path "$root/var/lib/private/esi-sidecar" "DynamicUser= state" # where the link points
	elif [[ -f $env_file ]]; then
		say "kept: $env_file (your settings; --purge removes it)"
	fi
}

# ------------------------------------------------------------------ main

mode="install"
((uninstall)) && mode="uninstall"
((venv_only)) && mode="venv-only install"
say "esi-sidecar ${mode}: prefix $prefix${root:+, staging root $root}${src_dir:+, from $src_dir}$(
	((dry_run)) && printf ' (dry run: nothing is changed)'
)"

if ((uninstall)); then
	uninstall_all
	say "$( ((dry_run)) && printf 'would remove' || printf 'removed') $changed item(s)"
	exit 0
fi

check_python
unit_changed=0
install_venv
if ! ((venv_only)); then
	install_unit
	install_env_file
	start_service "$changed"
fi
if ((changed == 0)); then
	say "done: everything unchanged"
elif ((dry_run)); then
	say "dry run: $changed change(s) would be made"
else
	say "done: $changed change(s)"
fi
