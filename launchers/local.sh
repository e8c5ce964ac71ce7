#!/usr/bin/env bash
# N JAX CPU processes on this machine forming one mesh (development and tests of multi-process code):
#
#   launchers/local.sh N CONFIG.py[:ARG] [key=value ...]
#
# Each process gets MAXOFFLOAD_CPU_DEVICES_PER_TASK (default 2) simulated CPU devices, gloo collectives
# and explicit distributed.* settings with a free localhost port, so N=2 with 2 devices each trains on
# the same 4-device mesh (and gives the same losses) as one process with 4 devices. Only process 0 prints
# progress and writes run.output_dir. Waits for all; if one fails, the others are stopped and the script
# exits with the failing process's status. Paths are relative to the current directory, as for train.py.
# PYTHON selects the interpreter (default python3).
set -euo pipefail

usage() { echo "usage: launchers/local.sh N CONFIG.py[:ARG] [key=value ...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
n=$1
shift
case "$n" in '' | *[!0-9]* | 0) echo "error: N=$n must be a positive number of processes" >&2; usage ;; esac
k=${MAXOFFLOAD_CPU_DEVICES_PER_TASK:-2}
case "$k" in
    '' | *[!0-9]* | 0) echo "error: MAXOFFLOAD_CPU_DEVICES_PER_TASK=$k is not a positive integer" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
train=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/train.py
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
declare -a done_=()
signal_running() {  # SIGNAL: to every process still running
    local i
    for ((i = 0; i < ${#pids[@]}; i++)); do
        [ -n "${done_[$i]:-}" ] || kill "-$1" "${pids[$i]}" 2>/dev/null || true
    done
}
kill_at=""   # when set: SIGKILL whatever still runs at this time ($SECONDS)
interrupts=0
on_interrupt() {
    interrupts=$((interrupts + 1))
    if [ "$interrupts" = 1 ]; then
        echo "local.sh: interrupted; SIGTERM to all processes (the trainer saves and exits 42); again to kill" >&2
        signal_running TERM
    else
        signal_running KILL
    fi
}
trap on_interrupt INT TERM

echo "local.sh: $n processes x $k CPU devices, coordinator localhost:$port" >&2
for ((i = 0; i < n; i++)); do
    JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$k" \
        "$PYTHON" "$train" "$@" distributed.coordinator_address="localhost:$port" \
        distributed.num_processes="$n" distributed.process_id="$i" &
    pids+=($!)
done

# Poll rather than `wait -n` (bash >= 5.1 for -p): collect each exit status as its process ends. When one
# fails, the others cannot finish (their collectives lack a peer): SIGTERM, then SIGKILL after 5 s.
status=0
running=$n
while [ "$running" -gt 0 ]; do
    for ((i = 0; i < n; i++)); do
        [ -z "${done_[$i]:-}" ] || continue
        kill -0 "${pids[$i]}" 2>/dev/null && continue
        rc=0
        wait "${pids[$i]}" || rc=$?
        done_[$i]=1
        running=$((running - 1))
        if [ "$rc" != 0 ] && [ "$status" = 0 ]; then
            status=$rc
            if [ "$interrupts" = 0 ] && [ "$running" -gt 0 ]; then
                echo "local.sh: process $i exited with status $rc; stopping the others" >&2
                signal_running TERM
                kill_at=$((SECONDS + 5))
            fi
        fi
    done
    if [ -n "$kill_at" ] && [ "$SECONDS" -ge "$kill_at" ]; then
        signal_running KILL
        kill_at=""
    fi
    [ "$running" -gt 0 ] && sleep 0.2
done
exit "$status"
