#!/usr/bin/env bash
# Start (idempotently) or stop the host Docker engine on the default socket.
set -euo pipefail
SOCK=/var/run/docker.sock
PID=/var/run/docker.pid
LOG=/var/log/runner-host-dockerd.log
ready() { docker -H "unix://$SOCK" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
case "${1:-start}" in
  start)
    ready && exit 0
    if [[ -f $PID ]] && ! kill -0 "$(cat $PID)" 2>/dev/null; then rm -f "$PID"; fi
    echo "[setup] starting host dockerd (log: $LOG)" >&2
    setsid nohup dockerd --host "unix://$SOCK" --pidfile "$PID" --data-root /var/lib/docker \
      --exec-root /var/run/docker --bridge none --iptables=false --ip-masq=false \
      >"$LOG" 2>&1 < /dev/null &
    for _ in $(seq 1 120); do ready && exit 0; sleep 0.5; done
    echo "[setup] error: host dockerd did not come up within 60 s; last log lines:" >&2
    tail -n 20 "$LOG" >&2
    exit 1 ;;
  stop)
    [[ -f $PID ]] && kill "$(cat $PID)" 2>/dev/null || true ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
