#!/bin/bash
# Two "hosts" on one machine for the rendezvous (issue 37, docs/multinode.md), no GPU: two network
# namespaces joined by a veth pair, 10.77.0.1 (host 0) and 10.77.0.2 (host 1), neither with a way to the
# other but that link, each running `python nanoeuler_cuda.py rendezvous --nnodes 2`; then what a real
# network adds to the faults: rank 0's address on the subnet with no host behind it (the packets go
# nowhere, no refusal comes), and rank 0's host not up yet when host 1 starts asking.
# Needs root and iproute2. bash dev/multinode_netns.sh > dev/logs/multinode/netns_cpu.log
set -u
cd "$(dirname "$0")/.."
H0=ne_host0; H1=ne_host1
cleanup() { ip netns del $H0 2> /dev/null; ip netns del $H1 2> /dev/null; }
trap cleanup EXIT
cleanup
ip netns add $H0 && ip netns add $H1 || { echo "no network namespaces here (root and iproute2 needed)"; exit 1; }
ip link add ne_veth0 type veth peer name ne_veth1
ip link set ne_veth0 netns $H0 && ip link set ne_veth1 netns $H1
ip -n $H0 addr add 10.77.0.1/24 dev ne_veth0 && ip -n $H1 addr add 10.77.0.2/24 dev ne_veth1
for h in $H0 $H1; do ip -n $h link set lo up; done
ip -n $H0 link set ne_veth0 up && ip -n $H1 link set ne_veth1 up
check() {   # check HOST ARGS...: the rendezvous command in HOST's namespace, its output and exit code
  local host=$1; shift
  echo "[$host] \$ python nanoeuler_cuda.py rendezvous $*"
  ip netns exec "$host" python nanoeuler_cuda.py rendezvous "$@" 2>&1
  echo "[$host] exit code $?"
}
echo "# $(date -u +%F): two namespaces as two hosts, host 1 started first"
check $H1 --nnodes 2 --node-rank 1 --master-addr 10.77.0.1 --master-port 29700 > /tmp/ne_host1.log &
check $H0 --nnodes 2 --node-rank 0 --master-addr 10.77.0.1 --master-port 29700
wait; cat /tmp/ne_host1.log
echo
echo "# rank 0's address has no host behind it: host 1 asks until --rendezvous-timeout (10 s), then names it"
s=$EPOCHREALTIME
check $H1 --nnodes 2 --node-rank 1 --master-addr 10.77.0.9 --master-port 29701 --rendezvous-timeout 10
echo "($(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $s}") s)"
echo
echo "# host 0 starts 3 s after host 1, which keeps asking (refused) until it answers"
check $H1 --nnodes 2 --node-rank 1 --master-addr 10.77.0.1 --master-port 29702 > /tmp/ne_host1.log &
sleep 3
check $H0 --nnodes 2 --node-rank 0 --master-addr 10.77.0.1 --master-port 29702
wait; cat /tmp/ne_host1.log
rm -f /tmp/ne_host1.log
