#!/bin/bash
# The restore-level measurement behind 2026-11-29-iptables-foreign-rule.md (issue #29):
# iptables-restore of a kube-proxy-shaped nat table (N services x 5 endpoints: KUBE-SERVICES,
# one KUBE-SVC chain per service with 5 probability jumps, one KUBE-SEP chain per endpoint with
# a masquerade-mark jump and a DNAT) in fresh network namespaces, each way kproxy has applied it:
#   whole    restore without --noflush (the old clean-table path; replaces nat as a whole)
#   noflush  --noflush (upstream's way, kproxy's old path beside a foreign rule)
#   bulk     --noflush with a chain-less `-S` after `*nat` (kproxy's path now; nft only)
# "cold": into a nat table holding nothing (clean) or only Docker's masquerade rule (foreign);
# "resync": the same input again over the table it left. Prints one line per restore: backend,
# variant, N, wall s, user s, sys s. Usage (root): ROUNDS=3 N=10000 bash THIS > out.txt
set -u
N=${N:-10000}; ROUNDS=${ROUNDS:-3}; DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
python3 - "$N" > "$DIR/in.txt" <<'PY'
import sys, hashlib
n = int(sys.argv[1])
h = lambda s, p: p + hashlib.sha256(s.encode()).hexdigest()[:16].upper()
chains = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"]
rules = ["-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
         "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
         "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
         "-A KUBE-POSTROUTING -j MASQUERADE --random-fully"]
svc = []
for i in range(n):
    s = h("svc%d" % i, "KUBE-SVC-"); chains.append(s)
    ip = "10.%d.%d.%d" % (96 + (i >> 16), (i >> 8) & 255, i & 255)
    svc.append('-A KUBE-SERVICES -d %s/32 -p tcp -m comment --comment "ns/s%d:p80 cluster IP" -m tcp --dport 80 -j %s' % (ip, i, s))
    for e in range(5):
        sep = h("sep%d-%d" % (i, e), "KUBE-SEP-"); chains.append(sep)
        pip = "10.%d.%d.%d" % (128 + (i >> 13), (i >> 5) & 255, ((i & 31) << 3) | e)
        prob = " -m statistic --mode random --probability %.11f" % (1.0 / (5 - e)) if e < 4 else ""
        rules.append('-A %s -m comment --comment "ns/s%d:p80 -> %s:80"%s -j %s' % (s, i, pip, prob, sep))
        rules.append("-A %s -s %s/32 -m comment --comment ns/s%d:p80 -j KUBE-MARK-MASQ" % (sep, pip, i))
        rules.append("-A %s -p tcp -m comment --comment ns/s%d:p80 -m tcp -j DNAT --to-destination %s:80" % (sep, i, pip))
svc.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS')
print("\n".join(["*nat"] + [":%s - [0:0]" % c for c in chains] + svc + rules + ["COMMIT"]))
PY
sed '1a -S' "$DIR/in.txt" > "$DIR/in-bulk.txt"
FOREIGN=(-t nat -A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE)

# one BACKEND VARIANT STATE(cold|resync) TABLE(clean|foreign)
one() {
    local b=$1 v=$2 state=$3 table=$4 ns=ipx-$$ args=(-w 5) input=$DIR/in.txt
    ip netns add $ns
    [ "$table" = foreign ] && ip netns exec $ns iptables-$b "${FOREIGN[@]}"
    [ "$v" = whole ] || args+=(--noflush)
    [ "$v" = bulk ] && input=$DIR/in-bulk.txt
    [ "$state" = resync ] && ip netns exec $ns iptables-$b-restore "${args[@]}" < $input > /dev/null
    local s e
    s=$(date +%s.%N)
    timeout ${TIMEOUT:-600} /usr/bin/time -f "%U %S" -o $DIR/t ip netns exec $ns iptables-$b-restore "${args[@]}" < $input > /dev/null
    local rc=$?
    e=$(date +%s.%N)
    if [ "$table" = foreign ] && ! ip netns exec $ns iptables-$b-save -t nat | grep -qx -- "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE"; then
        rc=lost-foreign
    fi
    echo "$b $v $state $table $N rc=$rc wall=$(echo "$e - $s" | bc) usr_sys=$(tail -1 $DIR/t 2>/dev/null)"
    ip netns del $ns
}
for r in $(seq "$ROUNDS"); do
    for state in cold resync; do
        one nft whole $state clean
        one nft bulk $state clean
        one nft bulk $state foreign
        one legacy whole $state clean
        one legacy noflush $state foreign
    done
done
# The old path beside a foreign rule on nft (minutes at 10k: once, bounded by TIMEOUT).
[ -n "${OLD_NOFLUSH:-}" ] && one nft noflush cold foreign
exit 0
