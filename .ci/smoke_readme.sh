#!/usr/bin/env bash
# The README's first command on a fresh machine: in a new venv (no extras, nothing from the test
# environment), run the README's install-and-serve command as written, wait for /health, ask one chat
# completion with the openai client of the calling environment, then SIGTERM the server and expect
# exit 0. The command is read out of the README, so the README and this check cannot drift apart.
#
# Usage: .ci/smoke_readme.sh            (from the repository root; needs `openai` in the caller's python)
# Env:   SMOKE_VENV (default: a temporary directory), SMOKE_HEALTH_TIMEOUT_S (default 600).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
caller_python=$(command -v python3 || command -v python)

# The first line of the README's first ```bash block that runs `kvledger serve`: install && ... && kvledger serve
cmd=$(awk '/^```bash/{inb=1; next} /^```/{inb=0} inb && /kvledger serve/ {print; exit}' README.md)
case "$cmd" in
    *"&& kvledger serve") ;;
    *) echo "smoke: the README's first command must end with '&& kvledger serve'; found: '$cmd'" >&2; exit 1 ;;
esac
install_cmd=${cmd%" && kvledger serve"}
echo "smoke: README command: $cmd"

venv=${SMOKE_VENV:-$(mktemp -d /tmp/kvledger-smoke-venv.XXXXXX)}
log=$(mktemp /tmp/kvledger-smoke-serve.XXXXXX.log)
server_pid=""
cleanup() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then kill -9 "$server_pid" 2>/dev/null || true; fi
    [ -n "${SMOKE_VENV:-}" ] || rm -rf "$venv"
}
trap cleanup EXIT

"$caller_python" -m venv "$venv"
(
    # A new venv only: nothing of the caller's environment leaks in.
    unset PYTHONPATH VIRTUAL_ENV PYTHONHOME
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    cd "$root"
    echo "smoke: installing in $venv: $install_cmd"
    start=$(date +%s)
    bash -c "$install_cmd" >"$log.install" 2>&1 || { tail -40 "$log.install" >&2; echo "smoke: install failed" >&2; exit 1; }
    echo "smoke: installed in $(( $(date +%s) - start )) s"
)

port=$("$caller_python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "smoke: kvledger serve --port $port"
(
    unset PYTHONPATH VIRTUAL_ENV PYTHONHOME
    cd "$root"
    exec "$venv/bin/kvledger" serve --port "$port"
) >"$log" 2>&1 &
server_pid=$!

start=$(date +%s)
deadline=$(( start + ${SMOKE_HEALTH_TIMEOUT_S:-600} ))
until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
        tail -60 "$log" >&2; echo "smoke: the server exited before it was healthy" >&2; exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        tail -60 "$log" >&2; echo "smoke: not healthy after ${SMOKE_HEALTH_TIMEOUT_S:-600} s" >&2; exit 1
    fi
    sleep 0.5
done
echo "smoke: healthy after $(( $(date +%s) - start )) s"

"$caller_python" - "$port" <<'PY'
import sys

import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none", timeout=120)
model = client.models.list().data[0].id
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32
)
answer = r.choices[0].message.content or ""
print(f"smoke: chat answer ({model}): {answer!r}")
if not answer.strip():
    sys.exit("smoke: empty chat answer")
PY

kill -TERM "$server_pid"
set +e
wait "$server_pid"
rc=$?
set -e
server_pid=""
if [ "$rc" -ne 0 ]; then
    tail -40 "$log" >&2; echo "smoke: the server exited $rc after SIGTERM (expected 0)" >&2; exit 1
fi
echo "smoke: SIGTERM -> exit 0; the README's first command works in a new venv"
