#!/usr/bin/env bash
# Make a private CA and one node certificate for the client ports' TLS, with openssl.
# Usage: cluster/make-certs.sh DIR [IP_OR_NAME ...]   (default name: 127.0.0.1)
# Writes DIR/ca.pem (give it to clients: Client(..., tls="DIR/ca.pem") or RAFTPS_TLS_CA),
# DIR/node.pem + DIR/node.key (serve --tls-cert/--tls-key; LocalCluster(tls_dir=DIR)).
# Keys are mode 600; the CA key (DIR/ca.key) can be moved offline once the node cert is made.
# An existing DIR/ca.pem is reused, so running it again with more names adds a fresh node cert.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [IP_OR_NAME ...]" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-certs: openssl not found (apt-get install openssl)" >&2; exit 1; }
trap 'echo "make-certs: openssl failed (line $LINENO of $0)" >&2' ERR
DIR="$1"
shift
NAMES=("${@:-127.0.0.1}")
mkdir -p "$DIR"
umask 077
SAN=""
for n in "${NAMES[@]}"; do
  if [[ "$n" =~ ^[0-9.]+$ || "$n" == *:* ]]; then SAN+="IP:$n,"; else SAN+="DNS:$n,"; fi
done
SAN="${SAN%,}"
if [ ! -f "$DIR/ca.pem" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
    -subj "/CN=raftps local CA" -keyout "$DIR/ca.key" -out "$DIR/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=raftps node" \
  -keyout "$DIR/node.key" -out "$DIR/node.csr" 2>/dev/null
openssl x509 -req -in "$DIR/node.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" -CAcreateserial -days 825 \
  -extfile <(printf "subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n" "$SAN") \
  -out "$DIR/node.pem" 2>/dev/null
rm -f "$DIR/node.csr" "$DIR/ca.srl"
chmod 644 "$DIR/ca.pem" "$DIR/node.pem"
echo "make-certs: $DIR/ca.pem (CA), $DIR/node.pem + node.key for $SAN"
