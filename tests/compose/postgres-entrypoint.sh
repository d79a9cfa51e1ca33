#!/bin/sh
# The compose test's PostgreSQL: Debian's postgresql-15 made to behave as the official
# image's entrypoint does for docker-compose.yml (POSTGRES_USER, POSTGRES_PASSWORD,
# POSTGRES_DB and PGPORT; a data dir initialised on first start, with the final server
# started only once the database exists, so a TCP healthcheck passes only then).
# POSTGRES_INIT_DELAY_SECS: the test's fault, an initialisation that takes that long.
set -eu
BIN=/usr/lib/postgresql/15/bin
DATA=/var/lib/postgresql/data
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }

mkdir -p "$DATA" /run/postgresql
chown postgres:postgres "$DATA" /run/postgresql
chmod 700 "$DATA"
if [ ! -s "$DATA/PG_VERSION" ]; then
    echo "initialising the data dir (delay ${POSTGRES_INIT_DELAY_SECS:-0}s)"
    sleep "${POSTGRES_INIT_DELAY_SECS:-0}"
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres "$BIN/initdb" --pgdata="$DATA" --username="$POSTGRES_USER" \
        --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    # As the official image: a socket-only server while the database is created.
    as_postgres "$BIN/pg_ctl" --pgdata="$DATA" --wait \
        --options="-c listen_addresses='' -k /run/postgresql -p $PGPORT" start >/dev/null
    as_postgres "$BIN/createdb" --host=/run/postgresql --port="$PGPORT" \
        --username="$POSTGRES_USER" "$POSTGRES_DB"
    as_postgres "$BIN/pg_ctl" --pgdata="$DATA" --wait --mode=fast stop >/dev/null
    echo "data dir initialised"
fi
[ "$1" = postgres ] && shift
exec setpriv --reuid=postgres --regid=postgres --init-groups \
    "$BIN/postgres" -D "$DATA" -k /run/postgresql -p "$PGPORT" "$@"
