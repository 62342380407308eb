#!/usr/bin/env bash
# Makes the secrets compose.yaml mounts, in ./secrets (or the folder given): a CA, a TLS
# certificate for the store and one for the workers (named for the compose services and
# localhost), two random bearer tokens and the token table that admits them, and S3 keys
# for the object-store profile (SeaweedFS's identity, the store's credentials). Development
# only; keeps what is already there. Needs openssl and sha256sum.
#
#   bash deploy/compose/make-secrets.sh [DIR]
set -euo pipefail
OUT="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets}"
mkdir -p "$OUT"
cd "$OUT"
if [ -e tokens.json ]; then
  echo "make-secrets: $OUT already holds secrets; remove it to make new ones" >&2
  exit 0
fi
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -out ca.pem -days 365 -subj "/CN=agentkv development CA"

cert() {  # NAME SUBJECT-ALT-NAMES
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$1"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$2" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
cert store "DNS:store,DNS:localhost,IP:127.0.0.1"
cert worker "DNS:worker-1,DNS:worker-2,DNS:localhost,IP:127.0.0.1"
rm -f ca.srl

openssl rand -hex 32 >store-token   # the workers' token at the store
openssl rand -hex 32 >client-token  # for SDK and CLI clients, at the store and the workers
digest() { tr -d '\n' <"$1" | sha256sum | cut -d' ' -f1; }
cat >tokens.json <<JSON
{"tokens": [
  {"name": "workers", "sha256": "$(digest store-token)", "namespaces": ["*"]},
  {"name": "client", "sha256": "$(digest client-token)", "namespaces": ["*"]}
]}
JSON

# The object-store profile: one S3 identity for SeaweedFS, and the same keys as AWS's
# shared credentials file for the store.
access="$(openssl rand -hex 10)"
secret="$(openssl rand -hex 20)"
cat >s3.json <<JSON
{"identities": [{"name": "agentkv-store",
  "credentials": [{"accessKey": "$access", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
JSON
printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n' "$access" "$secret" \
  >aws-credentials

# Compose bind-mounts file secrets as they are, so the containers' user (uid 10001) must be
# able to read them. ca.key stays private: it is never mounted.
chmod 0644 ca.pem store.pem store.key worker.pem worker.key store-token tokens.json \
  s3.json aws-credentials
echo "make-secrets: wrote $OUT (client token: $OUT/client-token)" >&2
