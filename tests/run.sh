#!/usr/bin/env bash
# Install what the tests need (venv, packages, Debian's iptables) and run the whole suite.
#
# With no arguments, as root, where network namespaces work, the suite runs as two halves at once
# (most tests wait on elections, timeouts and other processes, not on a core): the tests that make
# namespaces or iptables rules of their own run in the root namespace, every other test in a
# network namespace made for this run, with a loopback of its own, so the halves never share a
# port (gloo, which finds its interface by the host's name, is told to use that loopback).
# Anywhere else, or with arguments (`bash tests/run.sh tests/test_cli.py -k down`), one
# pytest runs what is asked.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/cluster/setup.sh" --test
cd "$ROOT"
PY=.venv/bin/python

ns="raftps-tests-$$"
if [ $# -gt 0 ] || [ "$(id -u)" != 0 ] || ! ip netns add "$ns" 2>/dev/null; then
  exec "$PY" -m pytest -q "$@"
fi
trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
ip netns exec "$ns" ip link set lo up
# Tests bind fixed ports below 45000; a client's ephemeral port from the kernel's default range
# (32768-60999) once took one of them ("address already in use"). This namespace's own range
# keeps them apart.
ip netns exec "$ns" sh -c 'echo "45000 60999" > /proc/sys/net/ipv4/ip_local_port_range'

# The half that shapes, cuts and partitions networks: every test file that names them.
mapfile -t netfault < <(grep -rlE --include='test_*.py' 'netns|iptables|Fleet\(' tests | sort)
ignore=()
for f in "${netfault[@]}"; do ignore+=(--ignore "$f"); done
log="$(mktemp -t raftps-netfault.XXXXXX.log)"
echo "tests: ${#netfault[@]} network-fault files in the root namespace (log: $log), the rest in namespace $ns"

"$PY" -m pytest -q -p no:cacheprovider "${netfault[@]}" >"$log" 2>&1 &
netfault_pid=$!
rest=0
ip netns exec "$ns" env GLOO_SOCKET_IFNAME=lo "$PY" -m pytest -q -p no:cacheprovider "${ignore[@]}" tests || rest=$?
netfault_rc=0
wait "$netfault_pid" || netfault_rc=$?
echo
echo "---- network-fault tests (root namespace) ----"
cat "$log"
rm -f "$log"
echo "tests: network-fault half exit $netfault_rc, the rest exit $rest"
[ "$rest" = 0 ] && [ "$netfault_rc" = 0 ]
